"""Batched sampling on the logits' device: penalties, temperature, top-k, top-p, min-p, seeds and log-probabilities.

Every rank holds the same gathered logits and runs the same calls with the same generator states, so every rank
samples the same tokens: nothing is broadcast. A seeded request draws from its own generator, seeded from
(seed + sample index, output position), so its tokens do not depend on what else is in the batch. Unseeded rows share
one generator that every rank seeds alike at start-up.

Penalties read each sequence's token counts from a table on the device (penalties.py), which the step's sampled ids
update in stream order, so they need no output token on the host.

Order: logit bias, then penalties on the logits (greedy rows too), then temperature, top-k, top-p, min-p, and a
draw by the exponential race (argmax of p / E with E ~ Exp(1), which samples p exactly). Log-probabilities are those
of the model's own distribution (log_softmax of the raw logits), as OpenAI reports them; under a structured output,
of what its grammar allows (vLLM masks the logits before its sampler).

On CUDA, everything after the penalties and banned ids runs in kernels/top_k.py's and kernels/sampling.py's
launches instead of the torch chain below, without a sort: the same distribution, with its own
random numbers per row (Philox keyed by the row's seed, drawn from the shared generator or the request's). The penalty
table applies and counts in kernels/penalties.py's launches there.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import NamedTuple

import torch

from tpgraph.engine.argmax import row_argmax
from tpgraph.engine.penalties import FILL_TOKENS, PenaltyTable
from tpgraph.engine.sampling_params import MAX_LOGPROBS, SamplingParams
from tpgraph.engine.structured import GrammarState, apply_masks
from tpgraph.kernels import sampling as fused_sampling
from tpgraph.kernels import top_k as fused_top_k
from tpgraph.kernels.argmax import check_ids_out
from tpgraph.uploads import to_device, to_device_parts

_MASK = 0xFFFF_FFFF_FFFF_FFFF


@dataclass(frozen=True)
class SampleRow:
    """What sampling one row needs: the request's parameters and the tokens so far."""

    params: SamplingParams
    prompt_ids: tuple[int, ...] | list[int]
    output_ids: tuple[int, ...] | list[int]
    sample_index: int = 0  # which of the request's n samples
    banned_ids: tuple[int, ...] = ()  # ids this step may not produce (EOS before min_tokens)
    # the sequence's id, under which a penalized row's counts stay in the penalty table between steps (None: counted
    # from prompt_ids and output_ids for this call only)
    seq_id: int | None = None
    grammar: GrammarState | None = None  # a structured output (structured.py): only the tokens it can take next
    # more ids this step may not produce, in lists fixed for the request (its one-token bad words; before min_tokens,
    # its stop and EOS ids): each list the same tuple at every step, so that it is uploaded once (KeptUploads)
    fixed_banned: tuple[tuple[int, ...], ...] = ()


@dataclass
class SampleOutput:
    token_ids: list[int]
    logprobs: list[float] | None = None  # the sampled token's, per row
    top_ids: list[list[int]] | None = None  # per row, the top `max logprobs` ids (a row asking fewer slices)
    top_logprobs: list[list[float]] | None = None
    ranks: list[int] | None = None  # each row's token's rank: the ids at least as likely (1: the most likely)


