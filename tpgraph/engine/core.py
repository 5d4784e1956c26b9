"""The engine's step loop: schedule, run (chunked prefill and graph decode), sample, stop, report.

One EngineCore per rank. Given the same requests in the same order, every rank's core takes the same decisions and
samples the same tokens (the logits are gathered on every rank, and the samplers share a seed), so the ranks stay in
lockstep without exchanging anything inside a step. Front ends (TPEngine.generate, the server) feed requests in and
read `StepUpdate`s out. By default steps overlap: each is launched before the last one's tokens are read (`step`).
"""

from __future__ import annotations

import bisect
import dataclasses
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from tokenizers import Tokenizer

from tpgraph.engine.bad_words import bad_word_bans, encode_bad_words
from tpgraph.engine.detokenizer import Detokenizer, is_byte_fallback
from tpgraph.engine.limits import RequestLimits
from tpgraph.engine.runner import ModelRunner
from tpgraph.engine.sampler import PendingSample, SampleOutput, Sampler, SampleRow, plain_greedy
from tpgraph.engine.sampling_params import MAX_LOGPROBS, SamplingParams, held_before_min_tokens
from tpgraph.engine.scheduler import ScheduledStep, Scheduler
from tpgraph.engine.scheduler_config import SchedulerConfig
from tpgraph.engine.sequence import Sequence, Status
from tpgraph.engine.structured import GrammarCompiler, GrammarState
from tpgraph.engine.updates import StepUpdate
from tpgraph.errors import ConfigError, RequestError
from tpgraph.kernels.tokens import NO_SOURCE
from tpgraph.uploads import to_device

logger = logging.getLogger(__name__)


class _Once:
    def __init__(self, fn: Callable[[], None] | None) -> None:
        self.fn = fn

    def __call__(self) -> None:
        fn, self.fn = self.fn, None
        if fn is not None:
            fn()


@dataclass
class StepTiming:
    """Where the host time of the last step went (seconds). `sample` is reading sampled tokens back, the wait for
    the GPU included (overlapped: the previous step's tokens, while this step runs); prepare and submit are the
    decode inputs' preparation and the graph launch; gpu is a decode forward's device time (CUDA events, taken
    when they have completed, a step or two late; None on CPU or when none completed since the last step);
    overlapped says whether the step was launched before the previous one was read."""

    schedule: float = 0.0
    prefill: float = 0.0
    prepare: float = 0.0
    submit: float = 0.0
    sample: float = 0.0
    postprocess: float = 0.0
    decode_batch: int = 0
    gpu: float | None = None
    overlapped: bool = False
    # the tokens the step's updates carry, as vLLM counts an iteration's: each one read back, and with a sequence's
    # first its prompt
    tokens: int = 0


@dataclass
class InFlight:
    """A launched step whose sampled tokens (and prompt log-probabilities) are on their way to the host."""

    rows: list[tuple[Sequence, int]]  # per sampled row: its sequence and the index of its placeholder in output_ids
    sample: PendingSample | None  # (None: the step sampled nothing, and ran prefill chunks for prompt_chunks alone)
    prompt_chunks: list[tuple[Sequence, int, PendingSample]] = field(default_factory=list)  # ModelRunner's

    def sources(self, seqs: list[Sequence]) -> list[int] | None:
        """Each sequence's row of this step's sampled ids if its last token is pending there, else NO_SOURCE."""
        row_of = {id(seq): r for r, (seq, _) in enumerate(self.rows)}
        sources = [row_of[id(seq)] if seq.num_pending else NO_SOURCE for seq in seqs]
        return sources if any(s != NO_SOURCE for s in sources) else None


@dataclass
class PreparedRequest:
    """A request with everything built that may fail for reasons of this process alone (its checks, detokenizers):
    adding it can then be refused only for reasons every rank shares (RequestError), so rank 0 prepares a request
    before it tells the other ranks about it (service.py)."""

    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    detokenizers: list[Detokenizer | None]
    grammar_after: tuple[int, ...] = ()  # params.structured_after's token ids
    bad_words: tuple[tuple[int, ...], ...] = ()  # params.bad_words as token sequences (bad_words.py)


@dataclass
class RequestState:
    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    seqs: list[Sequence]
    detokenizers: list[Detokenizer | None]

    @property
    def finished(self) -> bool:
        return all(s.status is Status.FINISHED for s in self.seqs)


