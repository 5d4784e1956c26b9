"""TPEngine: the one composition root (distributed setup, communicator, model, runner, scheduler, sampler).

    with TPEngine() as engine:                                  # the built-in model, one process
        out = engine.generate(["Hello"], SamplingParams(max_tokens=16))
        print(out[0].outputs[0].text)

Under torchrun every rank builds a TPEngine and calls generate with the same prompts (SPMD): every rank's core takes
the same decisions, so they stay in lockstep with no control messages. In a plain process, TPEngine(tp_size=N) starts
ranks 1..N-1 itself (followers.py), and rank 0 tells them each step what changed.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import gc
import hashlib
import logging
import os
import signal
import threading
import time
import weakref
from collections import defaultdict
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from tqdm import tqdm

from tpgraph.chat import (
    CONTENT_FORMATS,
    ChatTemplate,
    GenerationDefaults,
    special_tokens,
    text_messages,
    tokenizer_config,
)
from tpgraph.comm import TPCommunicator
from tpgraph.config import BUILTIN_MODEL, ModelConfig
from tpgraph.distributed import (
    ParallelState,
    check_same_on_every_rank,
    destroy_distributed,
    gather_objects,
    init_distributed,
    peer_start_failure,
    post_start_failure,
    report_start_failure,
)
from tpgraph.engine.beam_search import BeamSearchOutput, BeamSearchParams, check_width, run_beam_search
from tpgraph.engine.config import EngineConfig, check_kv_cache_dtype, vllm_keywords
from tpgraph.engine.control import ControlPlane
from tpgraph.engine.core import EngineCore
from tpgraph.engine.limits import check_params_type, kept_prompt_tokens
from tpgraph.engine.liveness import PeerWatch
from tpgraph.engine.logprob import Logprob, logprob_entry
from tpgraph.engine.runner import ModelRunner, RunnerConfig
from tpgraph.engine.sampling_params import SamplingParams
from tpgraph.engine.scheduler_config import SchedulerConfig, default_token_budget
from tpgraph.engine.service import EngineService
from tpgraph.engine.structured import StructuredOutput, structured_outputs_available
from tpgraph.engine.updates import REFUSED, StepUpdate
from tpgraph.errors import CheckpointError, ConfigError, RequestError, TPGraphError
from tpgraph.hub import shown_name
from tpgraph.model.loader import default_dtype, load_model, parse_dtype
from tpgraph.prompts import (
    EngineTokenizer,
    Prompt,
    PromptCodec,
    SaltedPrompt,
    TextedIds,
    is_one_prompt,
    is_vllm_prompt,
    token_ids,
    unsalted,
    vllm_prompt,
)
from tpgraph.tokenizer import BOS, EOS, load_tokenizer

logger = logging.getLogger(__name__)



@dataclass
class CompletionOutput:
    index: int
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    # vLLM's: the stop string or stop_token_ids entry that ended it; None for an EOS, a length or an abort
    stop_reason: int | str | None = None
    # when asked (SamplingParams.logprobs = k), vLLM's: per token {its id: Logprob, then the k most likely's}
    logprobs: list[dict[int, Logprob]] | None = None
    cumulative_logprob: float | None = None  # the sampled tokens' sum (vLLM's: None unless logprobs are asked)
    lora_request: None = None  # (vLLM's; no adapters here)

    def finished(self) -> bool:
        """vLLM's CompletionOutput.finished(): the sample has ended (it has a finish_reason)."""
        return self.finish_reason is not None


@dataclass
class GenerationOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    ttft_s: float = 0.0  # time to the first token
    latency_s: float = 0.0  # time to the last
    # SamplingParams.prompt_logprobs = k, vLLM's: per prompt token {its id: Logprob, then the k most likely's}, None
    # for the first
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None
    num_cached_tokens: int | None = None  # prompt tokens read from the prefix cache (its first sample's, as vLLM's)
    # vLLM's fields with nothing to hold here (no stats object, adapters, encoder, multi-modal inputs or KV transfer):
    # None, as vLLM's offline outputs have them by default, so that a script reading one ports
    metrics: None = None
    lora_request: None = None
    encoder_prompt: None = None
    encoder_prompt_token_ids: None = None
    kv_transfer_params: None = None

    @property
    def finished(self) -> bool:
        """vLLM's RequestOutput.finished: every sample has ended (always so in what generate and chat return)."""
        return all(c.finished() for c in self.outputs)


RequestOutput = GenerationOutput  # (vLLM's name for it)


@contextlib.contextmanager
def deferred_interrupt() -> Iterator[threading.Event]:
    """While inside: Ctrl-C (SIGINT) sets the event instead of raising wherever the main thread happens to be."""
    flag = threading.Event()
    if threading.current_thread() is not threading.main_thread():
        yield flag
        return
    previous = signal.getsignal(signal.SIGINT)
    signal.signal(signal.SIGINT, lambda *_: flag.set())
    try:
        yield flag
    finally:
        signal.signal(signal.SIGINT, previous)


@contextlib.contextmanager
def prompt_named(index: int, count: int, kind: str = "prompt") -> Iterator[None]:
    """A RequestError raised inside names the prompt (or conversation: kind) it is about, where the call had several
    (count): "the prompt is empty" alone left a user of a batch of thousands to search for it. One prompt's reads as
    it is, wherever it is refused."""
    try:
        yield
    except RequestError as exc:
        if count == 1:
            raise
        raise RequestError(f"{kind} {index} was refused: {exc}") from None


def checked_eos_ids(eos_ids: tuple[int, ...], vocab_size: int) -> tuple[int, ...]:
    """The checkpoint's EOS ids that can be sampled. One past the vocabulary (a config's typo) could never end a
    sequence, and with min_tokens it would index the logits and fail the step: dropped, with a warning."""
    outside = [t for t in eos_ids if not 0 <= t < vocab_size]
    if outside:
        logger.warning("EOS ids %s are outside the vocabulary (%d tokens): ignored", outside, vocab_size)
    return tuple(t for t in eos_ids if 0 <= t < vocab_size)


IDLE_TIMEOUT_S = 365 * 24 * 3600.0  # started followers' wait for rank 0's next message (see __init__)

