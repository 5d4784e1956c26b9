"""The OpenAI-compatible HTTP API on rank 0: /v1/completions, /v1/chat/completions (SSE streaming), OpenAI's Responses
API (response_routes.py), Anthropic's Messages API (messages.py), /v1/models,
/health (and vLLM's /ping), /metrics, /version, and vLLM's /tokenize, /detokenize and /tokenizer_info
(token_routes.py), behind an API key where one is set (auth.py: a 401 without it). Every mistake in a request is a 400
(404 for an unknown model) with an OpenAI error body, and the server keeps serving; a client that disconnects aborts
its request."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import itertools
import logging
import time
import uuid
from collections.abc import AsyncIterator, Callable

from fastapi import Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.exceptions import HTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from tpgraph import __version__
from tpgraph.chat import content_text
from tpgraph.engine.beam_search import (
    BeamSearchParams,
    BeamSearchSequence,
    Candidates,
    check_width,
    run_beam_search_async,
)
from tpgraph.engine.logprob import logprob_entry
from tpgraph.engine.sampling_params import SamplingParams
from tpgraph.engine.updates import REFUSED, StepUpdate
from tpgraph.errors import RequestError
from tpgraph.prompts import EngineTokenizer, PromptCodec
from tpgraph.server.auth import ApiKeyMiddleware, route_path
from tpgraph.server.body_text import refuse_lone_surrogates
from tpgraph.server.bridge import UNAVAILABLE, EngineClient, EngineUnavailable
from tpgraph.server.errors import ApiError, error_body, refusal_body
from tpgraph.server.messages import message_routes
from tpgraph.server.metrics import ServerMetrics
from tpgraph.server.options import HttpOptions
from tpgraph.server.protocol import ChatRequest, CompletionRequest, request_template
from tpgraph.server.reasoning import ReasoningParser, ReasoningReader
from tpgraph.server.relay import Relay, RelayMiddleware
from tpgraph.server.reply import ReplyReader
from tpgraph.server.request_ids import RequestIdMiddleware, request_id
from tpgraph.server.response_routes import response_routes
from tpgraph.server.response_store import ResponseStore
from tpgraph.server.sse import EventStream, sse
from tpgraph.server.token_routes import token_routes
from tpgraph.server.tools import ToolOptions
from tpgraph.server.turn import NOT_BEGUN, ChatTurn, Choice, RenderedChat, chained, submitted

logger = logging.getLogger(__name__)
# how often a request waiting on the engine checks whether its client is still there
DISCONNECT_CHECK_S = 0.5


def server_error_reply(scope: Scope, exc: Exception) -> JSONResponse:
    """A failure no route answered (a bug's): a 500 in the error shape its client reads, naming it as vLLM's routes
    do, not Starlette's plain-text page."""
    message = str(exc) or type(exc).__name__  # (an exception of no words: AssertionError())
    return JSONResponse(refusal_body(route_path(scope), 500, message, "InternalServerError"), 500)


class ServerErrorReplies:
    """Answers a failure no route answered with server_error_reply, inside the server's other middleware, so that the
    500 carries X-Request-Id and the CORS headers as every other reply does (Starlette answers it in its outermost
    middleware, outside them), then raises it on, for uvicorn to log its traceback. Plain ASGI middleware (auth.py
    says why)."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        started = False

        async def noting_start(message: Message) -> None:
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, receive, noting_start)
        except Exception as exc:
            if not started:  # (a stream that failed after its 200 is ended by its own guard, or cut)
                await server_error_reply(scope, exc)(scope, receive, send)
            raise


class Api:
    def __init__(self, client: EngineClient, metrics: ServerMetrics, model_name: str,
                 http: HttpOptions | None = None, served_names: tuple[str, ...] = ()) -> None:
        """served_names: every name a request may give, model_name (the one replies give) first; () for it alone."""
        self.client, self.metrics, self.model_name = client, metrics, model_name
        self.http = http or HttpOptions()
        if served_names and served_names[0] != model_name:  # (replies name the first; requests may give any)
            raise ValueError(f"served_names must begin with model_name {model_name!r}, got {served_names!r}")
        self.served_names = served_names or (model_name,)

    def check_model(self, name: str | None) -> None:
        """A request's model must be one served; one that names none (null or "", as vLLM's _is_model_supported
        reads any falsy name) gets the first."""
        if name and name not in self.served_names:
            served = ", ".join(f"`{n}`" for n in self.served_names)
            raise ApiError(404, f"The model `{name}` does not exist; this server serves {served}.", "NotFoundError",
                           "model")

    def run(self, request: Request, prompts: list[list[int]], params: SamplingParams | list[SamplingParams],
            texts: list[str | list[int]] | None = None, log: bool = True,
            names: list[str] | None = None) -> AsyncIterator[tuple[int, StepUpdate]]:
        """Each prompt's updates as an engine request: (prompt index, update), until every sample finished. The
        prompts are checked here, as the stream is made (a refusal raises now, before anything waits on the engine);
        they are submitted as it is first read. Aborts whatever is unfinished if the client goes away or the caller
        stops early. params: every prompt's, or each prompt's (of one n). texts: the prompts as the client gave them,
        for the request log; log: False where the caller logged the request (a beam search's steps); names: each
        prompt's name in the request log, as vLLM's log names it by the reply's id (default: its engine request's
        id)."""
        each = params if isinstance(params, list) else [params] * len(prompts)
        for prompt, p in zip(prompts, each, strict=True):  # all or nothing: a refused prompt queues none of the others
            self.client.check(prompt, p)
        if self.client.error is not None:  # (said now, as submitting would: a background response is not queued)
            raise EngineUnavailable(f"the engine stopped: {self.client.error}")
        return self._submitted(request, prompts, each, texts, log, names)

    async def _submitted(self, request: Request, prompts: list[list[int]], each: list[SamplingParams],
                         texts: list[str | list[int]] | None, log: bool,
                         names: list[str] | None) -> AsyncIterator[tuple[int, StepUpdate]]:
        """run's stream: the checked prompts submitted, and their updates."""
        # (each update stamped as it arrives: the metrics time its delivery, not when a slow reader takes it)
        queue: asyncio.Queue[tuple[int, StepUpdate, float] | None] = asyncio.Queue()  # (None: _Ticker's tick)
        ids = [f"req-{uuid.uuid4().hex}" for _ in prompts]
        open_samples = {rid: p.n for rid, p in zip(ids, each, strict=True)}
        samples_left = sum(open_samples.values())  # (kept as they end: not rescanned per update)
        ended = "abort"  # how the requests still open at the end are counted
        ended_at: float | None = None  # when an update ended them (refused, error); else when the loop stops
        # the prompts handed to the engine: where a send finds the engine gone, that prompt and those after it never
        # started, so they are neither aborted nor counted as finished (each was counted as a request ended "error")
        taken = 0
        ticker: _Ticker | None = None
        try:
            for i, (rid, prompt) in enumerate(zip(ids, prompts, strict=True)):
                if self.http.log_requests and log:
                    self.log_request(rid if names is None else names[i], None if texts is None else texts[i],
                                     prompt, each[i])
                self.metrics.arrived(rid, len(prompt), each[i].n, each[i].max_tokens)
                taken += 1
                try:
                    self.client.submit(rid, prompt, each[i],
                                       lambda u, i=i: queue.put_nowait((i, u, time.perf_counter())))
                except EngineUnavailable:  # (nothing sent, no sink kept: nothing to abort)
                    taken -= 1
                    self.metrics.forget(rid)
                    raise
            loop = asyncio.get_running_loop()
            next_check = loop.time() + DISCONNECT_CHECK_S
            ticker = _Ticker(loop, queue)
            while samples_left:
                item, update = await queue.get(), None
                if item is not None:
                    i, update, received = item
                # on a timer, not only when updates pause: a decoding request has one every few ms, and a
                # non-streaming one has no other way to learn that its client left (a tick: a wait's end)
                if item is None or loop.time() >= next_check:
                    if await request.is_disconnected():
                        return
                    next_check = loop.time() + DISCONNECT_CHECK_S
                if update is None:
                    continue
                if update.finish_reason in (REFUSED, "error", UNAVAILABLE):  # (timed at delivery, not as read)
                    ended_at = received
                if update.finish_reason == REFUSED:  # (by the engine as it came to add it: a bad schema, ...)
                    samples_left -= open_samples[ids[i]]
                    open_samples[ids[i]] = 0  # (never added: nothing to abort)
                    self.metrics.finished(ids[i], REFUSED, received)
                    ended = REFUSED  # (the others share its params; any the engine took is aborted all the same)
                    raise RequestError(update.text)
                if update.finish_reason == UNAVAILABLE:  # the engine is gone (shut down, or unreachable): a 503
                    raise EngineUnavailable(f"the engine is unavailable: {update.text}")
                if update.finish_reason == "error":  # a failed step: a 500, also where the engine loop went with it
                    raise ApiError(500, f"the engine failed: {update.text}", "InternalServerError")  # (vLLM's type)
                self.metrics.observe(update, received)
                if update.finish_reason is not None:
                    open_samples[ids[i]] -= 1
                    samples_left -= 1
                    if not open_samples[ids[i]]:
                        self.metrics.finished(ids[i], update.finish_reason, received)
                yield i, update
        except (ApiError, EngineUnavailable):  # the engine failed (a step, or it is gone): no client aborted these
            ended = "error"
            raise
        finally:
            if ticker is not None:
                ticker.stop()
            aborted = []
            for i, (rid, left) in enumerate(itertools.islice(open_samples.items(), taken)):
                if left:  # the client went away (or the caller stopped, or one was refused): the engine drops the rest
                    self.client.abort(rid)
                    self.metrics.finished(rid, ended, ended_at)
                    aborted.append(rid if names is None else names[i])
                else:
                    self.client.release(rid)
            if aborted and self.http.log_requests and log:  # (vLLM's line, beside the one that said each arrived)
                logger.info("Aborted request(s) %s.", ",".join(aborted))

    def beam_search(self, request: Request, prompts: list[list[int]], beam: BeamSearchParams,
                    params: SamplingParams, eos_token_id: int | None, decode: Callable[[list[int]], str],
                    texts: list[str | list[int]] | None = None,
                    names: list[str] | None = None) -> AsyncIterator[tuple[int, StepUpdate]]:
        """vLLM's use_beam_search: the offline API's search (beam_search.py) run through this server's own requests,
        each step's live beams one ordinary request each for one token (Api.run: checked, sent to the engine, and so
        to every rank, as any other request, aborted where the client goes away). The search is checked here, as
        run's prompts are; its stream yields, as run's does, each prompt's updates once its search ends: its
        sequences, best first, as samples 0, 1, ... (_beam_updates). params: the reply's (n the beam width, logprobs,
        skip_special_tokens), its seed, priority and cache_salt each step's too. decode: a sequence's text from its
        token ids; texts and names: the request log's, as run's. A client that goes away ends it with nothing
        yielded."""
        check_width(beam.beam_width, self.client.limits.max_logprobs, "n", " with use_beam_search", "server")
        # the whole search's limits, before any step: the prompt, max_tokens beside it, the steps' log-probabilities
        whole = SamplingParams(temperature=beam.temperature, max_tokens=beam.max_tokens,
                               logprobs=2 * beam.beam_width, seed=params.seed, priority=params.priority,
                               cache_salt=params.cache_salt)
        for prompt in prompts:
            self.client.check(prompt, whole)
        return self._searched(request, prompts, beam, params, eos_token_id, decode, texts, names)

    async def _searched(self, request: Request, prompts: list[list[int]], beam: BeamSearchParams,
                        params: SamplingParams, eos_token_id: int | None, decode: Callable[[list[int]], str],
                        texts: list[str | list[int]] | None,
                        names: list[str] | None) -> AsyncIterator[tuple[int, StepUpdate]]:
        """beam_search's stream: the checked search run, and its sequences."""
        if self.http.log_requests:
            rid = f"beam-{uuid.uuid4().hex}"
            for i, prompt in enumerate(prompts):
                self.log_request(f"{rid}-{i}" if names is None else names[i], None if texts is None else texts[i],
                                 prompt, beam)

        async def step(batch: list[list[int]], sampling: SamplingParams) -> list[Candidates]:
            sampling = dataclasses.replace(sampling, seed=params.seed, priority=params.priority,
                                           cache_salt=params.cache_salt)
            got: dict[int, StepUpdate] = {}
            async for i, u in self.run(request, batch, sampling, log=False):
                if u.token_id is not None:
                    got[i] = u
            if len(got) < len(batch):  # (run stopped early: the client went away, and its requests were aborted)
                raise _ClientGone
            return [logprob_entry(u.token_id, u.logprob, u.rank, u.top_logprobs or [], None)
                    for u in (got[i] for i in range(len(batch)))]

        try:
            outputs = await run_beam_search_async(step, prompts, beam, eos_token_id=eos_token_id,
                                                  max_model_len=self.client.limits.max_model_len, decode=None)
        except _ClientGone:
            return

        def replies() -> list[tuple[int, StepUpdate]]:
            return [(i, u) for i, (prompt, out) in enumerate(zip(prompts, outputs, strict=True))
                    for j, seq in enumerate(out.sequences)
                    for u in _beam_updates(j, seq, len(prompt), beam, params, decode)]

        for i, u in await asyncio.to_thread(replies):  # (each text decoded on a thread: a long one stalled the loop)
            yield i, u

    def streams_usage(self, body: CompletionRequest | ChatRequest) -> bool:
        """Whether a stream ends with a usage chunk: the client asked (stream_options.include_usage), or the server's
        --enable-force-include-usage asks it for every stream."""
        options = body.stream_options
        return self.http.force_include_usage or (options is not None and options.include_usage)

    def chunk_usage(self, body: CompletionRequest | ChatRequest, prompt: list[int], choice: Choice) -> dict:
        """What a streamed chunk of `choice` (of `prompt`) carries before the last one: OpenAI's "usage": null where
        the stream reports usage; with vLLM's continuous_usage_stats as well, that choice's so far (alone, it asks for
        nothing, as vLLM's: a client that never asked for usage reads no last chunk without choices). The server's
        --enable-force-include-usage asks for both."""
        if not self.streams_usage(body):
            return {}
        continuous = self.http.force_include_usage or body.stream_options.continuous_usage_stats
        return {"usage": _usage([prompt], [choice]) if continuous else None}

    def log_request(self, rid: str, text: str | list[int] | None, prompt: list[int], params: SamplingParams) -> None:
        """vLLM's --enable-log-requests line: the request's prompt (its first --max-log-len characters or ids) and
        parameters, as the engine gets it."""
        cut = self.http.max_log_len
        if cut is not None:
            text, prompt = text if text is None else text[:cut], prompt[:cut]
        logger.info("Received request %s: prompt: %r, params: %s, prompt_token_ids: %s", rid, text, params, prompt)


