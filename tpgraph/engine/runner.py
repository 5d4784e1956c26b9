"""ModelRunner: owns the KV cache, the persistent inputs and the graphs, and runs prefill and decode steps.

Every step writes its inputs into pinned host twins of persistent device buffers and copies them in place
(non-blocking), asks the dispatcher which captured bucket serves it, and replays that graph (or runs eagerly).
The only host synchronization in a decode step is the caller reading its sampled tokens.
"""

from __future__ import annotations

import logging
import socket
import time
from collections import deque
from dataclasses import dataclass, field, replace
from functools import partial

import numpy as np
import torch
from tqdm import tqdm

from tpgraph.checks import positive_int, unit_fraction
from tpgraph.distributed import check_same_on_every_rank, gather_objects, run_on_all_ranks
from tpgraph.engine.argmax import combine_slots, row_argmax, shard_argmax_slots
from tpgraph.engine.kv_cache import BlockAllocator, allocate_kv_caches, kv_block_bytes
from tpgraph.engine.memory import GiB, MemoryBudget, host_memory_bytes
from tpgraph.engine.penalties import PenaltyTable
from tpgraph.engine.prefix_cache import PrefixCachingAllocator
from tpgraph.engine.prompt_logprobs import PASS_ROWS, packed_logprobs, prompt_targets
from tpgraph.engine.sampler import PendingSample, Sampler, warm_rows, worst_case_rows
from tpgraph.engine.sampling_params import MAX_LOGPROBS
from tpgraph.engine.scheduler_config import default_token_budget
from tpgraph.engine.sequence import Sequence
from tpgraph.engine.summary import startup_summary
from tpgraph.errors import ConfigError
from tpgraph.graphs.buffers import Pad, PersistentBuffers
from tpgraph.graphs.calibration import SizeTiming, describe_counts, eager_counts, slowest, time_forward
from tpgraph.graphs.captured import call
from tpgraph.graphs.config import GraphConfig
from tpgraph.graphs.dispatcher import Dispatcher, GraphMode
from tpgraph.graphs.ladder import capture_sizes, eager_above, within_budget
from tpgraph.graphs.modes import log_downgrades, resolve_modes
from tpgraph.graphs.runner import GraphRunner, estimate_pool_bytes
from tpgraph.graphs.stats import GraphStats
from tpgraph.kernels._counters import last_split_reduces, partials_buffer, polled_partials, split_counters
from tpgraph.kernels._counters import workspace_bytes as kernel_workspace_bytes  # (named apart: comm has its own)
from tpgraph.kernels._settings import env_flag
from tpgraph.kernels.argmax import MAX_SLOT_INDEX
from tpgraph.kernels.tokens import NO_SOURCE, resolve_input_ids
from tpgraph.model.attention import AttentionMetadata, attention_backend, sdpa_prefill
from tpgraph.model.llama import LlamaForCausalLM
from tpgraph.model.varlen_prefill import prefill_attention
from tpgraph.uploads import to_device, to_device_parts

logger = logging.getLogger(__name__)
NULL_BLOCK = 0  # never handed out: padded rows write their K/V here and read nothing
NULL_SLOT = NULL_BLOCK  # its first slot


@dataclass
class DecodeTiming:
    """Host time of the last decode call: input preparation (dispatch, writes, the copy) and forward submission."""

    prepare_s: float = 0.0
    submit_s: float = 0.0


class GpuTimer:
    """GPU time of decode forwards from CUDA events. A pair is read only once its end event has completed (never
    waited for), so timing adds no sync; with overlapped steps that is usually two steps after its launch."""

    MAX_PENDING = 8  # pairs kept unread at most (the oldest go unmeasured)

    def __init__(self) -> None:
        self._pending: deque[tuple[torch.cuda.Event, torch.cuda.Event]] = deque()
        self.last_s: float | None = None
        self._fresh = False

    def begin(self) -> torch.cuda.Event:
        self._collect()
        start = torch.cuda.Event(enable_timing=True)
        start.record()
        return start

    def end(self, start: torch.cuda.Event) -> None:
        end = torch.cuda.Event(enable_timing=True)
        end.record()
        self._pending.append((start, end))
        while len(self._pending) > self.MAX_PENDING:
            self._pending.popleft()

    def take(self) -> float | None:
        """The newest measurement not taken before, or None (none completed since)."""
        self._collect()
        fresh, self._fresh = self._fresh, False
        return self.last_s if fresh else None

    def _collect(self) -> None:
        while self._pending and self._pending[0][1].query():
            start, end = self._pending.popleft()
            self.last_s = start.elapsed_time(end) / 1e3
            self._fresh = True


@dataclass(frozen=True)
class RunnerConfig:
    block_size: int = 16
    max_batch: int = 8  # max_num_seqs
    max_model_len: int | None = None  # default: the model's context (max_context), capped by what the KV cache holds
    num_kv_blocks: int | None = None  # default: from free GPU memory (CUDA), max_batch full sequences (CPU)
    kv_cache_memory_bytes: int | None = None  # vLLM's: the cache's bytes (null block included), in place of the above
    use_triton: bool | None = None  # default: on GPU
    gpu_memory_utilization: float = 0.9
    # tokens per prefill forward; default scheduler_config.default_token_budget's (chunked prefill)
    max_num_batched_tokens: int | None = None
    # the allocator names computed blocks for sharing (engine/prefix_cache.py); the engine turns it on, while a runner
    # driven by hand (the greedy loop, hf_parity) has no scheduler to match prompts
    enable_prefix_caching: bool = False
    graphs: GraphConfig = field(default_factory=GraphConfig)

    def __post_init__(self) -> None:
        # (an int first: True passed as 1, and a float failed in the power-of-two test with a TypeError)
        bs = self.block_size
        if isinstance(bs, bool) or not isinstance(bs, int) or bs < 1 or bs & (bs - 1):
            raise ConfigError(f"block_size must be a power of two, got {bs!r}")
        positive_int("max_batch", self.max_batch)
        unit_fraction("gpu_memory_utilization", self.gpu_memory_utilization)
        # (the runner reads these through `or`: a 0 would silently mean the default, a negative nonsense sizes)
        for name in ("max_model_len", "num_kv_blocks", "max_num_batched_tokens", "kv_cache_memory_bytes"):
            if getattr(self, name) is not None:
                positive_int(name, getattr(self, name), " or None (the default)")