# the kinds of sampled rows the warm-up runs alone (see warm_up)
WARM_UP_KINDS: tuple[dict, ...] = (
    dict(temperature=0.0),
    dict(temperature=1.0, top_p=0.9, seed=0),
    dict(temperature=0.0, repetition_penalty=1.1),
    dict(temperature=1.0, top_k=20, min_p=0.05, seed=0),
    dict(temperature=0.8, top_k=20, top_p=0.9, repetition_penalty=1.1, presence_penalty=0.2, frequency_penalty=0.2,
         logprobs=2, seed=0),
)


def _release_dropped(peer_watch: PeerWatch, state: ParallelState, followers: list,
                     user_threads: int | None = None) -> None:
    """What close() leaves behind it, for an engine collected unclosed: its started ranks (ended, not told: rank 0's
    loop is gone with the engine), the process group, and this process's torch threads as they were."""
    peer_watch.stop()
    for p in followers:
        p.kill()  # (a follower defers SIGTERM: followers.follower_main)
    for p in followers:
        p.join(5.0)
    destroy_distributed(state)
    if user_threads is not None:
        torch.set_num_threads(user_threads)


class TPEngine:
    def __init__(self, model: str | Path | None = None, tp_size: int = 1, *,
                 dist_init: tuple[int, int, str] | None = None, follower: Callable[[], None] | None = None,
                 rank_setup: Callable[[], None] | None = None, **kwargs: Any) -> None:
        """`kwargs` are EngineConfig fields, or vLLM's LLM(...) names for them (tensor_parallel_size, enforce_eager,
        num_gpu_blocks_override, compilation_config's CUDA graph settings; a model given as a hub id, with revision,
        tokenizer_revision and download_dir: vllm_keywords). `dist_init` = (rank, world_size, init_method) for
        launchers other than torchrun (tests, spawned ranks). `follower`: a rank this class started (followers.py),
        told as it joins the process group (it tells rank 0, which waits for that). `rank_setup` (picklable): what
        each rank this engine starts itself (tp_size > 1 without torchrun) runs first: the server's logging set-up,
        so that they log as rank 0 does, as torchrun's ranks each set up their own."""
        try:
            model, tp_size, kwargs, model_cfg, main_eos, eos_ids = self._read_settings(model, tp_size, kwargs)
        except Exception as exc:
            # the other ranks may wait for this one in the rendezvous already: they hear of it (init_distributed's
            # start check) and stop now, naming it. (A rank this class started tells rank 0 through its pipe.)
            if follower is None:
                report_start_failure(exc, *(dist_init or (None, None, None)))
            raise
        cfg = self.config
        self._followers: list = []  # ranks this process started (plain process, tp_size > 1)
        self._user_threads: int | None = None  # (CPU ranks started) this process's torch threads before they were
        if dist_init is None and "WORLD_SIZE" not in os.environ and tp_size > 1:
            from tpgraph.engine.followers import cpu_threads_per_rank, free_tcp_init, start_followers

            if dist.is_initialized():  # (an engine dropped unclosed in a reference cycle: collected now, it goes)
                gc.collect()
            if dist.is_initialized():
                raise ConfigError("this process already holds a process group (an earlier TPEngine not closed?): "
                                  "close() it, or use it as a context manager, before starting another")
            init = free_tcp_init()
            # CPU ranks share this host's cores, this process's too (as torchrun's OMP_NUM_THREADS=1 shares them)
            threads = cpu_threads_per_rank(tp_size) if cfg.device == "cpu" or (
                cfg.device is None and not torch.cuda.is_available()) else None
            if threads is not None:  # (the user's count comes back once the engine has gone: _restore_threads)
                self._user_threads = torch.get_num_threads()
                torch.set_num_threads(threads)
            try:
                self._followers = start_followers(tp_size, init, {"model": model, "tp_size": tp_size, **kwargs},
                                                  threads, rank_setup)
            except BaseException:
                self._restore_threads()
                raise
            dist_init = (0, tp_size, init)
        rank, world, init = dist_init or (None, None, None)
        # started followers wait for rank 0's next message as long as the user leaves it idle between generate calls
        # (a notebook): the process group's timeout would end them, and rank 0's peer watch then the user's process
        idle = IDLE_TIMEOUT_S if self._followers or follower is not None else None
        try:
            self.state: ParallelState = init_distributed(cfg.device, rank, world, init, control_timeout_s=idle,
                                                         before_join=follower)
        except BaseException:  # (a Ctrl-C while the started ranks join, say)
            # the started ranks wait in a rendezvous or a collective this rank never joins: they go now, and so does a
            # process group made before the failure (else the next TPEngine finds it and refuses to start)
            if self._followers and dist.is_initialized():
                dist.destroy_process_group()
            self._stop_followers(timeout_s=0.0)
            self._restore_threads()
            raise
        try:
            if self.state.world_size != tp_size:
                raise ConfigError(f"tp_size={tp_size} but {self.state.world_size} ranks were launched (torchrun's "
                                  f"--nproc-per-node): give the same number, or leave it out", ("tp_size",))
            # (every rank must choose alike: the custom all-reduce's set-up is a collective)
            check_same_on_every_rank(self.state, "disable_custom_all_reduce", cfg.disable_custom_all_reduce)
            self.comm = TPCommunicator(self.state, use_custom_allreduce=not cfg.disable_custom_all_reduce,
                                       disabled_by="--disable-custom-all-reduce")
            dtype = default_dtype(model_cfg, self.state.device) if cfg.dtype in (None, "auto") else \
                parse_dtype(cfg.dtype)
            check_kv_cache_dtype(cfg.kv_cache_dtype, dtype)  # (before the weights load)
            # (rope tables for the positions it reaches, never first the whole context: the runner sizes them too)
            self.model = load_model(self.state, self.comm, cfg.model, cfg.load_format, dtype, seed=cfg.seed,
                                    config=model_cfg, max_positions=cfg.max_model_len)
            budget = cfg.max_num_batched_tokens
            if budget is None and not cfg.enable_chunked_prefill:  # a step takes a whole prompt: the default budget
                # holds one of max_model_len (vLLM's default too), not the chunked one's (at most DEFAULT_CHUNK_TOKENS),
                # which was refused
                budget = default_token_budget(cfg.max_model_len or model_cfg.max_context, cfg.max_num_seqs,
                                              chunked_prefill=False)
            self.runner = ModelRunner(self.model, RunnerConfig(
                block_size=cfg.block_size, max_batch=cfg.max_num_seqs, max_model_len=cfg.max_model_len,
                num_kv_blocks=cfg.num_kv_blocks, kv_cache_memory_bytes=cfg.kv_cache_memory_bytes,
                gpu_memory_utilization=cfg.gpu_memory_utilization,
                max_num_batched_tokens=budget, graphs=cfg.graphs,
                enable_prefix_caching=cfg.enable_prefix_caching))
            self.core = EngineCore(self.runner, SchedulerConfig(
                max_num_seqs=cfg.max_num_seqs, max_num_batched_tokens=self.runner.max_prefill_tokens,
                max_model_len=self.runner.max_model_len, block_size=cfg.block_size,
                enable_chunked_prefill=cfg.enable_chunked_prefill, policy=cfg.scheduling_policy),
                eos_ids=eos_ids, tokenizer=self.tokenizer, seed=cfg.seed, overlap=cfg.overlap_scheduling,
                max_logprobs=cfg.max_logprobs, main_eos=main_eos if main_eos in eos_ids else None)
        except BaseException as exc:
            # a peer's failure met here as the connection it closed (no error of tpgraph's: those are this rank's own,
            # or agreed ones that name the rank) is raised as that failure, with its reason; this rank's own is left
            # for the others to raise alike
            lost = isinstance(exc, Exception) and not isinstance(exc, TPGraphError)
            cause = peer_start_failure(self.state) if lost else None
            if cause is None and isinstance(exc, Exception):
                post_start_failure(self.state, exc)
            destroy_distributed(self.state)
            # a failure every rank meets (a bad checkpoint) ends the started ranks by themselves: they get time to; a
            # Ctrl-C is this rank's alone (they ignore SIGINT), and they would wait in a collective it left for good
            self._stop_followers(timeout_s=30.0 if isinstance(exc, Exception) else 0.0)
            self._restore_threads()
            if cause is not None:
                raise cause from exc
            raise
        self.peer_watch = PeerWatch(self.state)  # a dead or frozen rank ends every rank, named
        self.peer_watch.start()
        # rank 0 of started followers tells them each step what changed; under torchrun (SPMD) nobody needs telling
        self.service = EngineService(self.core, ControlPlane(self.state)) if self._followers else None
        self._closed = False
        self._lock = threading.Lock()  # held by generate and close
        self._next_id = 0
        # an engine dropped unclosed: its started ranks and process group go with it (else they outlive it, and the
        # next TPEngine(tp_size=N) joins the stale group and hangs)
        self._dropped = weakref.finalize(self, _release_dropped, self.peer_watch, self.state, self._followers,
                                         self._user_threads) if self._followers else None

    def _read_settings(self, model: str | Path | None, tp_size: int, kwargs: dict[str, Any]) -> tuple:
        """Settings, checkpoint config, tokenizer, chat template and request defaults, read and checked before this
        rank joins the others: (model, tp_size, kwargs as EngineConfig takes them, the model's config, the tokenizer's
        EOS id, every EOS id)."""
        # the tokenizer (and its chat template) as the user named it: --tokenizer's where given, else --model's (a hub
        # id, not its snapshot's path in this host's cache, which the CLI has resolved it to already)
        label = next((shown_name(name) for name in (kwargs.get("tokenizer"), model) if name is not None),
                     "the built-in model")
        model, tp_size, kwargs = vllm_keywords(model, tp_size, kwargs)
        self.config = cfg = EngineConfig(model=model, tp_size=tp_size, **kwargs)
        # the checkpoint's shape against the TP size before any rank starts (a refusal then comes once, at once)
        model_cfg = ModelConfig.from_dir(model, cfg.disable_sliding_window) if model is not None else BUILTIN_MODEL
        model_cfg.check_tp(tp_size)
        if cfg.max_model_len is not None:  # (the runner refuses it too, but once every rank has loaded the weights)
            model_cfg.check_max_model_len(cfg.max_model_len)
        # the tokenizer, the chat template and the request defaults (--generation-config, its overrides) are files
        # and values: read and checked now too, not found broken after the weights load on every rank
        self.generation_defaults = GenerationDefaults.from_option(cfg.generation_config, model,
                                                                  cfg.override_generation_config)
        # (vLLM's --tokenizer: the tokenizer, its special tokens and its chat template come from that directory)
        tokenizer_dir = cfg.model if cfg.tokenizer is None else cfg.tokenizer
        self.tokenizer = load_tokenizer(tokenizer_dir, model_cfg.vocab_size)
        if cfg.tokenizer is not None and self.tokenizer.get_vocab_size() > model_cfg.vocab_size:
            logger.warning("the tokenizer in %s has %d tokens, the model %d: prompts holding ids past the model's are "
                           "refused", cfg.tokenizer, self.tokenizer.get_vocab_size(), model_cfg.vocab_size)
        special = {"bos_token": BOS, "eos_token": EOS} if tokenizer_dir is None else special_tokens(
            tokenizer_config(tokenizer_dir))
        # the tokenizer's EOS ends a generation too, as vLLM's (its model EOS), beside generation_config's, which it
        # reads as stop tokens; config.json's only where there is no generation_config.json (vLLM's
        # try_get_generation_config reads the model's config then alone)
        main_eos = self.tokenizer.token_to_id(special["eos_token"]) if "eos_token" in special else None
        configured = self.generation_defaults.eos_token_ids
        eos_ids = tuple(dict.fromkeys(((main_eos,) if main_eos is not None else ())
                                      + (model_cfg.eos_token_id if configured is None else configured)))
        eos_ids = checked_eos_ids(eos_ids, model_cfg.vocab_size)
        self.chat_template = ChatTemplate.from_dir(tokenizer_dir, BOS) if cfg.chat_template is None else \
            ChatTemplate.from_option(cfg.chat_template, special)
        self.prompts = PromptCodec(self.tokenizer, self.chat_template, self.generation_defaults, label, eos_ids,
                                   special)
        # (one for the engine, as vLLM's get_tokenizer gives its one tokenizer: a pad token a script sets stays set)
        self._engine_tokenizer = EngineTokenizer(self.prompts)
        return model, tp_size, kwargs, model_cfg, main_eos, eos_ids

    # ---- generation ------------------------------------------------------------------------------------------
    def encode(self, prompt: Prompt) -> list[int]:
        """Text (BOS added as the tokenizer does), token ids as they are, or chat messages through the template."""
        return self.prompts.encode(prompt, self.runner.max_model_len)

    def render_chat(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True,
                    tools: list[dict] | None = None, variables: dict[str, Any] | None = None,
                    continue_final_message: bool = False, template: ChatTemplate | None = None) -> str:
        return self.prompts.render_chat(messages, add_generation_prompt, tools, variables, continue_final_message,
                                        template)

    def default_params(self, **overrides: Any) -> SamplingParams:
        """SamplingParams with the checkpoint's generation_config defaults, then `overrides`."""
        return self.prompts.default_params(**overrides)

    def get_default_sampling_params(self) -> SamplingParams:
        """vLLM's LLM.get_default_sampling_params: default_params() (what generate and chat use where given none)."""
        return self.default_params()

    def get_tokenizer(self) -> EngineTokenizer:
        """vLLM's LLM.get_tokenizer: the engine's tokenizer and chat template, with transformers' method names
        (encode, decode, apply_chat_template, eos_token_id...: EngineTokenizer), the same one each call."""
        return self._engine_tokenizer

    def generate(self, prompts: Prompt | list[Prompt],
                 sampling_params: SamplingParams | list[SamplingParams] | tuple[SamplingParams, ...] | None = None,
                 use_tqdm: bool | Callable[..., tqdm] = True, *,
                 priority: list[int] | None = None, lora_request: list[None] | tuple[None, ...] | None = None,
                 tokenization_kwargs: dict[str, Any] | None = None) -> list[GenerationOutput]:
        """Complete every prompt (text or token ids); one SamplingParams for all, or one per prompt (`sampling_params`,
        vLLM's LLM.generate name). priority (vLLM's): one for each prompt, its SamplingParams' priority (the
        scheduling_policy "priority" serves lower values first). lora_request: vLLM's, taken as None alone (no
        adapters here), or a list of None, one for each prompt. tokenization_kwargs (vLLM's): add_special_tokens for
        text prompts, truncate_prompt_tokens (TokenizeOptions). Calls from several threads run one after another."""
        # one call steps the core at a time: two threads' loops each read the other's updates (a KeyError for one, a
        # token lost from the other's outputs)
        with self._lock:
            self._check_open()
            options = TokenizeOptions()

            def normalized() -> list:
                # (lora_request and tokenization_kwargs refused inside the check, where every rank meets: one rank
                # refusing alone before it left the others waiting in the gather)
                nonlocal options
                listed = _prompt_list(prompts)
                no_lora(lora_request, len(listed))
                options = TokenizeOptions.read(tokenization_kwargs)
                return listed

            prompts = self._agreed_call("generate", normalized, sampling_params, priority, tokenization_kwargs)
            prompts, salts = unsalted(prompts)
            limit = self._encode_limit(sampling_params, options)
            special = True if options.add_special_tokens is None else options.add_special_tokens
            encoded = []
            for i, p in enumerate(prompts):
                with prompt_named(i, len(prompts)):
                    encoded.append((p.text, p.ids) if isinstance(p, TextedIds) else
                                   (p, self.prompts.encode_text(p, special, limit)) if isinstance(p, str) else
                                   (None, self.prompts.encode(p, limit)))
            return self._generate(encoded, sampling_params, use_tqdm, priority, options.truncate_prompt_tokens,
                                  salts)

    def chat(self, messages: list[dict[str, Any]] | list[list[dict[str, Any]]],
             sampling_params: SamplingParams | list[SamplingParams] | tuple[SamplingParams, ...] | None = None,
             use_tqdm: bool | Callable[..., tqdm] = True, *, tools: list[dict] | None = None,
             add_generation_prompt: bool = True,
             continue_final_message: bool = False, chat_template_kwargs: dict[str, Any] | None = None,
             chat_template: str | None = None, lora_request: list[None] | tuple[None, ...] | None = None,
             chat_template_content_format: str = "auto",
             tokenization_kwargs: dict[str, Any] | None = None) -> list[GenerationOutput]:
        """vLLM's LLM.chat, its arguments named and ordered as there (messages, sampling_params, use_tqdm; the rest
        by name): a conversation (a list of messages), or a list of them, each rendered through the chat
        template (or `chat_template`, a Jinja template's text, in its place) with these options (ChatTemplate.render)
        and completed; a message's content parts (OpenAI's) reach the template as vLLM gives them: for
        chat_template_content_format "auto", a list of text parts where the template loops over them, else their texts
        joined by newlines, a null content none ("string" always joins them, "openai" always lists them). Each
        output's prompt is the rendered text. tokenization_kwargs as generate's (the rendered text takes no special
        tokens of the tokenizer's unless add_special_tokens is True, as vLLM's chat encodes it)."""
        with self._lock:
            self._check_open()
            options, template = TokenizeOptions(), None

            def normalized() -> list:
                nonlocal options, template
                conversations = _conversation_list(messages)
                no_lora(lora_request, len(conversations))
                known_content_format(chat_template_content_format)
                options = TokenizeOptions.read(tokenization_kwargs)
                # (a file read here: a rank that cannot read it refuses where the others meet it)
                template = None if chat_template is None else self._call_template(chat_template)
                return conversations

            conversations = self._agreed_call("chat", normalized, sampling_params, tools, add_generation_prompt,
                                              continue_final_message, chat_template_kwargs, chat_template,
                                              chat_template_content_format, tokenization_kwargs)
            encoded, limit = [], self._encode_limit(sampling_params, options)
            content_format = self.prompts.content_format(tools, chat_template_content_format, template)
            for i, conversation in enumerate(conversations):
                with prompt_named(i, len(conversations), "conversation"):
                    text = self.render_chat(text_messages(conversation, content_format), add_generation_prompt,
                                            tools, chat_template_kwargs, continue_final_message, template)
                    encoded.append((text, self.prompts.encode_text(text, bool(options.add_special_tokens), limit)))
            return self._generate(encoded, sampling_params, use_tqdm,
                                  truncate_prompt_tokens=options.truncate_prompt_tokens)

    def _call_template(self, chat_template: object) -> ChatTemplate:
        """chat's chat_template: a Jinja template's text, or a file holding one, as --chat-template reads it. A text
        that is neither (no braces, no line break: a file's path mistyped, or a template's name) was rendered as it
        was, the same text for every conversation, and completed: refused, named."""
        if not isinstance(chat_template, str):
            raise RequestError(f"chat_template is a Jinja template's text, got {type(chat_template).__name__}")
        try:
            return ChatTemplate.from_option(chat_template, self.prompts.special_tokens)
        except CheckpointError as exc:
            raise RequestError(f"chat_template: {exc} (give the template's text, or the path of a file holding it)") \
                from None

    def beam_search(self, prompts: Prompt | list[Prompt], params: BeamSearchParams, lora_request: None = None,
                    use_tqdm: bool = False, concurrency_limit: int | None = None) -> list[BeamSearchOutput]:
        """vLLM's LLM.beam_search: each prompt's params.beam_width best sequences (BeamSearchOutput, best first),
        searched through generate one token a step (beam_search.py). Prompts as generate takes them (vLLM's
        {"prompt": ...} and {"prompt_token_ids": ...} among them; a dict's cache_salt is each of its steps' requests',
        where vLLM's drops it). concurrency_limit (vLLM's): at most that many
        prompts searched together. Under torchrun every rank calls it with the same arguments, as it calls generate."""
        with self._lock:
            self._check_open()

            def normalized() -> list:
                no_lora(lora_request)
                self._check_beam_search(params, concurrency_limit)
                return _prompt_list(prompts)

            listed = self._agreed_call("beam_search", normalized, params, concurrency_limit)
            listed, salts = unsalted(listed)
            limit = self.runner.max_model_len
            ids = [p.ids if isinstance(p, TextedIds) else self.prompts.encode(p, limit) for p in listed]
        tokenizer = self.get_tokenizer()
        outputs: list[BeamSearchOutput | None] = [None] * len(ids)
        # each cache_salt's prompts searched together, its steps requests of that salt (a prompt dict's, as generate's)
        for salt in dict.fromkeys(salts):
            picked = [i for i, s in enumerate(salts) if s == salt]

            def salted(batch: list[list[int]], step: SamplingParams, salt: str | None = salt) -> list[GenerationOutput]:
                return self.generate(batch, dataclasses.replace(step, cache_salt=salt), use_tqdm=False)

            found = run_beam_search(salted, [ids[i] for i in picked], params, eos_token_id=tokenizer.eos_token_id,
                                    max_model_len=limit, decode=tokenizer.decode, concurrency_limit=concurrency_limit,
                                    progress=bool(use_tqdm) and self.state.is_driver)
            for i, out in zip(picked, found, strict=True):
                outputs[i] = out
        return outputs

    def _check_beam_search(self, params: Any, concurrency_limit: Any) -> None:
        """beam_search's arguments, or a RequestError naming what cannot run (before any step)."""
        if not isinstance(params, BeamSearchParams):
            raise RequestError(f"beam_search takes a BeamSearchParams, got {type(params).__name__}")
        params.check()  # (again: a field may have been set since it was made)
        check_width(params.beam_width, self.config.max_logprobs)
        if concurrency_limit is not None and (isinstance(concurrency_limit, bool) or not isinstance(
                concurrency_limit, int) or concurrency_limit < 1):
            raise RequestError(f"concurrency_limit must be a positive integer or None, got {concurrency_limit!r}")

    def reset_prefix_cache(self, reset_running_requests: bool = False, reset_connector: bool = False) -> bool:
        """vLLM's LLM.reset_prefix_cache: forget every cached prompt prefix, so that the next requests compute theirs
        again (a benchmark's cold runs). False, with nothing changed, while requests run (never between generate
        calls here). Under torchrun every rank calls it, as it calls generate, and the ranks check so at generate's
        gather: a rank that reset alone would compute prompts the others read cached, and step apart from them.
        reset_running_requests and reset_connector (vLLM's) change nothing: no request runs while it acts (it waits
        for generate's lock) and there is no KV connector."""
        with self._lock:
            self._check_open()

            def checked() -> list:
                for name, value in (("reset_running_requests", reset_running_requests),
                                    ("reset_connector", reset_connector)):
                    if not isinstance(value, bool):
                        raise RequestError(f"{name} must be True or False, got {value!r}")
                return []

            self._agreed_call("reset_prefix_cache", checked)
            if self.service is None:
                done = self.core.reset_prefix_cache()
            else:  # (the started ranks forget theirs in the same turn)
                self.service.enqueue_reset_prefix_cache()
                while self.service.pending:
                    self.service.turn()
                done = bool(self.service.prefix_cache_reset)
        if not done:
            logger.warning("the prefix cache was not reset: requests are running")
        return done

    def _encode_limit(self, params: Any, options: TokenizeOptions) -> int | None:
        """The most tokens a call's prompts may encode to before they are refused, unread: max_model_len, or none
        where its sampling params (one, a list, or None) or its tokenization_kwargs cut any prompt
        (truncate_prompt_tokens), which is then refused or cut once encoded (_generate)."""
        listed = params if isinstance(params, (list, tuple)) else [params]
        cuts = options.truncate_prompt_tokens is not None or any(
            getattr(p, "truncate_prompt_tokens", None) is not None for p in listed)
        return None if cuts else self.runner.max_model_len

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError("this TPEngine is closed; start a new one")

    def _generate(self, encoded: list[tuple[str | None, list[int]]],
                  params: SamplingParams | list[SamplingParams] | tuple[SamplingParams, ...] | None,
                  use_tqdm: bool | Callable[..., tqdm],
                  priority: list[int] | tuple[int, ...] | None = None,
                  truncate_prompt_tokens: int | None = None,
                  cache_salts: list[str | None] | None = None) -> list[GenerationOutput]:
        """Complete the prompts, each (its text, or None where it was given as ids or messages; its ids); priority:
        each prompt's, in place of its SamplingParams' (vLLM's generate keyword); truncate_prompt_tokens: the call's
        tokenization_kwargs' cut, for the prompts whose SamplingParams set none; cache_salts: each prompt dict's
        cache_salt (vLLM's), None where it gave none, in place of its SamplingParams' cache_salt."""
        if params is None:  # (its limit, generation_config's max_new_tokens or SamplingParams' 16, is cut below)
            params = self.default_params()
        # each request's own copy, as vLLM clones them: a field the caller sets later changes later requests alone
        per_prompt = [copy.copy(p) for p in params] if isinstance(params, (list, tuple)) else \
            [copy.copy(params)] * len(encoded)
        if len(per_prompt) != len(encoded):
            raise RequestError(f"{len(per_prompt)} SamplingParams for {len(encoded)} prompts")
        for p in per_prompt:  # (before their fields are read below: another type failed there, an AttributeError)
            check_params_type(p)
        if priority is not None:
            if not isinstance(priority, (list, tuple)):
                raise RequestError(f"priority must be a list of integers, one for each prompt, got "
                                   f"{type(priority).__name__}")
            if len(priority) != len(encoded):
                raise RequestError(f"priority holds {len(priority)} value{'s' * (len(priority) != 1)} for "
                                   f"{len(encoded)} prompts")
            per_prompt = [dataclasses.replace(p, priority=v) for p, v in zip(per_prompt, priority, strict=True)]
        if cache_salts is not None and any(s is not None for s in cache_salts):
            per_prompt = [p if s is None else dataclasses.replace(p, cache_salt=s)
                          for p, s in zip(per_prompt, cache_salts, strict=True)]
        if truncate_prompt_tokens is not None:  # (a SamplingParams' own wins, as vLLM's merge_kwargs merges them)
            per_prompt = [p if p.truncate_prompt_tokens is not None else
                          dataclasses.replace(p, truncate_prompt_tokens=truncate_prompt_tokens) for p in per_prompt]
        context = self.runner.max_model_len
        # truncate_prompt_tokens: the prompt's last tokens (its text stays the prompt as given, as vLLM's output's);
        # -1 is max_model_len whatever max_tokens, as vLLM's LLM reads it (_get_cmpl_tok_params asks no room for output)
        kept = [kept_prompt_tokens(p.truncate_prompt_tokens, context, None) for p in per_prompt]
        encoded = [(text, ids if keep is None else ids[-keep:])
                   for (text, ids), keep in zip(encoded, kept, strict=True)]
        # a max_tokens past what the prompt leaves of max_model_len, given or the default, runs to max_model_len and
        # finishes "length", as vLLM's generate runs it (the server refuses a client's instead: it asked for more than
        # fits); refused, one long prompt lost the whole batch's results
        # (a min_tokens past it stays refused, by RequestLimits: that minimum cannot be met)
        per_prompt = [p if p.max_tokens is None or len(ids) + p.max_tokens <= context
                      or len(ids) + p.min_tokens > context else
                      dataclasses.replace(p, max_tokens=max(context - len(ids), 1))
                      for (_, ids), p in zip(encoded, per_prompt, strict=True)]
        results: dict[str, GenerationOutput] = {}
        decoders: dict[str, Callable[[int], str] | None] = {}  # a token's text in its Logprobs (vLLM's decoded_token)
        order, adds = [], []
        for i, ((prompt, ids), p) in enumerate(zip(encoded, per_prompt, strict=True)):
            with prompt_named(i, len(encoded)):
                self.core.check_request(ids, p)  # every prompt is checked before any is queued
            request_id = str(self._next_id)  # (vLLM's LLM numbers them so, from "0", across its calls)
            self._next_id += 1
            order.append(request_id)
            adds.append((request_id, ids, p))
            results[request_id] = GenerationOutput(
                request_id, prompt, ids,
                [CompletionOutput(i, logprobs=[] if p.logprobs is not None else None,
                                  cumulative_logprob=0.0 if p.logprobs is not None else None) for i in range(p.n)])
            decoders[request_id] = self.prompts.token_text if p.detokenize else None
        start = time.perf_counter()
        # (vLLM's use_tqdm may be a callable that makes the bar, a partial of tqdm say; other ranks draw none)
        shown = bool(use_tqdm) and self.state.is_driver
        make_bar = use_tqdm if shown and callable(use_tqdm) else tqdm
        bar = make_bar(total=len(order), desc="generating") if shown else tqdm(total=len(order), disable=True)
        texts: dict[tuple[str, int], list[str]] = defaultdict(list)  # each completion's text in pieces, joined once
        try:
            with deferred_interrupt() as interrupted:
                for update in self._run(adds, interrupted):
                    if update.finish_reason in (REFUSED, "error"):  # refused late by the engine: the others abort
                        with prompt_named(order.index(update.request_id), len(order)):
                            raise RequestError(update.text)
                    key = update.request_id, update.sample_index
                    texts[key].append(update.text)
                    if update.finish_reason is not None:
                        results[update.request_id].outputs[update.sample_index].text = "".join(texts.pop(key))
                    self._apply(results[update.request_id], update, start, bar, decoders[update.request_id])
        except BaseException:
            self._abort(order)  # nothing stays queued behind a failure or a Ctrl-C
            raise
        finally:
            bar.close()
        return [results[r] for r in order]

    def _agreed_call(self, name: str, normalize: Callable[[], list], *arguments: Any) -> list:
        """Under torchrun every rank calls generate alike (SPMD), each stepping its own copy of the schedule: other
        prompts on one rank gave every rank the same wrong tokens with no word, other lengths left one stepping
        alone until a collective timed out. One small gather a call compares the normalized prompts and the other
        arguments, before anything a rank might refuse alone (encoding, a chat template) could leave the others
        waiting in it; a rank that refuses the prompts' form meets the others there with its refusal. Returns the
        prompts as `normalize` gives them."""
        try:
            prompts, refused = normalize(), None
            call = repr((name, prompts, *arguments))
        except RequestError as error:
            prompts, refused = [], error
            call = f"refused: {error}"
        if self.service is None and self.state.world_size > 1:  # (rank 0 alone tells started ranks what to do)
            digests = gather_objects(self.state, hashlib.sha256(call.encode()).hexdigest())  # (every rank meets here)
            differ = [rank for rank, d in enumerate(digests) if d != digests[0]]
            if differ:
                here = f" (this rank's call was refused: {refused})" if refused is not None else ""
                raise RequestError(f"rank(s) {differ} made another call than rank 0's {name} (another call, or "
                                   f"other prompts or sampling parameters): under torchrun every rank makes the same "
                                   f"calls with the same arguments{here}")
        if refused is not None:
            raise refused
        return prompts

    def warm_up(self) -> float:
        """Run what serving will run before anyone waits on it: a full decode batch (greedy and sampled rows), the
        largest prefill chunk and small batches of each kind of row in WARM_UP_KINDS, so first-use costs (kernel
        compilation for new shapes, allocator growth, library initialisation) are paid at start-up, not by the first
        burst of requests. Every rank calls it (SPMD). Returns the seconds it took."""
        start = time.perf_counter()
        vocab, max_len = self.model.cfg.vocab_size, self.runner.max_model_len
        batch = self.core.scheduler.cfg.max_num_seqs
        short = max(1, min(16, max_len - 3))
        long = max(1, min(self.core.scheduler.cfg.max_num_batched_tokens, max_len - 3,
                          self.core.limits.cache_tokens - 3))
        new = max(1, min(2, max_len - max(short, long)))  # (a context of 3 tokens or fewer: shorter warm-up)
        prompts = [[(7 * i + j) % vocab for j in range(short)] for i in range(batch)]
        prompts.append([j % vocab for j in range(long)])
        params = [SamplingParams(temperature=0.0, max_tokens=new, ignore_eos=True) if i % 2 else
                  SamplingParams(temperature=1.0, top_p=0.9, seed=i, max_tokens=new, ignore_eos=True)
                  for i in range(len(prompts))]
        self.generate(prompts, params, use_tqdm=False)  # (its own requests: no bar)
        # then each kind of row alone, 1, 3 and 16 at a time: Triton compiles apart an integer argument equal to 1,
        # one divisible by 16 and any other, and a fresh server's first bursts of greedy requests compiled three argmax
        # variants in their time to first token (session 39). Penalties (fp32 logits into the argmax and the draw)
        # and top-k (its own kernels) are kinds of their own.
        for n in (n for n in (1, 3, 16) if n <= batch):
            for kind in WARM_UP_KINDS:
                if "logprobs" in kind:  # (checked against max_logprobs, as a request's are)
                    kind = {**kind, "logprobs": min(kind["logprobs"], self.config.max_logprobs)}
                self.generate(prompts[:n], SamplingParams(max_tokens=new, ignore_eos=True, **kind), use_tqdm=False)
        if self.core.eos_ids and structured_outputs_available():
            # xgrammar's vocabulary tables, and its mask kernel (Triton: the constrained rows' count compiles apart
            # at 1, 3 and 16, as above); a model without an EOS id refuses constrained requests
            digits = SamplingParams(max_tokens=new, structured=StructuredOutput("regex", "[0-9]+"))
            for n in (n for n in (1, 3, 16) if n <= batch):
                self.generate(prompts[:n], digits, use_tqdm=False)
        took = time.perf_counter() - start
        if self.state.is_driver:
            logger.info("warmed up in %.1f s (%d short prompts and one of %d tokens)", took, batch, long)
        return took

    def _run(self, adds: list[tuple[str, list[int], SamplingParams]], interrupted: threading.Event):
        """Queue the requests and step until the engine is idle, yielding updates. Ctrl-C lands between steps, never
        inside one: a step interrupted halfway would leave the ranks in different collectives."""
        if self.service is None:  # alone, or SPMD under torchrun: every rank runs this same loop
            for i, (request_id, ids, p) in enumerate(adds):
                with prompt_named(i, len(adds)):  # (as the started ranks' service path names it)
                    self.core.add_request(request_id, ids, p)
            while self.core.has_work:
                yield from self.core.step()
                if interrupted.is_set():
                    raise KeyboardInterrupt
            return
        collected: list[StepUpdate] = []
        for request_id, ids, p in adds:
            self.service.enqueue(request_id, ids, p, collected.append)
        while self.core.has_work or self.service.pending:
            self.service.turn()
            yield from collected
            collected.clear()
            if interrupted.is_set():
                raise KeyboardInterrupt

    def _abort(self, request_ids: list[str]) -> None:
        if self.service is None:
            for request_id in request_ids:
                self.core.abort(request_id)
            return
        if self.service.error is not None:  # a turn failed midway: no more turns (they could hang); close ends it
            return
        for request_id in request_ids:
            self.service.enqueue_abort(request_id)
        while self.service.pending:
            self.service.turn()

    def follow(self) -> None:
        """A started follower rank: obey rank 0 until it shuts down."""
        EngineService(self.core, ControlPlane(self.state)).run_worker()

    @staticmethod
    def _apply(out: GenerationOutput, update: StepUpdate, start: float, bar: tqdm,
               decode: Callable[[int], str] | None) -> None:
        completion = out.outputs[update.sample_index]
        now = time.perf_counter() - start
        if update.token_id is not None:
            out.ttft_s = out.ttft_s or now
            completion.token_ids.append(update.token_id)
        if update.logprob is not None:
            completion.logprobs.append(logprob_entry(update.token_id, update.logprob, update.rank,
                                                     update.top_logprobs or [], decode))
            completion.cumulative_logprob += update.logprob
        if update.cached_tokens is not None and out.num_cached_tokens is None:
            out.num_cached_tokens = update.cached_tokens
        if update.prompt_logprobs is not None and out.prompt_logprobs is None:  # (each sample brings the same)
            out.prompt_logprobs = [None, *(logprob_entry(t, lp, rank, top, decode) for (t, lp, top), rank in
                                           zip(update.prompt_logprobs, update.prompt_ranks, strict=True))]
        if update.finish_reason is not None:
            completion.finish_reason, completion.stop_reason = update.finish_reason, update.stop_reason
            out.latency_s = now
            if all(c.finish_reason is not None for c in out.outputs):
                bar.update(1)

    # ---- lifecycle -------------------------------------------------------------------------------------------
    def close(self, followers_told: bool = False) -> None:
        """Graphs (holding all-reduce registrations and NCCL work) go first, then the communicator, then the
        process group. followers_told: another loop on rank 0 (the server's EngineService) already told the started
        followers to return, so no shutdown goes to them again (it would meet closed connections)."""
        with self._lock:  # (after a generate running on another thread, not under it)
            self._close(followers_told)

    def _close(self, followers_told: bool) -> None:
        if self._closed:
            return
        self._closed = True
        if self._dropped is not None:
            self._dropped.detach()
        failed = self.service is not None and self.service.error is not None
        if self.service is not None and not followers_told and not failed:  # the followers return and close too
            self.service.enqueue_shutdown()
            while self.service.turn():
                pass
        self.peer_watch.stop()
        if failed:  # the followers may wait in a collective this rank left: no message reaches them, so end them
            logger.error("the engine loop failed (%s); stopping the other ranks", self.service.error)
            self._stop_followers(timeout_s=0.0)
        if self.core.grammars is not None:
            self.core.grammars.close()
        self.runner.close()
        # the weights go now, not when the engine object does: a closed engine still bound to a name (the `with ... as
        # llm` block's, a notebook's) held them, and the next engine in this process found that memory in use
        self.model.to("meta")
        self.comm.close()
        destroy_distributed(self.state)
        self._stop_followers()
        self._restore_threads()

    def _restore_threads(self) -> None:
        """This process's torch threads as they were before its CPU ranks shared the cores out."""
        if self._user_threads is not None:
            torch.set_num_threads(self._user_threads)
            self._user_threads = None

    def _stop_followers(self, timeout_s: float = 30.0) -> None:
        for p in self._followers:
            p.join(timeout_s)
            if p.is_alive():
                p.kill()  # (a follower defers SIGTERM: followers.follower_main)
                p.join(5.0)

    def __enter__(self) -> TPEngine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def no_lora(lora_request: object, count: int | None = None) -> None:
    """vLLM's lora_request, which scripts pass as None: anything else asks for an adapter, which tpgraph does not
    serve (a TypeError for the keyword itself broke scripts that name it). With count (generate's and chat's prompts),
    a list of them, one for each prompt, as vLLM's generate takes it: None each."""
    if count is not None and isinstance(lora_request, (list, tuple)):
        if len(lora_request) != count:  # (vLLM's _validate_and_add_requests' words)
            raise RequestError(f"The lengths of prompts ({count}) and lora_request ({len(lora_request)}) must be the "
                               f"same")
        lora_request = next((r for r in lora_request if r is not None), None)
    if lora_request is not None:
        raise RequestError("lora_request: tpgraph serves no LoRA adapters; merge the adapter into the weights (peft's "
                           "merge_and_unload) and serve the merged checkpoint")