def _beam_reply_params(beam: BeamSearchParams, body: CompletionRequest | ChatRequest, logprobs: int | None,
                       skip_special_tokens: bool) -> SamplingParams:
    """What a beam search's reply is read with, as a sampled reply's params: n (the beam width) samples, with logprobs
    alternatives a token, text read with skip_special_tokens; its seed, priority and cache_salt reach each step's
    requests. No
    temperature: they sample nothing (each step's is the search's), and a search at 0 returns n beams, not n greedy
    samples, which SamplingParams refuses."""
    return SamplingParams(n=beam.beam_width, max_tokens=beam.max_tokens,
                          logprobs=logprobs, ignore_eos=beam.ignore_eos, seed=body.seed, priority=body.priority,
                          cache_salt=body.cache_salt,
                          include_stop_str_in_output=beam.include_stop_str_in_output,
                          skip_special_tokens=skip_special_tokens)


def _returned(choices: list[Choice], beam: BeamSearchParams | None) -> list[Choice]:
    """The choices a whole reply returns: every one; a beam search's, those of the sequences it found (fewer than n
    where fewer than n candidates were left)."""
    return choices if beam is None else [c for c in choices if c.finish_reason is not None]


class _Ticker:
    """Wakes a request's wait for its next update every DISCONNECT_CHECK_S (a None in its queue, where the queue is
    empty: a backlog wakes it anyway), so that it checks for a gone client: one timer a request, where a timeout
    around each wait armed and cancelled one for every token."""

    def __init__(self, loop: asyncio.AbstractEventLoop, queue: asyncio.Queue) -> None:
        self.loop, self.queue = loop, queue
        self.handle = loop.call_later(DISCONNECT_CHECK_S, self._tick)

    def _tick(self) -> None:
        if self.queue.empty():
            self.queue.put_nowait(None)
        self.handle = self.loop.call_later(DISCONNECT_CHECK_S, self._tick)

    def stop(self) -> None:
        self.handle.cancel()