def worst_case_rows(rows: int, vocab: int, max_model_len: int) -> list[SampleRow]:
    """`rows` rows that take every stage of sampling at once (logit bias, allowed ids, penalties, temperature, top-k,
    top-p, min-p, a banned id, the most log-probabilities): the sampling step the runner's memory profile runs at its
    largest batch, so that the KV budget leaves room for the sampler's [rows, vocab] temporaries. Their histories (up
    to max_model_len tokens each) fill the penalty table's largest upload (FILL_TOKENS), as rows that all take a table
    slot in one step do.
    (top-k 50: its [rows, k] values and indices stay far below top-p's sort of the whole row.)"""
    params = SamplingParams(temperature=0.7, top_k=50, top_p=0.9, min_p=0.01, repetition_penalty=1.1,
                            frequency_penalty=0.5, presence_penalty=0.5, logprobs=min(MAX_LOGPROBS, vocab),
                            logit_bias={0: 1.0}, allowed_token_ids=tuple(range(0, vocab, 2)))
    history = tuple(i % vocab for i in range(max(2, min(max_model_len, FILL_TOKENS // rows))))
    half = len(history) // 2  # (the output half is counted by index_put_'s accumulate, which sorts)
    return [SampleRow(params, history[:half], history[half:], banned_ids=history[:1]) for _ in range(rows)]


def warm_rows(rows: int) -> list[SampleRow]:
    """`rows` unpenalized rows that take every launch of the fused draw (top-k's floor, top-p and min-p checks) on the
    logits as they come: run once at start-up so that those kernels compile before the first step needs them."""
    params = SamplingParams(temperature=0.7, top_k=50, top_p=0.9, min_p=0.01)
    return [SampleRow(params, [], []) for _ in range(rows)]


def row_seed(seed: int, sample_index: int, position: int) -> int:
    """A 64-bit seed for one draw of a seeded request (splitmix64 of the seed and the position). Sample i draws as
    sample 0 of seed + i, as vLLM seeds a request's i-th sample (vllm/v1/engine/parallel_sampling.py)."""
    x = ((seed + sample_index) * 0x9E3779B97F4A7C15 + position * 0x94D049BB133111EB) & _MASK
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK
    return (x ^ (x >> 31)) & 0x7FFF_FFFF_FFFF_FFFF


def plain_greedy(rows: list[SampleRow]) -> bool:
    """Whether every row's token is its logits' argmax and nothing else is asked (no log-probabilities, bias,
    penalties or banned ids): such a step needs no logits on the host's side, only the argmax."""
    return all(r.params.greedy and r.params.logprobs is None and not r.params.logit_bias and not r.params.has_penalties
               and not r.banned_ids and not r.fixed_banned and r.grammar is None and r.params.allowed_token_ids is None
               and not r.params.bad_words for r in rows)


class Sampler:
    def __init__(self, device: torch.device | str, seed: int = 0, penalties: PenaltyTable | None = None,
                 fused: bool | None = None) -> None:
        """`penalties`: the table that keeps penalized sequences' counts between steps (its owner clears it when its
        sequence ids start again); without one, a step's penalized rows are counted from their ids each time.
        `fused`: draw sampled rows with kernels/sampling.py's launches (None: on CUDA unless
        TPGRAPH_FUSED_SAMPLING=0; True on CPU runs it under TRITON_INTERPRET=1) rather than the torch chain below.
        The two draw from the same distribution with different random numbers."""
        self.device = torch.device(device)
        self.generator = torch.Generator(device=self.device).manual_seed(seed)
        self.penalties = penalties
        self.fused = fused
        # (allowed_token_ids and the fixed ban lists: both id lists, in one cache and its one memory bound)
        self.id_lists = allowed_ids_uploads(self.device)
        self.biases = logit_bias_uploads(self.device)

    def _takes_fused(self, logits: torch.Tensor) -> bool:
        if fused_sampling.triton is None or logits.dtype not in (torch.float16, torch.bfloat16, torch.float32):
            return False
        if self.fused is not None:
            return self.fused
        return logits.is_cuda and fused_sampling.fused_sampling_enabled()

    def sample(self, logits: torch.Tensor, rows: list[SampleRow]) -> SampleOutput:
        """logits [B, V] (one row per SampleRow) -> sampled ids, and log-probabilities where asked. One host sync."""
        return self.sample_async(logits, rows).result()

    @torch.inference_mode()
    def sample_async(self, logits: torch.Tensor, rows: list[SampleRow],
                     ids_out: torch.Tensor | None = None) -> PendingSample:
        """As `sample`, without waiting: the ids stay on the device (`PendingSample.ids`, for the next step's inputs;
        in `ids_out` where given, [B] int64: plain greedy rows are written there by the argmax itself, others copied)
        and their copy to the host is under way."""
        if logits.dim() != 2 or logits.shape[0] != len(rows):
            raise ValueError(f"logits {tuple(logits.shape)} do not match {len(rows)} rows")
        check_ids_out(ids_out, len(rows), logits.device, "ids_out")
        want_logprobs = [r.params.logprobs for r in rows if r.params.logprobs is not None]
        if plain_greedy(rows) and logits.dtype in (torch.float16, torch.bfloat16, torch.float32):
            # their argmax is that of their fp32 copy (an exact cast), so no fp32 copy is made
            return self._start_copy(row_argmax(logits, out=ids_out), None, None)
        fused = not all(r.params.greedy for r in rows) and self._takes_fused(logits)
        # the kernel reads 16-bit logits as they are; grammars, bias and penalties are applied in fp32
        biased = any(r.params.logit_bias for r in rows)
        constrained = [(i, r.grammar) for i, r in enumerate(rows) if r.grammar is not None and r.grammar.masks]
        x = logits if fused and not biased and not constrained and not any(
            r.params.has_penalties for r in rows) else logits.float()
        if constrained:  # (in place: on a copy of the caller's logits)
            x = x if x is not logits else x.clone()
            apply_masks(x, constrained)
        # after the grammars' masks: vLLM masks the logits before its sampler, whose log-probabilities are then those
        # of the tokens a grammar allows (and before bias, penalties and the rest)
        raw_logprobs = torch.log_softmax(x, dim=-1, dtype=torch.float32) if want_logprobs else None
        if biased:  # before penalties, as vLLM orders them; in place where x is a copy already
            x = add_logit_bias(x, rows, self.biases, in_place=x is not logits)
        x, counted = penalize(x, rows, self.penalties)
        if any(r.params.allowed_token_ids is not None for r in rows):  # (out of place, as below)
            x = keep_allowed(x, rows, self.id_lists)
        if any(r.banned_ids or r.fixed_banned for r in rows):
            x = ban(x, rows, self.id_lists)
        if all(r.params.greedy for r in rows):
            ids = row_argmax(x)
        elif fused:
            ids = self._draw_fused(x, rows)
        else:
            ids = self._draw(x, rows)
        if ids_out is not None:
            ids = ids_out.copy_(ids)
        if counted is not None and self.penalties is not None:  # the step's ids join their sequences' counts
            self.penalties.count(counted.slots, ids if counted.positions is None else ids[counted.positions])
        return self._start_copy(ids, raw_logprobs, max(want_logprobs, default=None))

    def _draw(self, x: torch.Tensor, rows: list[SampleRow]) -> torch.Tensor:
        greedy_ids = row_argmax(x)
        # NaN is never drawn, as the fused draw reads it: left in, it made the row's maximum and so all its weights NaN
        x = x.masked_fill(x.isnan(), float("-inf"))
        params = [r.params for r in rows]
        temperature = to_device([1.0 if p.greedy else p.temperature for p in params], torch.float32, x.device)
        x = x / temperature.unsqueeze(1)
        if any(p.top_k > 0 for p in params):
            x = top_k_mask(x, [p.top_k for p in params])
        # probabilities up to a factor per row (each row's largest is 1): top-p, min-p and the draw below are the same
        # for any positive scale of a row, so no softmax normalizes them
        weights = (x - x.amax(dim=-1, keepdim=True)).exp_()
        # min-p, then top-p over what it keeps, as vLLM's V1 orders them (top-p's share is of min-p's survivors)
        if any(p.min_p > 0.0 for p in params):  # (below min_p times the largest, which is 1)
            min_p = to_device([p.min_p for p in params], torch.float32, x.device).unsqueeze(1)
            weights = weights.masked_fill(weights < min_p, 0.0)
        if any(p.top_p < 1.0 for p in params):
            weights = top_p_keep(weights, [p.top_p for p in params])
        race = torch.empty_like(weights).exponential_(generator=self.generator)
        for i, r in enumerate(rows):
            if r.params.seed is not None:
                g = torch.Generator(device=x.device).manual_seed(
                    row_seed(r.params.seed, r.sample_index, len(r.output_ids)))
                race[i].exponential_(generator=g)
        sampled = row_argmax(weights / race)
        greedy = to_device([p.greedy for p in params], torch.bool, x.device)
        return torch.where(greedy, greedy_ids, sampled)

    def _draw_fused(self, x: torch.Tensor, rows: list[SampleRow]) -> torch.Tensor:
        """The rows' tokens from kernels/sampling.py: top-k's floor from kernels/top_k.py (torch.topk above its MAX_K
        or with TPGRAPH_FUSED_TOP_K=0), then the kernel's launches for temperature, top-k, top-p, min-p and the draw;
        greedy rows take their argmax."""
        params = [r.params for r in rows]
        if x.stride(-1) != 1:
            x = x.contiguous()
        per_row = [v for p in params for v in (0.0 if p.greedy else p.temperature, p.top_p, p.min_p, float("-inf"))]
        ks = [0 if p.greedy else p.top_k for p in params]
        if 0 < max(ks) <= fused_top_k.MAX_K and fused_top_k.fused_top_k_enabled():
            # one upload: the rows' parameters, then their k, from which the kernel writes the floor column
            uploaded = to_device(per_row + ks, torch.float32, x.device)
            per_row = uploaded[:4 * len(rows)].view(-1, 4)
            fused_top_k.top_k_floors(x, uploaded[4 * len(rows):], per_row[:, 3])
        else:
            per_row = to_device(per_row, torch.float32, x.device).view(-1, 4)
            if any(k > 0 for k in ks):  # the kernel leaves out what is below top-k's floor
                per_row[:, 3] = top_k_floor(x, ks)  # (exact from 16- and 32-bit logits)
        truncated = any(not p.greedy and (p.top_p < 1.0 or p.min_p > 0.0) for p in params)
        ids = fused_sampling.sample_rows(x, per_row, self._row_seeds(rows, x.device), truncated=truncated)
        if any(p.greedy for p in params):
            ids = torch.where(per_row[:, 0] > 0, ids, row_argmax(x))
        return ids

    def _row_seeds(self, rows: list[SampleRow], device: torch.device) -> torch.Tensor:
        """[B] int64: each seeded row's row_seed, the others' drawn from the shared generator."""
        seeds = torch.randint(0, fused_sampling.SEED_HIGH, (len(rows),), generator=self.generator, device=device)
        seeded = [i for i, r in enumerate(rows) if r.params.seed is not None]
        if seeded:
            at, values = to_device_parts(
                [seeded, [row_seed(rows[i].params.seed, rows[i].sample_index, len(rows[i].output_ids))
                          for i in seeded]], torch.int64, device)
            seeds = seeds.index_put((at,), values)
        return seeds

    def pending(self, ids: torch.Tensor) -> PendingSample:
        """Ids already chosen on the device (a plain-greedy step's, made in the decode step itself: ModelRunner.
        decode_greedy) as a sample under way: their copy to the host is started."""
        return self._start_copy(ids, None, None)

    def _start_copy(self, ids: torch.Tensor, raw_logprobs: torch.Tensor | None, k: int | None) -> PendingSample:
        if raw_logprobs is None:
            return PendingSample(ids, ids, 0)
        return PendingSample(ids, packed_rows(raw_logprobs, ids, k or 0), k or 0)


def packed_rows(logprobs: torch.Tensor, ids: torch.Tensor, k: int) -> torch.Tensor:
    """[B, V] log-probabilities and the [B] ids taken from them -> [B, 3 + 2k] float64, PendingSample's layout: each
    id and its log-probability, the k most likely ids and theirs, then the id's rank (the ids at least as likely,
    itself among them: 1 for the most likely, ties counted, as vLLM's). One tensor, so one transfer to the host (ids
    and ranks are exact in float64)."""
    chosen = logprobs.gather(1, ids.unsqueeze(1))
    parts = [ids.double().unsqueeze(1), chosen.double()]
    if k:
        top_lp, top_ids = logprobs.topk(k, dim=-1)
        parts += [top_ids.double(), top_lp.double()]
    parts.append((logprobs >= chosen).sum(dim=1, keepdim=True).double())
    return torch.cat(parts, dim=1)


class PendingSample:
    """Sampled ids on the device and their copy to the host, under way (pinned memory, an event after it): the
    host reads them with `result()`, which waits for that copy only."""

    def __init__(self, ids: torch.Tensor, packed: torch.Tensor, top_k: int) -> None:
        # [B] int64 on the logits' device: with the sampler's ids_out, the runner's sampled_ids rows, which the next
        # step's sampler overwrites (the host copy below is taken first, in stream order)
        self.ids = ids
        self._top_k = top_k
        # packed: [B, 3 + 2k] float64 (id, logprob, top ids, top logprobs, the id's rank)
        self._with_logprobs = packed is not ids
        if packed.is_cuda:
            self._host = torch.empty(packed.shape, dtype=packed.dtype, pin_memory=True)
            self._host.copy_(packed, non_blocking=True)
            self._copied: torch.cuda.Event | None = torch.cuda.Event()
            self._copied.record(torch.cuda.current_stream(packed.device))
        else:  # a copy all the same: packed may be the runner's sampled_ids, which the next step overwrites
            self._host, self._copied = packed.clone(), None

    def result(self) -> SampleOutput:
        if self._copied is not None:
            self._copied.synchronize()
        rows = self._host.tolist()
        if not self._with_logprobs:
            return SampleOutput(rows)
        k = self._top_k
        return SampleOutput(token_ids=[int(r[0]) for r in rows], logprobs=[r[1] for r in rows],
                            top_ids=[[int(v) for v in r[2:2 + k]] for r in rows],
                            top_logprobs=[r[2 + k:2 + 2 * k] for r in rows],
                            ranks=[int(r[-1]) for r in rows])


class Counted(NamedTuple):
    """Where a step's penalized rows sit: their positions in the batch (None: every row) and their table slots."""

    positions: torch.Tensor | None
    slots: torch.Tensor


def penalize(x: torch.Tensor, rows: list[SampleRow], table: PenaltyTable | None
             ) -> tuple[torch.Tensor, Counted | None]:
    """x [B, vocab] fp32 -> (x with the penalized rows' penalties applied, a new tensor where any is; where their ids
    are counted, None if no row is penalized). Without a table, the rows are counted from their ids in one made for
    this call."""
    positions = [i for i, r in enumerate(rows) if r.params.has_penalties]
    if not positions:
        return x, None
    penalized = [rows[i] for i in positions]
    if table is None:
        table = PenaltyTable(len(penalized), x.shape[1], x.device)
    params = [r.params for r in penalized]
    if len(positions) == len(rows):
        slots = to_device(table.slots_for(penalized), torch.int64, x.device)
        return table.apply(x, slots, params), Counted(None, slots)
    at, slots = to_device_parts([positions, table.slots_for(penalized)], torch.int64, x.device)
    return x.index_put((at,), table.apply(x[at], slots, params)), Counted(at, slots)


class KeptUploads:
    """Each request's fixed per-token lists (allowed_token_ids, logit_bias, SampleRow.fixed_banned's) on the device,
    uploaded once: a request's tuple is the same object every step (it is kept beside its upload, so its id is not
    reused while cached). A step then costs the host a lookup per row that has one; listed and uploaded again each
    step, 300 logit_bias entries a request took longer than the step itself in a batch of a few dozen such rows."""

    MAX_ENTRIES = 1 << 22  # (cached 8-byte entries of every request together; past this, the cache starts again)
    # the fewest entries a tensor is counted as: CUDA's caching allocator gives a tensor at least 512 bytes, so a cache
    # of one-id tuples (each finished request's stays until the cache starts again) held 64 times its ids' bytes
    MIN_CHARGE = 512 // 8

    def __init__(self, upload: Callable[[tuple], tuple[torch.Tensor, ...]]) -> None:
        self.upload = upload
        self._cache: dict[int, tuple[tuple, tuple[torch.Tensor, ...]]] = {}
        self._count = 0

    def get(self, values: tuple) -> tuple[torch.Tensor, ...]:
        hit = self._cache.get(id(values))
        if hit is None or hit[0] is not values:
            tensors = self.upload(values)
            charge = sum(max(t.numel(), self.MIN_CHARGE) for t in tensors)
            if self._count + charge > self.MAX_ENTRIES:
                self._cache.clear()
                self._count = 0
            hit = self._cache[id(values)] = (values, tensors)
            self._count += charge
        return hit[1]


def allowed_ids_uploads(device: torch.device) -> KeptUploads:
    """allowed_token_ids (or another fixed list of ids: SampleRow.fixed_banned's) -> (ids [n] int64,) on the
    device."""
    return KeptUploads(lambda ids: (to_device(ids, torch.int64, device),))


def logit_bias_uploads(device: torch.device) -> KeptUploads:
    """logit_bias pairs -> (ids [n] int64, values [n] fp32) on the device."""
    return KeptUploads(lambda pairs: (to_device([t for t, _ in pairs], torch.int64, device),
                                      to_device([b for _, b in pairs], torch.float32, device)))


def keep_allowed(x: torch.Tensor, rows: list[SampleRow], allowed: KeptUploads) -> torch.Tensor:
    """x with every logit masked (-inf) but each row's allowed_token_ids (rows without any keep all)."""
    asking = [(i, allowed.get(r.params.allowed_token_ids)[0]) for i, r in enumerate(rows)
              if r.params.allowed_token_ids is not None]
    ids = torch.cat([t for _, t in asking])
    masked, counts = to_device_parts([[i for i, _ in asking], [len(t) for _, t in asking]], torch.int64, x.device)
    # (index_fill_ and a device scalar: `keep[i] = False` copied the Python scalar from the host, waiting for the GPU)
    keep = torch.ones_like(x, dtype=torch.bool).index_fill_(0, masked, False)
    keep.index_put_((masked.repeat_interleave(counts, output_size=len(ids)), ids),
                    torch.ones((), dtype=torch.bool, device=x.device))
    return x.masked_fill(~keep, float("-inf"))


def ban(x: torch.Tensor, rows: list[SampleRow], kept: KeptUploads) -> torch.Tensor:
    """x with each row's banned ids masked (-inf), out of place (x may be the caller's logits): its fixed lists from
    the uploads kept between steps (a row index and a count uploaded for each), its banned_ids uploaded whole, all in
    one upload."""
    fixed = [(i, kept.get(ids)[0]) for i, r in enumerate(rows) for ids in r.fixed_banned]
    fixed_rows, counts, step_rows, step_ids = to_device_parts(
        [[i for i, _ in fixed], [len(t) for _, t in fixed], [i for i, r in enumerate(rows) for _ in r.banned_ids],
         [t for r in rows for t in r.banned_ids]], torch.int64, x.device)
    fixed_ids = [t for _, t in fixed]
    at = torch.cat([fixed_rows.repeat_interleave(counts, output_size=sum(len(t) for t in fixed_ids)), step_rows])
    return x.index_put((at, torch.cat([*fixed_ids, step_ids])),
                       torch.full((), float("-inf"), dtype=x.dtype, device=x.device))


def add_logit_bias(x: torch.Tensor, rows: list[SampleRow], biases: KeptUploads, in_place: bool) -> torch.Tensor:
    """x [B, vocab] fp32 with each row's logit_bias added (a row's ids are distinct, so one gather and one scatter
    add them exactly): x itself if in_place, else a new tensor. `biases`: the uploads kept between steps."""
    biased = [(i, biases.get(r.params.logit_bias)) for i, r in enumerate(rows) if r.params.logit_bias]
    ids = torch.cat([t for _, (t, _) in biased])
    values = torch.cat([v for _, (_, v) in biased])
    biased_rows, counts = to_device_parts([[i for i, _ in biased], [len(t) for _, (t, _) in biased]], torch.int64,
                                          x.device)
    at = biased_rows.repeat_interleave(counts, output_size=len(ids))
    return (x.index_put_ if in_place else x.index_put)((at, ids), x[at, ids] + values)


def top_k_mask(x: torch.Tensor, ks: list[int]) -> torch.Tensor:
    """Keep each row's k largest logits (k 0: all); ties at the k-th value are kept."""
    return x.masked_fill(x < top_k_floor(x, ks).unsqueeze(1), float("-inf"))


def top_k_floor(x: torch.Tensor, ks: list[int]) -> torch.Tensor:
    """[B] in x's dtype: each row's k-th largest logit (what top-k keeps is at or above it), -inf where k is 0 (all
    kept). NaN counts below -inf, as kernels/top_k.py counts it (torch.topk would rank it first), and is never
    drawn."""
    vocab = x.shape[1]
    k_max = min(max(ks), vocab)
    kth = x.nan_to_num(nan=float("-inf"), posinf=float("inf"), neginf=float("-inf")).topk(k_max, dim=-1).values
    index = to_device([min(k, vocab) - 1 if k > 0 else k_max - 1 for k in ks], torch.int64, x.device).unsqueeze(1)
    off = to_device([k <= 0 for k in ks], torch.bool, x.device)
    return kth.gather(1, index).squeeze(1).masked_fill(off, float("-inf"))


def top_p_keep(weights: torch.Tensor, ps: list[float]) -> torch.Tensor:
    """weights [B, V] >= 0, a row's probabilities up to a factor -> the same with only the smallest set of the largest
    whose share of the row reaches p left (always at least the largest; ties at the last kept value stay, as
    top_k_mask keeps them), the rest 0."""
    ordered = weights.sort(dim=-1, descending=True).values
    running = row_cumsum(ordered)
    p = to_device(ps, torch.float32, weights.device).unsqueeze(1)
    # (a row with p = 1 keeps all: its share is not the total, which fp32 running sums may reach before the end)
    share = torch.where(p < 1.0, p * running[:, -1:], float("inf"))
    # the weights whose running sum stays below p's share, and the one that reaches it (a prefix: the sums only grow)
    kept = ((running < share).sum(dim=-1, keepdim=True) + 1).clamp_(max=weights.shape[1])
    return weights.masked_fill(weights < ordered.gather(1, kept - 1), 0.0)


def row_cumsum(x: torch.Tensor, chunk: int = 1024) -> torch.Tensor:
    """x.cumsum(-1) of a [B, V] tensor, by chunks of the row and then their totals: torch's scan along a long last
    dimension runs a block per row (81 µs for 8 x 64128 on an H200, against a few for this)."""
    rows, width = x.shape
    padded = torch.nn.functional.pad(x, (0, -width % chunk)).view(rows, -1, chunk)
    within = padded.cumsum(dim=-1)
    # each chunk starts from the running sum of the chunks before it, the very value the last one ended on (no
    # subtraction), so the sums never step back at a chunk's edge
    before = torch.nn.functional.pad(within[:, :-1, -1].cumsum(dim=-1), (1, 0))
    return (within + before.unsqueeze(-1)).view(rows, -1)[:, :width]