class ModelRunner:
    def __init__(self, model: LlamaForCausalLM, cfg: RunnerConfig = RunnerConfig(),
                 stats: GraphStats | None = None) -> None:
        self.model, self.cfg = model, cfg
        mcfg, g = model.cfg, cfg.graphs
        self.device = model.embed_tokens.weight.device
        self.dtype = model.embed_tokens.weight.dtype
        self.is_driver = model.comm.rank == 0
        self.block_size = cfg.block_size
        self.max_model_len = cfg.max_model_len or mcfg.max_context
        mcfg.check_max_model_len(self.max_model_len)
        # rope rows for the positions a sequence can reach, before the KV budget reads what is in use
        model.rotary.resize(self.max_model_len)
        self.max_blocks_per_seq = -(-self.max_model_len // self.block_size)
        self.use_triton = self.device.type == "cuda" if cfg.use_triton is None else cfg.use_triton
        self.prefill_attention = "SDPA per sequence"
        prefill = sdpa_prefill
        if self.use_triton:  # varlen FlashAttention where a probe on this GPU and torch agrees with SDPA
            attn = model.layers[0].self_attn
            prefill, self.prefill_attention = prefill_attention(sdpa_prefill, self.device, self.dtype, attn.num_heads,
                                                                attn.num_kv_heads, attn.head_dim)
        self.backend = attention_backend(self.use_triton, prefill)

        # which graph mode each phase runs: resolved once, every downgrade reported loudly
        self.stats = stats if stats is not None else GraphStats()
        self.modes = resolve_modes(g.decode_mode, g.prefill_mode, enforce_eager=g.enforce_eager,
                                   device_type=self.device.type, support=self.backend.capture_support)
        for d in self.modes.downgrades:
            self.stats.record_downgrade(d.phase, d.requested, d.resolved, d.reason)
        if self.is_driver:
            log_downgrades(self.modes, logger)
        decode_sizes = capture_sizes(g.ladder, cfg.max_batch) if self.modes.decode != "none" else ()
        # batches past the largest capture size run eagerly (vLLM's behaviour), said once: they are several times slower
        self.decode_eager_above = eager_above(decode_sizes, cfg.max_batch)
        if self.decode_eager_above is not None and self.is_driver:
            logger.warning("decode batches of %d to %d sequences run eagerly: the decode capture sizes top out at %d "
                           "(add a size >= %d to capture them, or lower max_num_seqs)", self.decode_eager_above + 1,
                           cfg.max_batch, self.decode_eager_above, cfg.max_batch)
        # longer prompts run in chunks of this many tokens (chunked prefill)
        # (and at least a decode token for each of max_batch sequences: the scheduler's budget is this)
        self.max_prefill_tokens = cfg.max_num_batched_tokens or default_token_budget(self.max_model_len, cfg.max_batch)
        # (a forward never holds more: sizes past the first that holds the budget would never run)
        prefill_sizes = within_budget(g.prefill_sizes, self.max_prefill_tokens) if self.modes.prefill == "piecewise" \
            else ()
        keyed_full = self.modes.decode in ("full", "breakable")
        self.decode_dispatcher = Dispatcher(decode_sizes if keyed_full else (), () if keyed_full else decode_sizes)
        self.prefill_dispatcher = Dispatcher((), prefill_sizes)
        self._decode_mode_label = GraphMode.BREAKABLE if self.modes.decode == "breakable" else None

        # persistent inputs, sized once for the largest bucket
        self.seq_rows = max(cfg.max_batch, *decode_sizes) if decode_sizes else cfg.max_batch
        # every prefill forward fits the token buffers (a few bytes per row)
        # decode inputs: one row per sequence, one arena, so a step's inputs reach the device in one copy; block tables
        # (wide, padded rows never read) last, so the copy spans only their first n rows
        self.decode_in = PersistentBuffers(self.seq_rows, self.device)
        self.decode_in.add("input_ids", torch.int64, Pad.ZERO)
        self.decode_in.add("positions", torch.int64, Pad.ZERO)
        self.decode_in.add("slot_mapping", torch.int64, Pad.fill(NULL_SLOT))  # padded rows write the null block
        self.decode_in.add("seq_lens", torch.int32, Pad.fill(0))  # padded rows attend to nothing
        # a row whose last token the previous step sampled and the host has not read: where it lies in sampled_ids
        self.decode_in.add("token_source", torch.int64, Pad.fill(NO_SOURCE))
        self.decode_in.add("block_tables", torch.int32, Pad.COPY_HEAD_ONLY, (self.max_blocks_per_seq,))
        # prefill inputs: one row per token; every prefill forward fits (a few bytes per row)
        self.token_rows = max(self.max_prefill_tokens, *prefill_sizes, 1)
        self.prefill_in = PersistentBuffers(self.token_rows, self.device)
        self.prefill_in.add("input_ids", torch.int64, Pad.ZERO)
        self.prefill_in.add("positions", torch.int64, Pad.ZERO)
        self.prefill_in.add("slot_mapping", torch.int64, Pad.fill(NULL_SLOT))
        # laid out now, not at their first use in the KV sizing's profile: that would count them in its activation peak
        # as well as in what stays in use
        self.decode_in.allocate()
        self.prefill_in.allocate()
        # TPGRAPH_GREEDY_IN_STEP=1: a decode step makes its greedy ids itself (in its graph), where the next step reads
        # pending tokens, so a plain-greedy step needs no logits (decode_greedy), and at TP > 1 no rank gathers them.
        # Opt-in: at TP=1 it measured mixed (bench/results/2026-12-03_h200_greedy_in_step); TP=2 is untimed
        self.greedy_in_step = self._agreed_greedy_in_step(env_flag("TPGRAPH_GREEDY_IN_STEP", default=False))
        # the gathered logits of a decode step, where the step itself does not leave them whole (TP > 1, or with the
        # greedy ids out of the step, which the step then gathers here)
        self.logits = (torch.empty(self.seq_rows, model.padded_vocab_size, dtype=self.dtype, device=self.device)
                       if model.comm.world_size > 1 or not self.greedy_in_step else None)
        # this rank's logits shard of a decode step, where the step leaves it (its greedy ids made from it)
        self.shard_logits = (torch.empty(self.seq_rows, model.lm_head.shard.per_rank, dtype=self.dtype,
                                         device=self.device) if self.greedy_in_step else None)
        # the last step's sampled ids, one per sampled row (sampled_rows): the next decode takes pending tokens here
        self.sampled_ids = torch.zeros(self.seq_rows, dtype=torch.int64, device=self.device)
        # penalized sequences' token counts, a row each (at most max_batch sequences sample in a step), kept between
        # steps and grown by the sampled ids on the device: made before the KV budget, which counts it
        self.penalties = PenaltyTable(cfg.max_batch, mcfg.vocab_size, self.device)
        # (seq_id, preemptions, blocks) of the table each row holds: a recomputed sequence has new blocks
        self._bt_rows: list[tuple[int, int, int] | None] = [None] * self.seq_rows
        self._prefill_meta: dict[int, AttentionMetadata] = {}

        attn = model.attention_layers()
        self._kv_shape = (len(attn), attn[0].num_kv_heads, mcfg.head_dim)
        self.block_bytes = kv_block_bytes(len(attn), self.block_size, attn[0].num_kv_heads, mcfg.head_dim,
                                          self.dtype)
        self.graphs = GraphRunner(model.comm, self.device, warmups=g.warmups, check_addresses=g.check_addresses,
                                  show_progress=self.is_driver)
        self.budget: MemoryBudget | None = None
        self.last_decode = DecodeTiming()
        # the last prefill's prompt log-probabilities: (sequence, its first prompt token there, the entries on their
        # way to the host), for the sequences whose params ask for them
        self.last_prompt_logprobs: list[tuple[Sequence, int, PendingSample]] = []
        self.gpu_timer = GpuTimer() if self.device.type == "cuda" else None
        self.trial_capture_bytes: dict[str, dict[int, int]] = {}  # phase -> {size: bytes} of the estimate's captures
        num_blocks = self._size_kv_cache()
        # (on every rank alike: one that runs out of memory alone must not leave the others in the next collective)
        run_on_all_ranks(self.model.comm.state, lambda: self._allocate_kv_cache(num_blocks), "allocating the KV cache")
        self._fit_max_model_len()
        self.capture_s = self.capture_bytes = 0.0
        self.prefill_timings: list[SizeTiming] = []  # each prefill size's forwards, eager and from its graph
        self.capture_all()
        if self.is_driver:
            logger.info("start-up summary\n%s", self.summary())

    def summary(self) -> str:
        return startup_summary(self)

    # ---- memory ----------------------------------------------------------------------------------------------
    def min_cache_blocks(self) -> int:
        """The fewest blocks a measured cache may have (with the null block): one sequence of an explicit
        max_model_len; for the model's own (the default) one block, since _fit_max_model_len then caps it to what
        the cache holds instead of refusing."""
        return 1 + (self.max_blocks_per_seq if self.cfg.max_model_len is not None else 1)

    def _fit_max_model_len(self) -> None:
        """A sequence of max_model_len tokens must fit the cache: cap the default, refuse an explicit value."""
        capacity = self.allocator.num_blocks * self.block_size
        if capacity >= self.max_model_len:
            return
        if self.cfg.max_model_len is not None:
            if self.cfg.num_kv_blocks:  # sized by hand: memory flags change nothing
                fix = f"raise --num-kv-blocks to {self.max_blocks_per_seq + 1} (the null block and one sequence's)"
            else:
                fix = "raise --gpu-memory-utilization, or use more GPUs"
            raise ConfigError(f"max_model_len {self.max_model_len} needs that many tokens of KV cache, but only "
                              f"{capacity} fit ({self.allocator.num_blocks} blocks of {self.block_size}); lower "
                              f"--max-model-len, {fix}")
        if self.is_driver:
            logger.warning("max_model_len: the model's %d tokens do not fit the KV cache; capped at %d",
                           self.max_model_len, capacity)
        self.max_model_len = capacity
        self.model.rotary.resize(capacity)

    def _allocate_kv_cache(self, num_blocks: int) -> None:
        """The cache of num_blocks blocks, bound to the layers; a size given by hand that does not fit is named."""
        try:
            self._bind_kv_cache(num_blocks)
        except RuntimeError as exc:  # (torch.OutOfMemoryError on CUDA; the CPU allocator's is a plain RuntimeError)
            oom = isinstance(exc, torch.OutOfMemoryError) or "can't allocate memory" in str(exc)
            by_hand = self._sized_by_hand()
            if not (oom and by_hand):
                raise
            flag, asked = by_hand
            raise ConfigError(f"{flag} {asked} asks for {num_blocks * self.block_bytes / GiB:.2f} GiB "
                              f"of KV cache ({self.block_bytes / (1 << 20):.2f} MiB a block), more than the "
                              f"{self.device.type} has free: lower {flag}, or leave it out to size the cache "
                              "from free memory") from exc

    def _sized_by_hand(self) -> tuple[str, int] | None:
        """The flag that sized the KV cache by hand and its value (--num-kv-blocks, --kv-cache-memory-bytes), for
        refusals to name; None where memory sizes it."""
        if self.cfg.num_kv_blocks:
            return "--num-kv-blocks", self.cfg.num_kv_blocks
        if self.cfg.kv_cache_memory_bytes:
            return "--kv-cache-memory-bytes", self.cfg.kv_cache_memory_bytes
        return None

    def _bind_kv_cache(self, num_blocks: int) -> None:
        layers, heads, dim = self._kv_shape
        self.kv_caches = None  # free the old cache before the new one is allocated
        for layer in self.model.attention_layers():
            layer.kv_cache = None
        self.kv_caches = allocate_kv_caches(layers, num_blocks, self.block_size, heads, dim, self.dtype, self.device)
        for layer, cache in zip(self.model.attention_layers(), self.kv_caches, strict=True):
            layer.kv_cache = cache
        self.num_kv_blocks = num_blocks
        blocks, first = num_blocks - 1, NULL_BLOCK + 1
        self.allocator = (PrefixCachingAllocator(blocks, self.block_size, first) if self.cfg.enable_prefix_caching
                          else BlockAllocator(blocks, first))
        if self.device.type == "cuda" and last_split_reduces():  # made now, never first under a graph capture
            split_counters(self.device, 1)
            if polled_partials():
                partials_buffer(self.device, 1)

    def _size_kv_cache(self) -> int:
        """Blocks for the cache: given, or (CUDA) what free memory holds after weights, workspace, activations (the
        peak of a decode step at the largest batch, its sampling with every option on, and the largest prefill) and an
        estimate of the graph pool from capturing the two largest buckets of each captured phase."""
        if self.cfg.num_kv_blocks:
            if self.cfg.num_kv_blocks < 2:
                raise ConfigError(f"num_kv_blocks {self.cfg.num_kv_blocks} leaves no block to use (block 0 is the null "
                                  "block padded slots write): pass --num-kv-blocks 2 or more")
            return self._fits_host(self.cfg.num_kv_blocks)
        if self.cfg.kv_cache_memory_bytes:  # (vLLM's: the size asked, gpu_memory_utilization aside)
            return self._fits_host(self._blocks_in_bytes(self.cfg.kv_cache_memory_bytes))
        if self.device.type != "cuda":
            return self._fits_host(self.max_blocks_per_seq * self.cfg.max_batch + 1)
        self._bind_kv_cache(2)  # the null block and one more: enough for profiling and trial captures
        provisional = 2 * self.block_bytes
        torch.cuda.synchronize(self.device)
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(self.device)
        base = torch.cuda.memory_allocated(self.device)
        with torch.inference_mode():
            self._prepare_dummy(self.seq_rows)
            out = self._decode_forward(self.seq_rows, call)
            # a step that samples at the largest batch: its gathered logits and the sampler's temporaries
            logits = self._logits(out, self.cfg.max_batch)
            sampler = Sampler(self.device, penalties=self.penalties)
            sampler.sample(logits, worst_case_rows(self.cfg.max_batch, logits.shape[1], self.max_model_len))
            # rows without penalties read the logits as they are (not an fp32 copy): their kernels compile here, not
            # in the first step that samples them
            sampler.sample(logits, warm_rows(self.cfg.max_batch))
            self.penalties.clear()
            del out, logits
            # (the largest graph's size may lie past the budget: its warm-ups and its start-up timing run it eagerly)
            self._profile_prefill(self.token_rows)
        torch.cuda.synchronize(self.device)
        activation_peak = torch.cuda.max_memory_allocated(self.device) - base
        estimate = 0
        for phase, kind, sizes in self._phases():
            if kind == "breakable":
                continue
            # a first capture pays one-time costs (per-stream library workspaces, first-use setup) that stay allocated
            # after release, so in_use below holds them already: pay them here, outside the measured captures
            self._capture_phase(phase, kind, sizes[:1])
            self.graphs.release(phase)
            trial = self._capture_phase(phase, kind, sizes[-2:])
            by_size = sorted(trial.capture_bytes.items(), reverse=True)
            self.trial_capture_bytes[phase] = dict(by_size)
            second = by_size[1][1] if len(by_size) > 1 else by_size[0][1]
            estimate += estimate_pool_bytes(by_size[0][1], second, sizes, kind)
        self.graphs.release()
        torch.cuda.empty_cache()
        # the ranks on this GPU (TPGRAPH_SHARED_GPU puts them all on one); also a barrier: every rank sharing it has
        # freed its trial captures before its free memory is read
        mine = str(torch.cuda.get_device_properties(self.device).uuid)
        sharers = gather_objects(self.model.comm.state, mine).count(mine)
        free, total = torch.cuda.mem_get_info(self.device)
        weights = sum(p.numel() * p.element_size() for p in self.model.parameters())
        self.budget = MemoryBudget(total=total, utilization=self.cfg.gpu_memory_utilization,
                                   in_use=total - free - provisional * sharers, weights=weights,
                                   workspace=self.model.comm.workspace_bytes, activation_peak=activation_peak,
                                   graph_pool_estimate=estimate, block_bytes=self.block_bytes,
                                   kernel_workspace=kernel_workspace_bytes(self.device),
                                   penalty_table=self.penalties.nbytes, rope_tables=self.model.rotary.nbytes,
                                   sharers=sharers)
        # every rank must hold the same number of blocks (one scheduler drives them all): the smallest budget wins
        agreed = min(gather_objects(self.model.comm.state, self.budget.num_blocks))
        self.budget = replace(self.budget, agreed_blocks=agreed)
        self.budget.check(self.min_cache_blocks(), max_model_len_asked=self.cfg.max_model_len is not None)
        if self.is_driver:
            logger.info("KV budget: %s", self.budget.describe())
        return self.budget.num_blocks

    def _fits_host(self, blocks: int) -> int:
        """`blocks`, refused on CPU where the caches of this host's ranks outgrow its memory: CPU pages are taken as
        they are first written, so a cache past the host's memory failed as an allocator traceback, or as the OOM
        killer (mid-serving, or zeroing a cache sized by hand). Every rank on this host takes its shard of the cache
        from the same memory (also a check every rank meets). The default size is the worst case: max_batch sequences
        of max_model_len."""
        if self.device.type == "cuda":
            return blocks
        host = socket.gethostname()
        ranks = gather_objects(self.model.comm.state, host).count(host)
        need, memory = blocks * self.block_bytes * ranks, host_memory_bytes()
        on = f"this host's {ranks} ranks' caches" if ranks > 1 else "the KV cache"
        if by_hand := self._sized_by_hand():
            asked, fix = f"{by_hand[0]} {by_hand[1]} asks for", f"lower {by_hand[0]}"
        else:
            asked = (f"the KV cache holds --max-num-seqs {self.cfg.max_batch} sequences of --max-model-len "
                     f"{self.max_model_len} tokens:")
            fix = "lower either, or pass --num-kv-blocks"

        def fits() -> None:
            if need > memory:
                raise ConfigError(f"on CPU {asked} {on}, {need / GiB:.1f} GiB, more than this host's "
                                  f"{memory / GiB:.1f} GiB (or its container's limit): {fix}")

        run_on_all_ranks(self.model.comm.state, fits, "sizing the CPU KV cache")  # (hosts may differ)
        return blocks

    def _blocks_in_bytes(self, nbytes: int) -> int:
        """The blocks kv_cache_memory_bytes holds (the null block among them), refused where too few to serve."""
        blocks, least = nbytes // self.block_bytes, self.min_cache_blocks()
        if blocks < least:
            need = "the null block and one sequence of max_model_len" if self.cfg.max_model_len is not None else \
                "the null block and one more"
            raise ConfigError(f"kv_cache_memory_bytes {nbytes} holds {blocks} KV blocks of {self.block_bytes} bytes "
                              f"but needs at least {least} ({need}): raise kv_cache_memory_bytes to "
                              f"{least * self.block_bytes}" + (", or lower max_model_len" if self.cfg.max_model_len
                                                               is not None else ""),
                              ("kv_cache_memory_bytes", "max_model_len"))
        return blocks

    def _null_prefill(self, tokens: int) -> list[int]:
        """Write a prefill of `tokens` tokens that stores nothing: prompts of at most max_model_len, every token writing
        the null slot. Returns the prompts' lengths."""
        lens = [self.max_model_len] * (tokens // self.max_model_len)
        lens += [tokens % self.max_model_len] if tokens % self.max_model_len else []
        self.prefill_in.host_np("input_ids")[:tokens] = 0
        self.prefill_in.host_np("positions")[:tokens] = np.concatenate([np.arange(n) for n in lens])
        self.prefill_in.host_np("slot_mapping")[:tokens] = NULL_SLOT
        self.prefill_in.commit(tokens, tokens)
        return lens

    def _profile_prefill(self, tokens: int) -> None:
        """The largest prefill that runs eagerly (a step's, or a graph's warm-up or timing), storing nothing."""
        lens = self._null_prefill(tokens)
        hidden = self._eager_prefill(tokens, lens)
        self.model.compute_logits(hidden[-len(lens):])
        # a request's prompt log-probabilities: a pass of their largest (prompt_logprobs.py)
        rows = min(tokens, PASS_ROWS)
        packed_logprobs(self.model.compute_logits, hidden, torch.arange(rows, device=self.device),
                        self.prefill_in.device("input_ids", rows), MAX_LOGPROBS)

    # ---- capture ---------------------------------------------------------------------------------------------
    def _phases(self) -> list[tuple[str, str, tuple[int, ...]]]:
        phases = []
        decode = self.decode_dispatcher.full_sizes or self.decode_dispatcher.piecewise_sizes
        if decode:
            phases.append(("decode", self.modes.decode, decode))
        if self.prefill_dispatcher.piecewise_sizes:
            phases.append(("prefill", "piecewise", self.prefill_dispatcher.piecewise_sizes))
        return phases

    def _capture_phase(self, phase: str, kind: str, sizes: tuple[int, ...]):
        # one boundary scratch serves every layer and size: reserved at the largest row count, before any capture (a
        # decode batch may have more rows than a prefill forward's token budget, and the estimate's first capture
        # hands the scratch out at the smallest size, so it could not grow for the largest later)
        heads = self.model.attention_layers()[0].num_heads
        rows = max(self.token_rows, self.seq_rows)
        self.graphs.workspaces.reserve("piecewise_boundary", rows * heads * self.model.cfg.head_dim, self.dtype,
                                       self.device)
        prefill = phase == "prefill"
        forward = self._prefill_forward if prefill else self._decode_forward
        inputs = self._prefill_inputs if prefill else self._decode_inputs
        with torch.inference_mode():
            return self.graphs.capture(phase, kind, sizes, forward, inputs,
                                       lambda size: self._prepare_dummy(size, prefill))

    def capture_all(self) -> None:
        """Capture every phase's graphs (re-capturing releases the old ones first), then close the capture phase."""
        phases = self._phases()
        if not phases:
            return
        self.graphs.reopen_capture_phase()
        start = time.perf_counter()
        for phase, kind, sizes in phases:
            self._capture_phase(phase, kind, sizes)
        self.graphs.close_capture_phase()
        self.capture_s = time.perf_counter() - start
        self.capture_bytes = self.graphs.pool_bytes
        estimate = self.budget.graph_pool_estimate if self.budget else 0
        if self.is_driver:
            counts = ", ".join(f"{s.phase} {s.kind} x{len(s.graphs)}" for s in self.graphs.sets.values())
            logger.info("Graph capture finished in %.1f s, took %.2f GiB (estimated %.2f GiB) [%s]", self.capture_s,
                        self.capture_bytes / GiB, estimate / GiB, counts)
        self._calibrate_prefill()

    @torch.inference_mode()
    def _calibrate_prefill(self) -> None:
        """Time every captured prefill size eagerly and from its graph (the slowest rank's figures, on every rank), and
        dispatch eagerly the token counts that padding would make slower (graphs/calibration.py)."""
        sizes = self.prefill_dispatcher.piecewise_sizes
        if not self.cfg.graphs.calibrate_prefill or "prefill" not in self.graphs.sets:
            return
        sync = torch.cuda.synchronize if self.device.type == "cuda" else (lambda: None)
        timings = []
        for size in tqdm(sizes, desc="timing prefill graphs", unit="size", disable=not self.is_driver, leave=False):
            lens = self._null_prefill(size)
            eager = time_forward(partial(self._eager_prefill, size, lens), sync)
            # (as a step's replay: the metadata set afresh each time, so varlen attention builds its layout each time,
            # as the eager forward does)
            graph = time_forward(partial(self._replay_prefill, size, lens), sync)
            timings.append(SizeTiming(size, eager, graph))
        self.prefill_timings = slowest(gather_objects(self.model.comm.state, timings))
        # (a forward never holds more than its budget: the largest size may lie past it, its counts there never run)
        eager = [n for n in eager_counts(self.prefill_timings) if n <= self.max_prefill_tokens]
        self.prefill_dispatcher = Dispatcher((), sizes, eager)
        if self.is_driver:
            logger.info("prefill graphs timed (ms, eager / graph): %s; eager for %s tokens",
                        ", ".join(f"{t.size}: {t.eager_s * 1e3:.1f} / {t.graph_s * 1e3:.1f}"
                                  for t in self.prefill_timings),
                        describe_counts(self.prefill_dispatcher.eager_counts))

    def _prepare_dummy(self, size: int, prefill: bool = False) -> None:
        """Padding everywhere: ids 0, slots to the null block, seq_lens 0 (reads nothing)."""
        if prefill:
            self.prefill_in.commit(0, size)
            meta = self._meta_for_prefill(size)
            meta.query_lens, meta.context_lens, meta.context_blocks = (), (), ()
        else:
            self.decode_in.commit(0, size)

    def _agreed_greedy_in_step(self, wanted: bool) -> bool:
        """The setting, the same on every rank: it decides which collectives a step runs, so ranks that differ would
        hang in them. A vocabulary whose indices int32 cannot carry is refused here, on every rank alike."""
        check_same_on_every_rank(self.model.comm.state, "TPGRAPH_GREEDY_IN_STEP", wanted)
        if wanted and self.model.cfg.vocab_size > MAX_SLOT_INDEX:
            raise ConfigError(f"TPGRAPH_GREEDY_IN_STEP=1 carries token ids as int32: a vocabulary of "
                              f"{self.model.cfg.vocab_size} is too large")
        return wanted

    # ---- forwards over the persistent buffers (what graphs capture) ------------------------------------------
    def _decode_inputs(self, n: int) -> dict[str, torch.Tensor]:
        inputs = {name: self.decode_in.device(name, n) for name in self.decode_in.names}
        inputs["sampled_ids"] = self.sampled_ids
        for name in ("logits", "shard_logits"):
            if getattr(self, name) is not None:
                inputs[name] = getattr(self, name)
        return inputs

    def _decode_forward(self, n: int, boundary) -> torch.Tensor:
        """The step: [n, padded vocab / world] logits shards with the greedy ids in sampled_ids[:n] (greedy_in_step),
        else [n, vocab] gathered logits."""
        t = self._decode_inputs(n)
        resolve_input_ids(t["input_ids"], t["token_source"], self.sampled_ids, use_triton=self.use_triton)
        meta = AttentionMetadata(False, t["slot_mapping"], t["seq_lens"], t["block_tables"], self.backend,
                                 self.max_model_len, boundary=boundary)
        hidden = self.model(t["input_ids"], t["positions"], meta)
        if not self.greedy_in_step:
            return self.model.compute_logits(hidden, out=self.logits)
        shard = self.model.shard_logits(hidden, out=self.shard_logits)
        # after this step's pending tokens were read above; a step that samples otherwise overwrites these rows
        self._greedy_ids(shard, out=self.sampled_ids[:n])
        return shard

    def _greedy_ids(self, shard: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """Every rank's logits shard -> the argmax of each gathered row (the first NaN, else the first maximum) on
        every rank, into `out`. Across ranks each shard's maximum and index go in its slot of a [world, rows, 4] fp32
        buffer, zeros elsewhere, and one all-reduce fills every slot exactly (16 bytes a row a rank, not the logits;
        engine/argmax.py)."""
        vocab = self.model.lm_head.shard
        real = shard[:, : vocab.real_rows]  # the last shard's padding columns are not vocabulary
        comm = self.model.comm
        if comm.world_size == 1:
            return row_argmax(real, out=out)
        slots = shard_argmax_slots(real, vocab.start, comm.rank, comm.world_size)
        return combine_slots(comm.all_reduce(slots), out=out)

    def _prefill_inputs(self, n: int) -> dict[str, torch.Tensor]:
        return {name: self.prefill_in.device(name, n) for name in self.prefill_in.names}

    def _meta_for_prefill(self, n: int) -> AttentionMetadata:
        """One persistent metadata object per token count: piecewise graphs' attention reads its query_lens."""
        meta = self._prefill_meta.get(n)
        if meta is None:
            # prefill attention reads query_lens, not seq_lens / block tables (they are placeholders)
            meta = AttentionMetadata(True, self.prefill_in.device("slot_mapping", n),
                                     self.decode_in.device("seq_lens", 1), self.decode_in.device("block_tables", 1),
                                     self.backend, self.max_model_len)
            self._prefill_meta[n] = meta
        return meta

    def _prefill_forward(self, n: int, boundary) -> torch.Tensor:
        meta = self._meta_for_prefill(n)
        meta.boundary = boundary
        t = self._prefill_inputs(n)
        try:
            return self.model(t["input_ids"], t["positions"], meta)
        finally:
            meta.boundary = call  # a capture's boundary must not stay reachable (it would keep that graph alive)

    # ---- cache bookkeeping -----------------------------------------------------------------------------------
    def reserve(self, seq: Sequence, num_tokens: int) -> None:
        """Make seq's block table large enough for num_tokens tokens."""
        if num_tokens > self.max_model_len:
            raise ConfigError(f"sequence {seq.seq_id} would reach {num_tokens} tokens, over max_model_len "
                              f"{self.max_model_len}")
        need = seq.blocks_needed(self.block_size, num_tokens)
        if need:
            seq.block_table.extend(self.allocator.allocate(need))

    def free(self, seq: Sequence) -> None:
        self.allocator.free(seq.block_table)
        seq.forget_blocks()
        self.forget_rows()  # rows must be rewritten: a block id may now mean another sequence

    def forget_rows(self) -> None:
        """Rewrite every decode row's block table at its next use. Its key names a sequence by id, so a new owner of
        the runner, whose ids start from 0 again (an EngineCore, greedy_generate), must call this first."""
        self._bt_rows = [None] * self.seq_rows

    # ---- steps -----------------------------------------------------------------------------------------------
    @torch.inference_mode()
    def prefill(self, seqs: list[Sequence], num_tokens: list[int] | None = None) -> torch.Tensor:
        """Run each sequence's next num_tokens[i] uncached tokens (default: all of them; a chunk continues from the
        sequence's cached tokens), in forwards of at most max_num_batched_tokens tokens. Returns the logits of each
        sequence's last run token [B, vocab]."""
        if num_tokens is None:  # whole prompts; a prompt over the per-forward budget runs in chunks
            last: dict[int, torch.Tensor] = {}
            pending, prompt_logprobs = list(seqs), []
            while pending:
                logits = self.prefill(pending, [min(s.num_uncached, self.max_prefill_tokens) for s in pending])
                prompt_logprobs += self.last_prompt_logprobs
                for seq, row in zip(pending, logits, strict=True):
                    last[id(seq)] = row
                pending = [s for s in pending if s.num_uncached > 0]
            self.last_prompt_logprobs = prompt_logprobs
            return torch.stack([last[id(seq)] for seq in seqs])
        self.last_prompt_logprobs = []
        counts = list(num_tokens)
        if len(counts) != len(seqs):
            raise ConfigError(f"{len(counts)} token counts for {len(seqs)} sequences")
        for seq in seqs:
            if seq.num_pending:  # its prompt and outputs go to the GPU from the host: every id must be known
                raise ConfigError(f"sequence {seq.seq_id} cannot prefill: {seq.num_pending} of its tokens are still "
                                  f"being sampled")
        for seq, n in zip(seqs, counts, strict=True):
            if not 1 <= n <= min(len(seq) - seq.num_cached, self.max_prefill_tokens):
                raise ConfigError(f"sequence {seq.seq_id}: cannot prefill {n} tokens ({len(seq) - seq.num_cached} "
                                  f"uncached, at most {self.max_prefill_tokens} per forward)")
        groups: list[list[int]] = [[]]
        total = 0
        for i, n in enumerate(counts):
            if groups[-1] and total + n > self.max_prefill_tokens:
                groups.append([])
                total = 0
            groups[-1].append(i)
            total += n
        logits = [self._prefill_group([seqs[i] for i in g], [counts[i] for i in g]) for g in groups]
        return logits[0] if len(logits) == 1 else torch.cat(logits)

    def _prefill_group(self, seqs: list[Sequence], counts: list[int]) -> torch.Tensor:
        bs = self.block_size
        starts = [seq.num_cached for seq in seqs]
        for seq, start, n in zip(seqs, starts, counts, strict=True):
            self.reserve(seq, start + n)
        total = sum(counts)
        mode, desc = self.prefill_dispatcher.dispatch(total, len(seqs), False)
        spans = list(zip(seqs, starts, counts, strict=True))
        positions = np.concatenate([np.arange(start, start + n) for _, start, n in spans])
        slots = np.concatenate([np.asarray(seq.block_table, dtype=np.int64)[np.arange(start, start + n) // bs]
                                for seq, start, n in spans]) * bs + positions % bs
        inputs = self.prefill_in
        inputs.host_np("input_ids")[:total] = [t for seq, start, n in spans for t in seq.token_span(start, start + n)]
        inputs.host_np("positions")[:total] = positions
        inputs.host_np("slot_mapping")[:total] = slots
        padded = desc.num_tokens
        inputs.commit(total, padded)
        context = tuple(starts) if any(starts) else ()
        blocks = tuple(tuple(seq.block_table) for seq in seqs) if context else ()
        if mode is GraphMode.PIECEWISE:
            hidden = self._replay_prefill(padded, counts, context, blocks)
        else:
            hidden = self._eager_prefill(total, counts, context, blocks)
        self.stats.record("prefill", total, padded, mode)
        self._prompt_logprobs(spans, hidden)
        last = to_device(counts, torch.int64, self.device).cumsum(0) - 1
        for seq, start, n in spans:
            seq.num_cached = start + n
        return self.model.compute_logits(hidden[last])

    def _prompt_logprobs(self, spans: list[tuple[Sequence, int, int]], hidden: torch.Tensor) -> None:
        """The prompt log-probabilities this group's hidden states give (prompt_logprobs.py), their copies started:
        every asking sequence's rows in the same passes (many short prompts, as an evaluation sends, take one)."""
        asking, rows, ids, offset = [], [], [], 0
        for seq, start, n in spans:
            if seq.computes_prompt_logprobs:
                targets = prompt_targets(seq, start, n)
                if targets:
                    asking.append((seq, targets, len(rows)))
                    rows += range(offset + targets.start - 1 - start, offset + targets.stop - 1 - start)
                    ids += seq.prompt_ids[targets.start:targets.stop]
            offset += n
        if not asking:
            return
        k = max(seq.params.prompt_logprobs for seq, _, _ in asking)  # (each reads its own first k of them)
        at, targets_dev = to_device_parts([rows, ids], torch.int64, self.device)
        packed = packed_logprobs(self.model.compute_logits, hidden, at, targets_dev, k)
        for seq, targets, a in asking:
            b = a + len(targets)
            self.last_prompt_logprobs.append((seq, targets.start, PendingSample(targets_dev[a:b], packed[a:b], k)))

    def _replay_prefill(self, padded: int, lens: list[int], context: tuple[int, ...] = (),
                        blocks: tuple[tuple[int, ...], ...] = ()) -> torch.Tensor:
        """The prefill graph of `padded` tokens over the committed inputs. Its metadata gets new tuples each call:
        varlen attention rebuilds its layout only for new ones (varlen_prefill.layout_for)."""
        meta = self._meta_for_prefill(padded)
        meta.query_lens, meta.context_lens, meta.context_blocks = tuple(lens), context, blocks
        return self.graphs.replay("prefill", padded, self._prefill_inputs)

    def _eager_prefill(self, total: int, lens: list[int], context: tuple[int, ...] = (),
                       blocks: tuple[tuple[int, ...], ...] = ()) -> torch.Tensor:
        t = self._prefill_inputs(total)
        meta = AttentionMetadata(True, t["slot_mapping"], self.decode_in.device("seq_lens", 1),
                                 self.decode_in.device("block_tables", 1), self.backend, self.max_model_len,
                                 query_lens=tuple(lens), context_lens=context, context_blocks=blocks)
        return self.model(t["input_ids"], t["positions"], meta)

    def _write_decode_inputs(self, seqs: list[Sequence], token_sources: list[int] | None = None) -> None:
        """Host rows [0, n) of every decode input: one pass over the sequences collects the per-row values, then numpy
        writes each column (the per-sequence Python work is what host time per step is made of)."""
        n, bs = len(seqs), self.block_size
        if token_sources is None:
            token_sources = [NO_SOURCE] * n
        elif len(token_sources) != n:
            raise ConfigError(f"{len(token_sources)} token sources for {n} sequences")
        inputs, rows = self.decode_in, self._bt_rows
        tables = inputs.host_np("block_tables")
        # where each sequence's table was written (a row's key: seq id, preemptions, the table's length then): a
        # sequence that moved to another row (one before it finished or sat out) has its row copied over in C, and a
        # table that grew gets its new entries alone; rewritten whole from its list, a shift of the batch cost every
        # row its whole context's blocks
        written: dict[tuple[int, int], tuple[int, int]] | None = None  # (made at the first row that changed)
        moves: list[tuple[int, int]] = []
        tails: list[tuple[int, list[int], int, tuple[int, int, int]]] = []
        lens, tokens, blocks = [0] * n, [0] * n, [0] * n
        for i, (seq, source) in enumerate(zip(seqs, token_sources, strict=True)):
            if seq.num_pending != (source != NO_SOURCE) or not NO_SOURCE <= source < self.seq_rows:
                raise ConfigError(f"sequence {seq.seq_id}: {seq.num_pending} pending tokens but token source "
                                  f"{source} (a pending last token needs its row of sampled_ids, and only it)")
            length = len(seq)
            table = seq.block_table
            if length > len(table) * bs:  # a new block once every block_size steps
                self.reserve(seq, length)
            lens[i], tokens[i], blocks[i] = length, seq.last_token, table[(length - 1) // bs]
            key = (seq.seq_id, seq.num_preemptions, len(table))
            if rows[i] != key:  # a block table row changes once every block_size steps, or when its sequence moves
                if written is None:
                    written = {k[:2]: (row, k[2]) for row, k in enumerate(rows) if k is not None}
                row, done = written.get(key[:2], (i, 0))
                done = done if done <= len(table) else 0  # (a table only grows while its key's sequence runs)
                if row != i and done:
                    moves.append((i, row))
                tails.append((i, table, done, key))
        if moves:  # (the rows read are copied out before any is written)
            tables[[to for to, _ in moves]] = tables[[of for _, of in moves]]
        for i, table, done, key in tails:  # (keys changed last: `written` is the rows as the last step left them)
            self._write_table_row(tables, i, table, done)
            rows[i] = key
        last = np.array(lens, dtype=np.int64) - 1
        inputs.host_np("seq_lens")[:n] = lens
        inputs.host_np("positions")[:n] = last
        inputs.host_np("input_ids")[:n] = tokens
        inputs.host_np("token_source")[:n] = token_sources
        inputs.host_np("slot_mapping")[:n] = np.array(blocks, dtype=np.int64) * bs + last % bs

    @staticmethod
    def _write_table_row(tables: np.ndarray, row: int, table: list[int], start: int) -> None:
        """Write block table entries [start, len(table)) of a decode row from the sequence's list."""
        if start < len(table):
            tables[row, start:len(table)] = table[start:]

    @torch.inference_mode()
    def decode(self, seqs: list[Sequence], token_sources: list[int] | None = None) -> torch.Tensor:
        """One new token per sequence (its last token, not yet cached). Returns logits [B, vocab]: a view of a
        persistent buffer, valid until the next step (copy out what must outlive it).

        A sequence whose last token is still pending (sampled by the previous step, not read back) names its row of
        `sampled_ids` in token_sources (NO_SOURCE for the others): the step reads the id there, on the device.
        With greedy_in_step the step then writes its greedy ids into sampled_ids[:padded batch], and at TP > 1 the
        logits are gathered after the step (outside its graph, by every rank alike)."""
        return self._logits(self._decode_step(seqs, token_sources), len(seqs))

    @torch.inference_mode()
    def decode_greedy(self, seqs: list[Sequence], token_sources: list[int] | None = None) -> torch.Tensor:
        """As `decode`, for a step whose every row takes its argmax: returns the ids [B] int64 on the device, in
        `sampled_rows(B)`, where the next step reads pending tokens. With greedy_in_step the step made them itself and
        no rank gathers logits; else they are the gathered logits' argmax."""
        n = len(seqs)
        out = self._decode_step(seqs, token_sources)
        return self.sampled_rows(n) if self.greedy_in_step else row_argmax(self._logits(out, n),
                                                                            out=self.sampled_rows(n))

    def _logits(self, out: torch.Tensor, n: int) -> torch.Tensor:
        """A decode step's output -> its [n, vocab] gathered logits."""
        if self.greedy_in_step and self.logits is not None:  # shards: gathered here, by every rank (stream order)
            return self.model.gather_logits(out[:n], out=self.logits)
        return out[:n, : self.model.cfg.vocab_size]

    def _decode_step(self, seqs: list[Sequence], token_sources: list[int] | None) -> torch.Tensor:
        n = len(seqs)
        # (max_batch, not the buffers' rows: those reach the largest bucket, and the penalty table has max_batch rows)
        if n > self.cfg.max_batch:
            raise ConfigError(f"a decode batch of {n} exceeds max_batch {self.cfg.max_batch}")
        t0 = time.perf_counter()
        mode, desc = self.decode_dispatcher.dispatch(n, n, True)
        padded = desc.num_tokens
        self._write_decode_inputs(seqs, token_sources)
        self.decode_in.commit(n, padded)
        t1 = time.perf_counter()
        gpu = self.gpu_timer.begin() if self.gpu_timer is not None else None
        if mode is GraphMode.NONE:
            logits = self._decode_forward(n, call)
        else:
            logits = self.graphs.replay("decode", padded, self._decode_inputs)
        if gpu is not None:
            self.gpu_timer.end(gpu)
        self.stats.record("decode", n, padded, mode if mode is GraphMode.NONE else self._decode_mode_label or mode)
        self.last_decode = DecodeTiming(prepare_s=t1 - t0, submit_s=time.perf_counter() - t1)
        for seq in seqs:
            seq.num_cached = len(seq)
        return logits

    def sampled_rows(self, rows: int) -> torch.Tensor:
        """Where a step's sampler writes its `rows` ids (sampled_ids[:rows]), so that the next decode reads the
        pending ones on the device without a copy in between. Stream order puts that write after the step that
        produced the logits, and the host copy of the ids before the next step's sampler writes here again."""
        if not 0 <= rows <= self.seq_rows:
            raise ConfigError(f"{rows} sampled ids do not fit the {self.seq_rows} rows kept")
        return self.sampled_ids[:rows]

    def close(self) -> None:
        """Release the graphs (their all-reduce rows and peer mappings) and the KV cache."""
        self.graphs.close()
        self.kv_caches = None
        for layer in self.model.attention_layers():
            layer.kv_cache = None