class _ClientGone(Exception):
    """A beam search's step ended early: its client went away."""


def _beam_updates(index: int, seq: BeamSearchSequence, prompt_len: int, beam: BeamSearchParams,
                  params: SamplingParams, decode: Callable[[list[int]], str]) -> list[StepUpdate]:
    """A searched sequence as sample `index`'s updates, as vLLM's server returns it: its tokens one update each (the
    EOS that ended it only with include_stop_str_in_output), with their log-probabilities where params asks (each
    token's alternatives are its step's candidates, the params.logprobs most likely); its text (the EOS's never) and
    finish reason (stop_reason the EOS id, where it ended it) with the last."""
    generated = seq.tokens[prompt_len:]
    shown = generated[:-1] if seq.finish_reason == "stop" else generated
    tokens = generated if seq.finish_reason == "stop" and beam.include_stop_str_in_output else shown
    updates = []
    for token, entry in zip(tokens, seq.logprobs, strict=False):  # (the EOS's entry is left where its token is)
        update = StepUpdate("beam-search", index, token, "")
        if params.logprobs is not None:
            chosen = entry[token]
            ranked = sorted((lp.rank, t, lp.logprob) for t, lp in entry.items()
                            if lp.rank is not None and lp.rank <= params.logprobs)
            update.logprob, update.rank = chosen.logprob, chosen.rank
            update.top_logprobs = [(t, v) for _, t, v in ranked]
        updates.append(update)
    if not updates:  # (an EOS at the first step, left out: a sample of no tokens)
        updates.append(StepUpdate("beam-search", index, None, ""))
    updates[-1].text, updates[-1].finish_reason, updates[-1].stop_reason = (decode(shown), seq.finish_reason,
                                                                            seq.stop_reason)
    return updates