@dataclass(frozen=True)
class TokenizeOptions:
    """vLLM's tokenization_kwargs (LLM.generate and LLM.chat; its TokenizeParams.with_kwargs reads them): None where
    not given. add_special_tokens: the tokenizer's special tokens (BOS) around a text prompt (default True) or a chat's
    rendered text (default False); truncate_prompt_tokens: as SamplingParams', which wins where set."""

    add_special_tokens: bool | None = None
    truncate_prompt_tokens: int | None = None

    @classmethod
    def read(cls, kwargs: object) -> TokenizeOptions:
        """The options, or a RequestError naming what is wrong: tokenizer.encode's other keys (padding, truncation,
        max_length, ...), which vLLM reads or ignores, are refused rather than run otherwise than the script meant."""
        if kwargs is None:
            return cls()
        if not isinstance(kwargs, dict):
            raise RequestError(f"tokenization_kwargs must be a dict or None, got {type(kwargs).__name__}")
        other = sorted(set(kwargs) - {f.name for f in dataclasses.fields(cls)}, key=str)
        if other:
            raise RequestError(f"tokenization_kwargs here take add_special_tokens and truncate_prompt_tokens alone, "
                               f"got {other}")
        special = kwargs.get("add_special_tokens")
        if special is not None and not isinstance(special, bool):
            raise RequestError(f"add_special_tokens must be True or False, got {special!r}")
        cut = kwargs.get("truncate_prompt_tokens")
        if cut is not None:
            SamplingParams(truncate_prompt_tokens=cut)  # (checked as SamplingParams' own: k >= 1, or -1)
        return cls(special, cut)