def long_word_bans(seq: Sequence, produced: int) -> set[int]:
    """The next tokens of seq's bad words of more than one token, after its first `produced` output tokens (only the
    output's tail can begin a word)."""
    longest = max(map(len, seq.long_bad_words))
    return bad_word_bans(seq.long_bad_words, seq.output_ids[max(0, produced - longest + 1):produced])


class EngineCore:
    def __init__(self, runner: ModelRunner, scheduler_cfg: SchedulerConfig, eos_ids: tuple[int, ...] = (),
                 tokenizer: Tokenizer | None = None, seed: int = 0, overlap: bool = True,
                 max_logprobs: int = MAX_LOGPROBS, main_eos: int | None = None) -> None:
        """`main_eos`: the tokenizer's EOS id (vLLM's model EOS), one of eos_ids: a sample ending on it has no
        stop_reason, and on another EOS id (generation_config's), as on a stop token, that id, as vLLM reads the
        others as stop_token_ids. None: every EOS id is the tokenizer's."""
        if scheduler_cfg.max_num_seqs > runner.cfg.max_batch:
            raise ConfigError(f"max_num_seqs ({scheduler_cfg.max_num_seqs}) exceeds the runner's max_batch "
                              f"({runner.cfg.max_batch}): decode batches must fit the captured graphs")
        if scheduler_cfg.max_num_batched_tokens > runner.max_prefill_tokens:
            raise ConfigError(f"max_num_batched_tokens ({scheduler_cfg.max_num_batched_tokens}) exceeds the "
                              f"runner's prefill buffers ({runner.max_prefill_tokens} tokens)")
        self.runner = runner
        self.scheduler = Scheduler(scheduler_cfg, runner.allocator)
        runner.penalties.clear()  # this engine's sequence ids start from 0: no slot of an earlier one is theirs
        runner.forget_rows()  # (nor a decode row's block table)
        self.sampler = Sampler(runner.device, seed, penalties=runner.penalties)
        self.eos_ids = tuple(eos_ids)
        self.main_eos = main_eos
        self.tokenizer = tokenizer
        self.byte_fallback = tokenizer is not None and is_byte_fallback(tokenizer)  # (each detokenizer's, read once)
        self.grammars = GrammarCompiler(tokenizer, runner.model.cfg.vocab_size, self.eos_ids) if tokenizer else None
        self.requests: dict[str, RequestState] = {}
        self._next_seq_id = 0
        self.timing = StepTiming()
        self.overlap = overlap  # schedule a step before reading the last one's tokens (see step)
        self.max_logprobs = max_logprobs  # the most log-probability alternatives a request may ask (RequestLimits)
        self._in_flight: InFlight | None = None

    # ---- requests ----------------------------------------------------------------------------------------
    @property
    def limits(self) -> RequestLimits:
        cfg = self.scheduler.cfg
        return RequestLimits(self.runner.model.cfg.vocab_size, cfg.max_model_len,
                             self.scheduler.allocator.num_blocks * cfg.block_size, cfg.policy == "priority",
                             self.eos_ids, self.max_logprobs)

    def check_request(self, prompt_ids: list[int], params: SamplingParams) -> None:
        """Raise RequestError if add_request would refuse this prompt (front ends check before accepting it)."""
        self.limits.check(prompt_ids, params)

    def add_request(self, request_id: str, prompt_ids: list[int], params: SamplingParams) -> None:
        self.add_prepared(self.prepare_request(request_id, prompt_ids, params))

    def prepare_request(self, request_id: str, prompt_ids: list[int], params: SamplingParams) -> PreparedRequest:
        """Check a request and build its detokenizers; touches no engine state (safe in the middle of a step)."""
        self.check_request(prompt_ids, params)
        after: tuple[int, ...] = ()
        if params.structured is not None:  # compiled once here, where a bad schema or grammar is refused
            if self.grammars is None:
                raise RequestError("structured outputs need the engine's tokenizer")
            self.grammars.compile(params.structured)
            if params.structured_after is not None:
                after = tuple(self.tokenizer.encode(params.structured_after, add_special_tokens=False).ids)
        bad_words = encode_bad_words(self.tokenizer, params.bad_words, self.runner.model.cfg.vocab_size)
        if params.allowed_token_ids is not None:  # (a row with every logit masked takes id 0, which is not allowed)
            allowed, banned = set(params.allowed_token_ids), {w[0] for w in bad_words if len(w) == 1}
            if allowed <= banned:
                raise RequestError(f"bad_words ban every one of allowed_token_ids {list(params.allowed_token_ids)}: "
                                   f"no token is left to generate")
            # a grammar held from the first token that can begin with none of them (later conflicts end a sample)
            if (params.structured is not None and params.structured_after is None
                    and not self.grammars.can_begin_with(params.structured, allowed - banned)):
                raise RequestError(f"the structured output can begin with none of allowed_token_ids "
                                   f"{list(params.allowed_token_ids)} (bad_words aside): no token is left to generate")
            held = held_before_min_tokens(params, self.eos_ids)
            if params.min_tokens and allowed <= banned | held:  # (the stop ids alone: RequestLimits.check)
                raise RequestError(f"allowed_token_ids {list(params.allowed_token_ids)} are all bad_words or stop "
                                   f"tokens, which min_tokens {params.min_tokens} holds back: no token is left to "
                                   f"generate before it")
        detoks = [Detokenizer(self.tokenizer, prompt_ids, params, self.byte_fallback)
                  if self.tokenizer is not None and params.detokenize else None for _ in range(params.n)]
        return PreparedRequest(request_id, list(prompt_ids), params, detoks, after, bad_words)

    def add_prepared(self, request: PreparedRequest) -> None:
        """Queue a prepared request whole, or refuse it (RequestError) with nothing queued."""
        request_id, prompt_ids, params = request.request_id, request.prompt_ids, request.params
        if request_id in self.requests:
            raise RequestError(f"request id {request_id!r} is already running")
        max_len = self.scheduler.cfg.max_model_len
        # later samples report the first's prompt log-probabilities and then read its prompt from the prefix cache;
        # without one they would wait for nothing to share, so each computes its own
        shared_prompt = params.prompt_logprobs is not None and self.scheduler.allocator.shares_prefixes
        held = tuple(sorted(held_before_min_tokens(params, self.eos_ids))) if params.min_tokens else ()
        seqs = []
        for i in range(params.n):
            seqs.append(Sequence(self._next_seq_id, list(prompt_ids), params.max_tokens or max_len,
                                 request_id=request_id, sample_index=i, params=params, bad_words=request.bad_words,
                                 held_bans=held,
                                 grammar=GrammarState(self.grammars.matcher(params.structured), request.grammar_after)
                                 if params.structured else None,
                                 prompt_logprobs_from=seqs[0] if seqs and shared_prompt else None))
            self._next_seq_id += 1
        # what may raise for one rank alone was built in prepare_request, before the first sequence is queued: a
        # request is taken whole or not at all (one queued without its state broke every later step)
        for seq in seqs:
            self.scheduler.add(seq)  # may refuse: then none of this request's sequences is queued (the same length)
        self.requests[request_id] = RequestState(request_id, list(prompt_ids), params, seqs,
                                                 list(request.detokenizers))

    def abort(self, request_id: str) -> list[StepUpdate]:
        state = self.requests.pop(request_id, None)
        if state is None:
            return []
        updates = []
        for seq in state.seqs:
            if seq.status is not Status.FINISHED:
                seq.drop_pending()  # the row of its step in flight is dropped when read
                self._finish(seq, "abort")
                updates.append(StepUpdate(request_id, seq.sample_index, None, "", "abort"))
        return updates

    @property
    def has_work(self) -> bool:
        return self.scheduler.has_work or self._in_flight is not None

    def reset_prefix_cache(self) -> bool:
        """Forget every cached prefix, while no request runs (else False, nothing changed)."""
        if self.scheduler.has_work:
            return False
        if self._in_flight is not None:  # (an aborted call's last step: its sequences all finished, its rows dropped)
            self._resolve()
        return self.scheduler.allocator.reset_prefix_cache()

    # ---- one step ----------------------------------------------------------------------------------------
    def step(self, while_gpu_runs: Callable[[], None] | None = None) -> list[StepUpdate]:
        """One step. `while_gpu_runs` is called once, after the step's forwards are launched and before the host
        waits for them (the control path uses it to talk to the other ranks while the GPU is busy).

        Overlapped (the default): the step is launched before the previous step's tokens are read, which happens
        while this step runs; its own tokens are read, and their updates returned, by the next call. The host work
        of a step (scheduling, input writes, launches, reading tokens, detokenizing, stop checks) then hides behind
        the GPU's. Nothing in sampling needs the last token on the host (penalties count it on the device) but a
        structured output's grammar, for which the last step is read between this step's forwards and its draw."""
        self.timing = StepTiming()
        hook = _Once(while_gpu_runs)
        updates: list[StepUpdate] = []
        if not self.overlap and self._in_flight is not None:
            updates += self._resolve()
        t0 = time.perf_counter()
        sched = self.scheduler.schedule()
        self.timing.schedule, self.timing.decode_batch = time.perf_counter() - t0, len(sched.decode)
        updates += [self._ended(seq) for seq in sched.out_of_cache]
        launched = self._launch(sched, updates, hook) if not sched.empty else None
        hook()
        if self._in_flight is not None:
            self.timing.overlapped = launched is not None
            updates += self._resolve()
        self._in_flight = launched
        if launched is not None and not self.overlap:
            updates += self._resolve()
        for request_id in {u.request_id for u in updates if u.finish_reason}:
            state = self.requests.get(request_id)
            if state is not None and state.finished:
                del self.requests[request_id]
        return updates

    def _launch(self, sched: ScheduledStep, updates: list[StepUpdate], hook: _Once) -> InFlight | None:
        """Run the step's forwards and sample on the device; the sampled rows' tokens stay pending. A structured
        output's mask needs its sequence's last token: where a row is constrained, the step in flight is read (its
        updates go to `updates`; `hook` runs first) after this step's forwards are launched and before its draw, so
        the grammar's work runs while the forwards do."""
        parts: list[torch.Tensor] = []
        sampled: list[Sequence] = []
        prompt_chunks: list[tuple[Sequence, int, PendingSample]] = []
        timing = self.timing
        if sched.prefill:
            t0 = time.perf_counter()
            seqs = [s for s, _ in sched.prefill]
            logits = self.runner.prefill(seqs, [n for _, n in sched.prefill])
            prompt_chunks = self.runner.last_prompt_logprobs
            timing.prefill = time.perf_counter() - t0
            done = [i for i, s in enumerate(seqs) if s.num_uncached == 0]  # prompt (or recompute) complete
            if done:
                parts.append(logits if len(done) == len(seqs) else logits[to_device(done, torch.int64, logits.device)])
                sampled += [seqs[i] for i in done]
        pending, rows = None, [self._sample_row(s) for s in sampled]
        if sched.decode:
            sources = self._in_flight.sources(sched.decode) if self._in_flight is not None else None
            rows += [self._sample_row(s) for s in sched.decode]
            if not parts and plain_greedy(rows):  # the step itself makes the ids: no logits, nothing to sample
                pending = self.sampler.pending(self.runner.decode_greedy(sched.decode, sources))
            else:
                parts.append(self.runner.decode(sched.decode, sources))
            sampled += sched.decode
            timing.prepare, timing.submit = self.runner.last_decode.prepare_s, self.runner.last_decode.submit_s
            timer = self.runner.gpu_timer
            timing.gpu = timer.take() if timer is not None else None
        if not sampled:
            return InFlight([], None, prompt_chunks) if prompt_chunks else None
        if self._in_flight is not None and any(r.grammar is not None or s.reads_output
                                               for s, r in zip(sampled, rows, strict=True)):
            hook()
            self.timing.overlapped = True
            updates += self._resolve()  # (the rows hold the sequences' grammars and token lists: they see it)
            # a sequence that has just finished keeps its row (the batch is launched), drawn without a penalty slot
            # (its own went back) and dropped when read; one whose bans read its last tokens has them now
            rows = [dataclasses.replace(r, seq_id=None) if seq.finished else self._sample_row(seq)
                    if seq.reads_output else r for seq, r in zip(sampled, rows, strict=True)]
        if pending is None:
            logits = parts[0] if len(parts) == 1 else torch.cat(parts)
            pending = self.sampler.sample_async(logits, rows, ids_out=self.runner.sampled_rows(len(sampled)))
        return InFlight([(seq, -1 if seq.finished else seq.add_pending()) for seq in sampled], pending,
                        prompt_chunks)

    def _resolve(self) -> list[StepUpdate]:
        """Read the step in flight back and hand its tokens out. A row whose sequence finished after the step was
        launched (aborted, or stopped by an earlier token) is dropped."""
        flight, self._in_flight = self._in_flight, None
        t0 = time.perf_counter()
        for seq, first, chunk in flight.prompt_chunks:  # (before the rows: a first token carries them)
            self._read_prompt_logprobs(seq, first, chunk.result())
        if flight.sample is None:
            return []
        out = flight.sample.result()
        now = time.perf_counter()
        self.timing.sample += now - t0
        updates, read = [], 0
        # (per row: names looked up once a step, not once a row)
        finished, requests, accept, token_ids, logprobs = (Status.FINISHED, self.requests, self._accept, out.token_ids,
                                                           out.logprobs)
        for i, (seq, index) in enumerate(flight.rows):
            if seq.status is finished:
                continue
            update = accept(seq, requests[seq.request_id], index, token_ids[i])
            # (a token the grammar refused is dropped, and its log-probabilities with it)
            if logprobs is not None and seq.params.logprobs is not None and update.token_id is not None:
                update.logprob, update.rank = logprobs[i], out.ranks[i]
                k = seq.params.logprobs
                update.top_logprobs = list(zip(out.top_ids[i][:k], out.top_logprobs[i][:k], strict=True))
            updates.append(update)
            read += update.token_id is not None
            if index == 0:
                self.timing.tokens += len(seq.prompt_ids)
                update.cached_tokens, update.queue_s = seq.prompt_cached or 0, seq.queue_s
                if seq.queue_s is not None:  # (admitted at queued_at + queue_s; a preemption since stays inside)
                    update.prefill_s = now - seq.queued_at - seq.queue_s
                if seq.params.prompt_logprobs is not None:  # (every sample's first update brings its request's)
                    src = seq.reported_prompt_logprobs
                    update.prompt_logprobs, update.prompt_ranks = list(src.prompt_logprobs), list(src.prompt_ranks)
        self.timing.tokens += read
        self.timing.postprocess += time.perf_counter() - now
        return updates

    @staticmethod
    def _read_prompt_logprobs(seq: Sequence, first: int, out: SampleOutput) -> None:
        """Keep a chunk's prompt log-probabilities (entries from prompt token `first` on) that seq has not yet: a
        prompt recomputed after a preemption gives them again."""
        k = seq.params.prompt_logprobs
        for i, token in enumerate(out.token_ids):
            if first + i == len(seq.prompt_logprobs) + 1:
                seq.prompt_logprobs.append((token, out.logprobs[i], list(zip(out.top_ids[i][:k],
                                                                             out.top_logprobs[i][:k], strict=True))))
                seq.prompt_ranks.append(out.ranks[i])

    def _finish(self, seq: Sequence, reason: str) -> None:
        self.scheduler.finish(seq, reason)
        self.runner.penalties.release(seq.seq_id)

    def _ended(self, seq: Sequence) -> StepUpdate:
        """A sequence the scheduler finished (it outgrew the KV cache), min_tokens or not: hand out its held-back
        text (its tokens read back so far: the one in flight is dropped)."""
        self.runner.penalties.release(seq.seq_id)
        detok = self.requests[seq.request_id].detokenizers[seq.sample_index]
        text, seq.finish_reason, stop_reason = self._flushed(seq, detok, len(seq.output_ids) - seq.num_pending,
                                                             seq.finish_reason)
        return StepUpdate(seq.request_id, seq.sample_index, None, text, seq.finish_reason, stop_reason)

    @staticmethod
    def _flushed(seq: Sequence, detok: Detokenizer | None, produced: int, reason: str,
                 stop_reason: int | str | None = None) -> tuple[str, str, int | str | None]:
        """The text held back when a sequence of `produced` output tokens ends (by `reason`, `stop_reason`), and how
        it ended: the flush looks for stop strings only past min_tokens, as every stop check does (min_tokens holds
        stop strings back, never a sequence that cannot go on), and one it completes ended the sequence, as vLLM's
        output processor makes any finish "stop" with the string its detokenizer found."""
        if detok is None:
            return "", reason, stop_reason
        text = detok.flush(may_stop=produced > seq.params.min_tokens)
        if detok.stop_string is not None:
            return text, "stop", detok.stop_string
        return text, reason, stop_reason

    def _sample_row(self, seq: Sequence) -> SampleRow:
        """seq's row: its bans as _bans has them, those fixed for the request (its one-token bad words, and below
        min_tokens the ids that would stop it) as the sequence's own tuples, which the sampler uploads once."""
        produced = len(seq.output_ids)
        held = produced < seq.params.min_tokens
        # (a row holds the sequence's own lists and grammar, which change in place: the same row serves every step
        # until min_tokens is passed, unless its bans read the output)
        if seq.sample_row is not None and seq.sample_row_held == held:
            return seq.sample_row
        fixed = tuple(ids for ids in (seq.word_bans, seq.held_bans if held else ()) if ids)
        banned = tuple(sorted(long_word_bans(seq, produced))) if seq.reads_output else ()
        row = SampleRow(seq.params, seq.prompt_ids, seq.output_ids, seq.sample_index, banned, seq_id=seq.seq_id,
                        grammar=seq.grammar, fixed_banned=fixed)
        if not seq.reads_output:
            seq.sample_row, seq.sample_row_held = row, held
        return row

    def _bans(self, seq: Sequence, produced: int) -> set[int]:
        """The ids seq's row bans after its first `produced` output tokens (allowed_token_ids aside): its bad words'
        next tokens, and below min_tokens the ids that would stop it."""
        ids = set(seq.word_bans)  # (the union of what _sample_row's row bans: its kept lists and this step's)
        if seq.reads_output:
            ids |= long_word_bans(seq, produced)
        if produced < seq.params.min_tokens:
            ids.update(seq.held_bans)
        return ids

    def _refuses(self, seq: Sequence, index: int, token: int) -> bool:
        """Is `token`, drawn at output position `index`, one its row bans? Only a row whose every token was masked (or
        NaN logits) draws one: allowed_token_ids that multi-token bad words or min_tokens all ban at that step."""
        allowed = seq.params.allowed_token_ids  # (sorted)
        if allowed is not None:
            at = bisect.bisect_left(allowed, token)
            if at == len(allowed) or allowed[at] != token:
                return True
        return bool(seq.bad_words or index < seq.params.min_tokens) and token in self._bans(seq, index)

    def _accept(self, seq: Sequence, state: RequestState, index: int, token: int) -> StepUpdate:
        """The token read back for output position `index` (its placeholder): text, stop checks, finish."""
        p = seq.params
        seq.resolve_pending(index, token)
        # a token the row's masks banned (or its grammar refuses, where it needed only banned ones) ends the sample
        if self._refuses(seq, index, token) or (seq.grammar is not None and not seq.grammar.accept(token)):
            logger.error("request %s: token %d is one its request bans (every token was banned at this step); the "
                         "sample ends", seq.request_id, token)
            seq.drop_pending(keep=index)
            # the tokens before it stay the sample's: so does their text held back (a stop string's start, UTF-8)
            text, reason, stop_reason = self._flushed(seq, state.detokenizers[seq.sample_index], index, "abort")
            self._finish(seq, reason)
            return StepUpdate(seq.request_id, seq.sample_index, None, text, reason, stop_reason)
        detok = state.detokenizers[seq.sample_index]
        reason, stop_reason = None, None
        eos = token in self.eos_ids and not p.ignore_eos
        stop_token = eos or token in p.stop_token_ids
        text = ""
        produced = index + 1  # output tokens up to this one (later placeholders may follow it)
        if stop_token:  # (before min_tokens these ids were banned from sampling)
            # (the tokenizer's EOS has none, also where listed in stop_token_ids: vLLM's)
            reason, stop_reason = "stop", None if eos and self.main_eos in (None, token) else token
            if detok is not None and p.include_stop_str_in_output:  # the stop token's own text too (as vLLM)
                # (where a stop string ends in it, vLLM cuts there and names the string: it checks that text too)
                text, stopped = detok.add(token, may_stop=produced > p.min_tokens)
                stop_reason = detok.stop_string if stopped else stop_reason
        elif detok is not None:  # stop strings, too, end a sequence only after min_tokens (as vLLM's do)
            text, stopped = detok.add(token, may_stop=produced > p.min_tokens)
            reason, stop_reason = ("stop", detok.stop_string) if stopped else (None, None)
        if reason is None and seq.reached_length(self.scheduler.cfg.max_model_len, produced):
            reason = "length"
        if reason is not None:
            rest, reason, stop_reason = self._flushed(seq, detok, produced, reason, stop_reason)
            text += rest
            seq.drop_pending(keep=produced)  # tokens sampled after its last one are not the sequence's
            self._finish(seq, reason)
        return StepUpdate(seq.request_id, seq.sample_index, token, text, reason, stop_reason)