def _usage(prompts: list[list[int]], choices: list[Choice], details: bool = False) -> dict:
    """OpenAI's usage; details: with prompt_tokens_details.cached_tokens, each prompt's first choice's (the choices
    are each prompt's n in turn)."""
    prompt_tokens = sum(len(p) for p in prompts)
    completion_tokens = sum(len(c.token_ids) for c in choices)
    usage: dict = {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
                   "total_tokens": prompt_tokens + completion_tokens}
    if details:
        n = len(choices) // len(prompts)
        usage["prompt_tokens_details"] = {"cached_tokens": sum(c.cached_tokens or 0 for c in choices[::n])}
    return usage


def _prompt_logprobs_field(prompts: PromptCodec, update: StepUpdate | None, k: int) -> list[dict | None] | None:
    """vLLM's prompt_logprobs response field: per prompt token (None for the first), {token id: {"logprob", "rank",
    "decoded_token"}} for the token itself and the k most likely (ranked 1 to k)."""
    if update is None or update.prompt_logprobs is None:
        return None
    out: list[dict | None] = [None]
    for (token, lp, top), rank in zip(update.prompt_logprobs, update.prompt_ranks, strict=True):
        entry = logprob_entry(token, lp, rank, top[:k], prompts.token_text)
        out.append({str(t): dataclasses.asdict(v) for t, v in entry.items()})
    return out


def _max_tokens(asked: int | None, default: int | None, prompts: list[list[int]], max_model_len: int) -> int | None:
    """A request's token limit: generation_config's max_new_tokens (where it has one) is a server-wide limit, as
    vLLM's server reads it (get_max_tokens takes the least): the request's own limit, at most that; none asked, that
    limit cut to what the context leaves beside its longest prompt, so that a limit the client never set is not
    refused for its size. (A limit asked past that room is left as asked, for the engine to refuse, as vLLM refuses
    it; None where no default applies, or the prompt leaves no room: the engine then refuses the prompt.)"""
    if default is None:
        return asked
    room = max_model_len - max((len(p) for p in prompts), default=0)
    if asked is not None:
        return asked if asked > room else min(asked, default)
    return min(default, room) if room > 0 else None


def _token_ids(asked: bool, **fields: list[int] | None) -> dict:
    """vLLM's return_token_ids fields of a reply, a choice or a chunk (prompt_token_ids, token_ids): each field's ids
    where the request asked for them, else null (null too where a field has none: a stream's later chunks carry no
    prompt ids)."""
    return {name: ids if asked else None for name, ids in fields.items()}


# the fields vLLM's whole replies carry null where this server has nothing to say (its response models are dumped with
# every field): a client may read them as keys
REPLY_NULLS = {"system_fingerprint": None, "service_tier": None, "kv_transfer_params": None}
MESSAGE_NULLS = {"refusal": None, "annotations": None, "audio": None, "function_call": None, "reasoning": None}


def _model_permission(created: int) -> dict:
    """vLLM's one model_permission entry of a /v1/models card: what a client may do with the model."""
    return {"id": f"modelperm-{uuid.uuid4().hex}", "object": "model_permission", "created": created,
            "allow_create_engine": False, "allow_sampling": True, "allow_logprobs": True,
            "allow_search_indices": False, "allow_view": True, "allow_fine_tuning": False, "organization": "*",
            "group": None, "is_blocking": False}


def _echoed(echoed: str, message: dict) -> dict:
    """A whole chat reply's message (with vLLM's null fields) with the echoed text before its content (none echoed:
    as it is)."""
    if echoed:
        message["content"] = echoed + (message["content"] or "")
    return {"role": message.pop("role"), "content": message.pop("content"), **MESSAGE_NULLS, **message}


# a log-probability of -inf (a token a structured output's grammar rules out: the sampler masks the logits first) as
# vLLM's servers write it, which JSON cannot: max(logprob, -9999.0)
LOGPROB_FLOOR = -9999.0


def _json_logprob(logprob: float | None) -> float | None:
    return None if logprob is None else max(logprob, LOGPROB_FLOOR)