def known_content_format(content_format: object) -> None:
    """vLLM's chat_template_content_format: one of CONTENT_FORMATS."""
    if content_format not in CONTENT_FORMATS:
        raise RequestError(f"chat_template_content_format must be one of {', '.join(CONTENT_FORMATS)} (vLLM's), got "
                           f"{content_format!r}")


def _prompt_list(prompts: Any) -> list[Prompt | TextedIds | SaltedPrompt]:
    """generate's prompts as a list: one prompt (text, token ids, chat messages, or vLLM's {"prompt": text} or
    {"prompt_token_ids": ids}, with its text or without) or an iterable of them, vLLM's dicts read as the text or ids
    they hold (TextedIds where both; a SaltedPrompt of that with a cache_salt), and ids given
    as an array or a tensor as a list (the SPMD check digests their repr, which elides the middle of a long array)."""
    if is_vllm_prompt(prompts):
        return [vllm_prompt(prompts)]
    listed = isinstance(prompts, (list, tuple)) and bool(prompts) and is_vllm_prompt(prompts[0])
    if is_one_prompt(prompts) and not listed:  # (a list of dicts is chat messages, unless vLLM's prompts)
        return [_as_ids(prompts)]
    if isinstance(prompts, (bytes, dict)) or not isinstance(prompts, Iterable):
        hint = (" (chat messages are given as a list of them)") if isinstance(prompts, dict) else ""
        raise RequestError(f"prompts must be a prompt (text, token ids, chat messages, or vLLM's {{'prompt': ...}} "
                           f"or {{'prompt_token_ids': ...}}) or a list of them, got {type(prompts).__name__}{hint}")
    listed = list(prompts)
    out = []
    for i, p in enumerate(listed):
        with prompt_named(i, len(listed)):
            out.append(vllm_prompt(p) if is_vllm_prompt(p) else _as_ids(p))
    return out


def _as_ids(prompt: Any) -> Any:
    """A prompt given as token ids (a list, an array, a tensor) as a list of them; any other prompt as it is."""
    ids = None if isinstance(prompt, str) else token_ids(prompt)
    return prompt if ids is None else ids


def _conversation_list(conversations: Any) -> list:
    """chat's conversations as a list: one conversation (a list of messages) or a list of them."""
    if isinstance(conversations, (list, tuple)) and conversations and isinstance(conversations[0], dict):
        return [conversations]
    if not isinstance(conversations, (list, tuple)) or not conversations or not all(
            isinstance(c, (list, tuple)) for c in conversations):
        raise RequestError("chat takes a conversation (a list of {'role': ..., 'content': ...} messages) or a "
                           f"non-empty list of them, got {type(conversations).__name__}")
    return list(conversations)