def create_app(client: EngineClient, prompts: PromptCodec, metrics: ServerMetrics, model_name: str,
               max_model_len: int, api_key: str | tuple[str, ...] | None = None,
               tool_options: ToolOptions | None = None, reasoning: ReasoningParser | None = None,
               prompt_tokens_details: bool = False, request_id_headers: bool = False, http: HttpOptions | None = None,
               served_names: tuple[str, ...] = (), model_root: str | None = None,
               responses_store: ResponseStore | None = None, relay_uds: str | None = None) -> FastAPI:
    """api_key: where given (a key, or several that are each taken), every route but /health, /ping, /metrics and
    /version asks for it (auth.py). tool_options: function calling's settings (tools.py). reasoning: splits a chat
    reply's thoughts out (reasoning.py). prompt_tokens_details: usage says how many prompt tokens came from the
    prefix cache (vLLM's --enable-prompt-tokens-details). request_id_headers: every response carries X-Request-Id
    (request_ids.py). http: how the server answers beside that (CORS, ...; options.py). served_names: every name a
    request may give, model_name (the one replies give) first, as vLLM's several --served-model-name; () for
    model_name alone. model_root: the checkpoint (--model) they stand for, each /v1/models card's root (None:
    model_name). responses_store: where the Responses API keeps responses (None: a store of --responses-store-size).
    relay_uds: where another front end serves the Responses API (several front ends: front end 0, which alone keeps
    the store): every request under /v1/responses is relayed there (relay.py), before any of this app's checks."""
    tool_options = tool_options or ToolOptions()
    http = http or HttpOptions()
    eos_token_id = EngineTokenizer(prompts).eos_token_id  # (a beam search's EOS, as TPEngine.beam_search's)

    def beam_text(params: SamplingParams) -> Callable[[list[int]], str]:
        """A searched sequence's text, read with the reply's skip_special_tokens."""
        return lambda ids: prompts.tokenizer.decode(ids, skip_special_tokens=params.skip_special_tokens)

    relay = None if relay_uds is None else Relay(relay_uds, keepalive_s=http.keep_alive_s / 2)

    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        client.attach(asyncio.get_running_loop())
        try:
            yield
        finally:
            if relay is not None:
                await relay.aclose()

    docs = http.docs
    app = FastAPI(title="tpgraph", version=__version__, lifespan=lifespan,
                  openapi_url="/openapi.json" if docs else None, docs_url="/docs" if docs else None,
                  redoc_url="/redoc" if docs else None, dependencies=[Depends(refuse_lone_surrogates)])
    # (set as vLLM sets it: FastAPI then names the prefix in each request's scope, and the routes match a path with
    # or without it; uvicorn's root_path, which FastAPI's deprecation points to, takes only a stripped one)
    app.root_path = http.root_path
    api = Api(client, metrics, model_name, http, served_names)
    app.add_middleware(ServerErrorReplies)  # (innermost: its 500 passes through the others)
    if api_key is not None:
        app.add_middleware(ApiKeyMiddleware, key=api_key)
    # (outside the key's check, so a refused request's 401 carries it too; the Messages API's replies carry their
    # request-id without the flag, as Anthropic's do)
    app.add_middleware(RequestIdMiddleware, every_response=request_id_headers)
    # added last: outermost, so a browser's preflight (OPTIONS, without the key) is answered before the key is asked
    # for, and a 401 carries the CORS headers that let the page read it
    app.add_middleware(CORSMiddleware, allow_origins=list(http.allowed_origins),
                       allow_methods=list(http.allowed_methods), allow_headers=list(http.allowed_headers),
                       allow_credentials=http.allow_credentials)
    if relay is not None:  # (outermost: front end 0 checks the key, answers CORS, names, counts and logs the request)
        app.add_middleware(RelayMiddleware, relay=relay)
    app.include_router(token_routes(prompts, api.check_model, max_model_len, http.template_variables,
                                    http.chat_template_content_format, http.trust_request_chat_template))

    @app.exception_handler(RequestValidationError)
    async def bad_body(_: Request, exc: RequestValidationError) -> JSONResponse:
        problems = []
        for err in exc.errors():
            if err.get("type") == "json_invalid":
                problems.append(f"the body is not valid JSON ({err.get('ctx', {}).get('error', 'unparsable')})")
                continue
            if tuple(err.get("loc", ())) == ("body",) and err.get("type") in ("model_attributes_type", "dict_type"):
                problems.append("the body must be a JSON object (sent as Content-Type: application/json)")
                continue
            where = ".".join(str(p) for p in err.get("loc", ()) if p != "body")
            problems.append(f"{where or 'body'}: {err.get('msg')}")
        return JSONResponse(error_body(400, "; ".join(problems) or "invalid request", "BadRequestError"), 400)

    @app.exception_handler(RequestError)
    async def bad_request(request: Request, exc: RequestError) -> JSONResponse:
        """A refusal no route answered itself (the app's body check, before any route runs): under the Messages API's
        path in Anthropic's shape."""
        return JSONResponse(refusal_body(route_path(request.scope), 400, str(exc), "BadRequestError"), 400)

    @app.exception_handler(EngineUnavailable)
    async def unavailable(_: Request, exc: EngineUnavailable) -> JSONResponse:
        return JSONResponse(error_body(503, str(exc), "ServiceUnavailableError"), 503)

    @app.exception_handler(HTTPException)
    async def http_error(request: Request, exc: HTTPException) -> JSONResponse:
        """Starlette's own refusals (an unknown path, a wrong method, an unreadable body) in OpenAI's error shape
        (under the Messages API's path, Anthropic's)."""
        kind = {404: "NotFoundError", 405: "MethodNotAllowedError"}.get(exc.status_code, "BadRequestError")
        body = refusal_body(route_path(request.scope), exc.status_code, str(exc.detail), kind)
        return JSONResponse(body, exc.status_code, headers=exc.headers)

    @app.exception_handler(ApiError)
    async def api_error(_: Request, exc: ApiError) -> JSONResponse:
        return JSONResponse(error_body(exc.status, exc.message, exc.kind, exc.param), exc.status)

    @app.exception_handler(Exception)
    async def server_error(request: Request, exc: Exception) -> JSONResponse:
        """A failure outside ServerErrorReplies (a middleware's), answered alike. (Starlette raises it on after this
        answer: uvicorn logs its traceback.)"""
        return server_error_reply(request.scope, exc)

    @app.get("/health")
    async def health() -> Response:
        return Response(status_code=200 if client.alive else 503)

    # (vLLM's, for SageMaker's health checks: /health's answer; a route a method, each its own OpenAPI operationId)
    @app.get("/ping")
    @app.post("/ping")
    async def ping() -> Response:
        return await health()

    started = int(time.time())

    @app.get("/v1/models")
    async def models() -> dict:
        # (vLLM's card: root names the checkpoint, which clients load a tokenizer from; parent is an adapter's base)
        return {"object": "list", "data": [{"id": name, "object": "model", "created": started, "owned_by": "tpgraph",
                                            "root": model_root or model_name, "parent": None,
                                            "max_model_len": max_model_len, "permission": [_model_permission(started)]}
                                           for name in api.served_names]}

    @app.get("/version")
    async def version() -> dict:
        return {"version": __version__}

    @app.get("/metrics")
    async def prometheus() -> Response:
        return Response(metrics.exposition() + await client.engine_metrics(), media_type=CONTENT_TYPE_LATEST)

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request) -> Response:
        # (named first, as the chat route names it, so a refusal's 400 carries the body's request_id in X-Request-Id)
        rid, created = f"cmpl-{request_id(request, body.request_id)}", int(time.time())
        api.check_model(body.model)
        texts = body.prompts()
        keep = body.truncation(max_model_len, body.max_tokens)
        # off the event loop (the tokenizer lets go of the GIL): a long prompt must not hold up every other request;
        # one too long for the context is refused before it is tokenized, unless it is to be truncated
        limit = max_model_len if keep is None else None
        # (text gets the special tokens, BOS, unless add_special_tokens is false, as vLLM's; ids are as given)
        token_ids = await asyncio.to_thread(lambda: [
            prompts.encode_text(p, body.add_special_tokens, limit) if isinstance(p, str) else prompts.encode(p, limit)
            for p in texts])
        if not all(token_ids):  # (an empty text without the tokenizer's BOS: nothing to run, as vLLM refuses it)
            raise RequestError("the prompt is empty: it comes to no tokens (add_special_tokens false, or a tokenizer "
                               "that adds no BOS)")
        if keep is not None:  # (echo returns a prompt that was cut as it ran)
            texts = [p if len(ids) <= keep else body.truncated(ids, keep) for p, ids in zip(texts, token_ids,
                                                                                          strict=True)]
            token_ids = [body.truncated(ids, keep) for ids in token_ids]
        # echo with max_tokens 0 scores a prompt (lm-eval's loglikelihood): one token runs, and none is returned
        echo_only = body.echo and body.max_tokens == 0
        max_tokens = _max_tokens(body.max_tokens, prompts.generation_defaults.max_tokens, token_ids, max_model_len)
        beam = None
        echo_count = body.logprobs if body.echo else None  # (vLLM's: an echo with logprobs scores the prompt too)
        if body.use_beam_search:
            beam = body.beam_search_params(max_tokens, body.logprobs, prompts.generation_defaults.sampling)
            params = _beam_reply_params(beam, body, body.logprobs, body.skip_special_tokens)
        else:
            params = body.sampling_params(1 if echo_only else max_tokens, body.logprobs,
                                          prompts.generation_defaults.sampling, prompt_logprobs=echo_count)
        # (a search streams nothing as it goes, as vLLM's: its beams are ranked only once it ends; a stream of it is
        # the whole reply, one event)
        streamed = body.stream and beam is None
        choices = [Choice(i, keeps_text=not streamed) for i in range(len(token_ids) * params.n)]
        names = [f"{rid}-{i}" for i in range(len(token_ids))]  # (the request log's, as vLLM's: cmpl-<id>-<i>)
        stream = api.run(request, token_ids, await held_after_thoughts(params, texts), texts, names=names) \
            if beam is None else \
            api.beam_search(request, token_ids, beam, params, eos_token_id, beam_text(params), texts, names)
        first = await submitted(stream)  # submit now, so a refused request is a 400, not a broken stream
        echoed: list[str] = []
        if body.echo:  # (ids decoded once checked: the tokenizer overflows on a negative one), off the event loop
            echoed = await asyncio.to_thread(lambda: [p if isinstance(p, str) else prompts.decode(ids)
                                                      for p, ids in zip(texts, token_ids, strict=True)])

        def choice_logprobs(entries: list, at: int = 0) -> dict | None:
            """Log-probability entries (a choice's, or a streamed delta's); `at`: the text offset of the first (a
            delta's: the length of the tokens before it). An echoed prompt's first token has none (null)."""
            if params.logprobs is None:
                return None
            as_id = body.tokens_as_ids(http.return_tokens_as_token_ids)
            tokens = [prompts.token_text(t, as_id) for t, _, _ in entries]
            offsets = []
            for t in tokens:
                offsets.append(at)
                at += len(t)
            # the OpenAI completions API: the top `logprobs` tokens and always the sampled one (logprobs + 1 at most)
            tops = [None if lp is None else {prompts.token_text(t, as_id): _json_logprob(v) for t, v in top}
                    for _, lp, top in entries]
            for top, token, (_, lp, _) in zip(tops, tokens, entries, strict=True):
                if top is not None:
                    top.setdefault(token, _json_logprob(lp))
            return {"tokens": tokens, "token_logprobs": [_json_logprob(lp) for _, lp, _ in entries],
                    "top_logprobs": tops, "text_offset": offsets}

        started: set[int] = set()  # the choices that have had an update (with echo, the prompt)
        firsts: dict[int, StepUpdate] = {}  # each prompt's first update, which carries its prompt log-probabilities

        def apply(i: int, u: StepUpdate) -> tuple[Choice, str, list, str | None, bool]:
            """Fold an update into its choice; returns the choice and what the update added to it: text, log-probability
            entries and the finish reason, and whether it was the choice's first. With echo, a choice's first update
            brings the prompt first: its text, and with logprobs its entries (the first token's empty), which come with
            the first token."""
            c = choices[i * params.n + u.sample_index]
            head, entries_at, first_update = "", len(c.logprobs), c.index not in started
            if body.echo and first_update:
                head = echoed[i]
                if c.keeps_text:
                    c.parts.append(head)
            started.add(c.index)
            if u.prompt_logprobs is not None:
                firsts.setdefault(i, u)
                if body.echo:  # (each with the echo's own top count)
                    c.logprobs += [(token_ids[i][0], None, []),
                                   *((t, lp, top[:body.logprobs]) for t, lp, top in u.prompt_logprobs)]
            if echo_only:  # (the one token run is not the reply's)
                u = StepUpdate(u.request_id, u.sample_index, None, "", u.finish_reason and "length",
                               cached_tokens=u.cached_tokens)
            c.add(u)
            return c, head + u.text, c.logprobs[entries_at:], u.finish_reason, first_update

        prompt_top = body.shown_prompt_logprobs(echo_count)  # (each choice's prompt_logprobs field)
        if not streamed:
            try:
                async for i, u in chained(first, stream):
                    apply(i, u)
            finally:  # (its requests end with the reply, also where folding an update raised)
                await stream.aclose()
            reply = {
                "id": rid, "object": "text_completion", "created": created, "model": model_name,
                # (numbered as returned: a search may find fewer than n sequences, as vLLM's)
                "choices": [{"index": k, "text": c.text, "logprobs": choice_logprobs(c.logprobs),
                             "finish_reason": c.finish_reason, "stop_reason": c.stop_reason,
                             **_token_ids(body.return_token_ids, prompt_token_ids=token_ids[c.index // params.n],
                                          token_ids=c.token_ids),
                             "prompt_logprobs": None if prompt_top is None else _prompt_logprobs_field(
                                 prompts, firsts.get(c.index // params.n), prompt_top)}
                            for k, c in enumerate(_returned(choices, beam))],
                "usage": _usage(token_ids, choices, prompt_tokens_details), **REPLY_NULLS}
            if body.stream:  # (a search's: vLLM's one event of the whole reply, then [DONE])
                return StreamingResponse(iter([sse(reply), sse("[DONE]")]), media_type="text/event-stream")
            return JSONResponse(reply)

        async def events() -> AsyncIterator[str]:
            text_at = [0] * len(choices)  # each choice's log-probability tokens' text so far
            async for i, u in chained(first, stream):
                ids_at = len(choices[i * params.n + u.sample_index].token_ids)
                c, text, entries, finish_reason, first_update = apply(i, u)
                logprobs = choice_logprobs(entries, text_at[c.index])
                if logprobs is not None:
                    text_at[c.index] += sum(len(t) for t in logprobs["tokens"])
                yield sse({"id": rid, "object": "text_completion", "created": created, "model": model_name,
                            "choices": [{"index": c.index, "text": text, "logprobs": logprobs,
                                         "finish_reason": finish_reason, "stop_reason": c.stop_reason,
                                         **_token_ids(body.return_token_ids,
                                                      prompt_token_ids=token_ids[i] if first_update else None,
                                                      token_ids=c.token_ids[ids_at:])}],
                            **api.chunk_usage(body, token_ids[i], c)})
            if api.streams_usage(body):
                yield sse({"id": rid, "object": "text_completion", "created": created, "model": model_name,
                            "choices": [], "usage": _usage(token_ids, choices, prompt_tokens_details)})
            yield sse("[DONE]")

        return EventStream(events(), stream)

    async def held_after_thoughts(params: SamplingParams, texts: list[str | list[int]]) -> list[SamplingParams]:
        """Each completion prompt's params: under a reasoning parser a grammar holds only the answer after the
        thoughts (vLLM's engine holds every structured request so, completions too, whose text it leaves whole), from
        the start where the prompt closed them itself (its last tag the end tag)."""
        if reasoning is None or params.structured is None:
            return [params] * len(texts)
        held = dataclasses.replace(params, structured_after=reasoning.end)
        for ids in (t for t in texts if not isinstance(t, str)):  # (checked first: a negative id overflows the decode)
            api.client.check(ids, held)
        # (prompts given as ids decoded off the event loop, as the echo's are)
        closed = await asyncio.to_thread(lambda: [reasoning.closed_in(t if isinstance(t, str) else prompts.decode(t))
                                                  for t in texts])
        return [params if c else held for c in closed]

    async def render_chat(body: ChatRequest) -> RenderedChat:
        """A chat request checked, rendered by the template and tokenized (cut where it asks to be)."""
        api.check_model(body.model)
        tools = body.tool_plan(tool_options)
        trusted = http.trust_request_chat_template
        # (the request's own template, where the server trusts them, in place of the server's)
        template = request_template(body.chat_template, body.chat_template_kwargs, trusted, prompts.special_tokens)
        # (content as vLLM gives this template: a string, or a list of text parts where it loops over them)
        messages = body.checked_messages(prompts.content_format(tools.template_tools,
                                                                http.chat_template_content_format, template), trusted)
        # (as vLLM's: the reply's role where the generation prompt opens a new turn, else the turn it continues)
        role = http.response_role if body.add_generation_prompt else messages[-1]["role"]
        # (vLLM's echo: the last message's text before the reply, where the reply is in its role; its parts joined
        # as they reach the template, the "openai" format's empty ones too, as vLLM joins them)
        echoed = content_text(messages[-1]["content"], "messages[-1]", keep_empty=True) \
            if body.echo and messages[-1]["role"] == role else ""
        # (off the event loop, as the tokenizer is: a template over a long conversation held up every other stream)
        text = await asyncio.to_thread(prompts.render_chat, messages, body.add_generation_prompt, tools.template_tools,
                                       http.template_variables(body.template_kwargs()), body.continue_final_message,
                                       template, documents=body.documents)
        if body.max_completion_tokens is not None and body.max_completion_tokens < 1:
            raise RequestError(f"max_completion_tokens must be >= 1, got {body.max_completion_tokens}")
        max_tokens = body.max_tokens if body.max_completion_tokens is None else body.max_completion_tokens
        keep = body.truncation(max_model_len, max_tokens)
        # (the template writes the special tokens: more only where add_special_tokens asks, as vLLM's)
        token_ids = [await asyncio.to_thread(prompts.encode_text, text, body.add_special_tokens,
                                             max_model_len if keep is None else None)]
        if keep is not None:
            token_ids = [body.truncated(token_ids[0], keep)]
        max_tokens = _max_tokens(max_tokens, prompts.generation_defaults.max_tokens, token_ids, max_model_len)
        return RenderedChat(tools, role, echoed, text, token_ids, max_tokens)

    async def start_chat(body: ChatRequest, request: Request, name: str | None = None,
                         begun: bool = True) -> ChatTurn:
        """A chat request checked, rendered, tokenized and submitted (the chat route's, and the Responses and Messages
        APIs' once they have read their input as chat messages). name: the reply's id, which the request log names it
        by. begun: the engine's first update awaited, so that its refusal raises here too; False leaves that to the
        turn's begin (a background response, which answers before the engine does, as vLLM's)."""
        rendered = await render_chat(body)
        tools, role, echoed, text, token_ids = (rendered.tools, rendered.role, rendered.echoed, rendered.text,
                                                rendered.token_ids)
        max_tokens = rendered.max_tokens
        beam, echo_top = None, None
        if body.use_beam_search:  # (no limit: what the context leaves beside the prompt, as vLLM's)
            room = max(max_model_len - len(token_ids[0]), 1)  # (a prompt that leaves none is refused for it)
            beam = body.beam_search_params(room if max_tokens is None else max_tokens, body.logprobs_count(),
                                           prompts.generation_defaults.sampling, tools, "top_logprobs")
            keep_special = tools.parser is not None and tools.parser.keeps_special_tokens  # (as sampling_params)
            params = _beam_reply_params(beam, body, body.logprobs_count(),
                                        body.skip_special_tokens and not keep_special)
        else:
            # (vLLM's: an unstreamed echo asks the prompt's log-probabilities, top_logprobs of them, for the reply's
            # prompt_logprobs field; a stream has no such field)
            echo_top = (body.top_logprobs or 0) if body.echo and not body.stream else None
            params = body.sampling_params(max_tokens, body.logprobs_count(), prompts.generation_defaults.sampling,
                                          prompt_logprobs=echo_top, tools=tools)
        choices = [Choice(i, keeps_text=False) for i in range(params.n)]  # (each reply reader keeps its text)
        # (does the reply begin in its thoughts? not where it goes on with a Messages prefill's answer text)
        thinking = reasoning is not None and not body._continues_answer and not reasoning.closed_in(text)
        if thinking and params.structured is not None:  # (the grammar holds the answer, not thoughts)
            params = dataclasses.replace(params, structured_after=reasoning.end)
        if reasoning is not None and reasoning.keeps_special_tokens:
            params = dataclasses.replace(params, skip_special_tokens=False)
        # each choice's text read as reasoning (where the server splits it out), content and tool calls
        replies = [ReplyReader(tools, None if reasoning is None else ReasoningReader(reasoning, thinking=thinking),
                               body.stream, body.include_reasoning) for _ in choices]
        names = None if name is None else [name]
        stream = api.run(request, token_ids, params, [text], names=names) if beam is None else \
            api.beam_search(request, token_ids, beam, params, eos_token_id, beam_text(params), [text], names)
        # thoughts left out: so are the choices' log-probabilities and token ids, which would name their tokens (as
        # vLLM's suppress_metadata)
        hidden = reasoning is not None and not body.include_reasoning
        first = await submitted(stream) if begun else NOT_BEGUN
        return ChatTurn(text, token_ids, params, role, echoed, beam, choices, replies, stream, first,
                        hidden, plain=tools.mode == "none" and reasoning is None, echo_top=echo_top)

    def logprob_entries(body: ChatRequest, items: list) -> list[dict]:
        """A chat reply's log-probability entries (the chat API's, the Responses API's too) of (token id,
        log-probability, its alternatives) items."""
        as_ids = body.tokens_as_ids(http.return_tokens_as_token_ids)

        def entry(t: int, lp: float) -> dict:
            return {"token": prompts.token_text(t, as_ids), "logprob": _json_logprob(lp),
                    "bytes": prompts.token_bytes(t)}

        return [{**entry(t, lp), "top_logprobs": [entry(a, b) for a, b in top]} for t, lp, top in items]

    app.include_router(message_routes(start_chat, render_chat, model_name))
    app.include_router(response_routes(start_chat, logprob_entries, model_name,
                                       ResponseStore(http.responses_store_size, http.responses_store_mib << 20)
                                       if responses_store is None
                                       else responses_store))

    @app.post("/v1/chat/completions")
    async def chat(body: ChatRequest, request: Request) -> Response:
        # (named before it is submitted, so a refused request's 400 carries the body's request_id in X-Request-Id)
        rid, created = f"chatcmpl-{request_id(request, body.request_id)}", int(time.time())
        turn = await start_chat(body, request, rid)
        params, choices, replies, stream, hidden = turn.params, turn.choices, turn.replies, turn.stream, turn.hidden
        token_ids, role, echoed, beam = turn.token_ids, turn.role, turn.echoed, turn.beam

        def content_logprobs(items: list) -> dict | None:
            if params.logprobs is None or hidden:
                return None
            return {"content": logprob_entries(body, items)}

        firsts: list[StepUpdate] = []  # the first update with the prompt's log-probabilities (prompt_logprobs)

        give_ids = body.return_token_ids and not hidden

        def apply(u: StepUpdate) -> tuple[Choice, dict, str | None]:
            """Fold an update into its choice; returns the choice, the delta it adds (content, tool calls) and the
            finish reason the reply reports."""
            if u.prompt_logprobs is not None and not firsts:
                firsts.append(u)
            c, added, finish_reason = turn.apply(u)
            # (no parser reads it: as vLLM's DeltaMessage(content=text), every chunk sends content, "" too, its
            # finish chunk's as well)
            return c, added.fields(turn.plain), finish_reason

        if not body.stream:
            shown_top = body.shown_prompt_logprobs(turn.echo_top)  # (the reply's prompt_logprobs field)
            try:
                async for _, u in turn.updates():
                    apply(u)
            finally:  # (its requests end with the reply, also where folding an update raised)
                await stream.aclose()
            return JSONResponse({
                "id": rid, "object": "chat.completion", "created": created, "model": model_name,
                # (numbered as returned: a search may find fewer than n sequences, as vLLM's)
                "choices": [{"index": k, "message": _echoed(echoed, reply.message(role)),
                             "logprobs": content_logprobs(c.logprobs), "finish_reason": reply.finish_reason,
                             "stop_reason": c.stop_reason, **_token_ids(give_ids, token_ids=c.token_ids)}
                            for k, (c, reply) in enumerate((c, replies[c.index]) for c in _returned(choices, beam))],
                "prompt_logprobs": None if shown_top is None else _prompt_logprobs_field(
                    prompts, firsts[0] if firsts else None, shown_top),
                **_token_ids(body.return_token_ids, prompt_token_ids=token_ids[0]),
                "usage": _usage(token_ids, choices, prompt_tokens_details), **REPLY_NULLS})

        async def events() -> AsyncIterator[str]:
            head = {"id": rid, "object": "chat.completion.chunk", "created": created, "model": model_name}
            for c in choices:  # (each with the prompt's ids where asked, as vLLM's role chunks)
                yield sse({**head, "choices": [{"index": c.index, "delta": {"role": role, "content": ""},
                                                 "logprobs": None, "finish_reason": None, "stop_reason": None}],
                            **_token_ids(body.return_token_ids, prompt_token_ids=token_ids[0]),
                            **api.chunk_usage(body, token_ids[0], c)})
            for c in choices if echoed else ():  # (vLLM's echo: its own chunk, after the role's)
                yield sse({**head, "choices": [{"index": c.index, "delta": {"content": echoed}, "logprobs": None,
                                                 "finish_reason": None, "stop_reason": None}],
                            **api.chunk_usage(body, token_ids[0], c)})
            async for _, u in turn.updates():
                c, delta, finish_reason = apply(u)
                items = [(u.token_id, u.logprob, u.top_logprobs or [])] if u.logprob is not None and not hidden else []
                new_ids = [u.token_id] if give_ids and u.token_id is not None else []
                if not delta and not items and not new_ids and finish_reason is None:
                    continue  # (held back by the tool-call reader, with no log-probabilities or ids to carry)
                yield sse({**head, "choices": [{"index": c.index, "delta": delta,
                                                 "logprobs": content_logprobs(items),
                                                 "finish_reason": finish_reason, "stop_reason": c.stop_reason,
                                                 **_token_ids(give_ids, token_ids=new_ids)}],
                            **api.chunk_usage(body, token_ids[0], c)})
            if api.streams_usage(body):
                yield sse({**head, "choices": [], "usage": _usage(token_ids, choices, prompt_tokens_details)})
            yield sse("[DONE]")

        return EventStream(events(), stream)

    return app
