"""Tensor-parallel building blocks. None of them communicates: callers pass partial outputs to the
TPCommunicator explicitly, so every cross-rank byte is visible in llama.py."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from tpgraph.kernels import gemv
from tpgraph.kernels.activation import silu_and_mul
from tpgraph.kernels.embedding import vocab_shard_embedding
from tpgraph.kernels.lamport import PendingProjection, ReducedNorm, materialized
from tpgraph.kernels.norm import add_rms_norm, rms_norm
from tpgraph.model.shards import ShardSpec, even_split, whole


def _param(*shape: int, dtype: torch.dtype, device: torch.device) -> nn.Parameter:
    return nn.Parameter(torch.zeros(*shape, dtype=dtype, device=device), requires_grad=False)


def _project(x: torch.Tensor, weight: torch.Tensor, small_m: bool, out: torch.Tensor | None = None,
             bias: torch.Tensor | None = None) -> torch.Tensor:
    """x @ weight.T (+ bias; into `out` where given): the small-M kernel when it is on (the default; TPGRAPH_GEMV=0
    turns it off) and applies (decode rows on an sm_80+ GPU), else cuBLAS."""
    if small_m:
        return gemv.linear_small_m(x, weight, out=out, bias=bias)
    return gemv.dense_linear(x, weight, out, bias)


def _bias_name(weight_name: str) -> str:
    return weight_name.removesuffix("weight") + "bias"


class ColumnParallelLinear(nn.Module):
    """y_local = x @ W_local^T, W split along output rows. Fused layers stack several checkpoint
    tensors (parts) along the output dim; each part is (hf_name, hf_rows, src_start, local_rows)."""

    def __init__(self, input_size: int, parts: list[tuple[str, int, int, int]], dtype: torch.dtype,
                 device: torch.device, bias: bool = False) -> None:
        super().__init__()
        self.parts = parts
        self.output_sizes = [local for _, _, _, local in parts]
        self.weight = _param(sum(self.output_sizes), input_size, dtype=dtype, device=device)
        # each part's bias rows split as its weight rows are
        self.bias = _param(sum(self.output_sizes), dtype=dtype, device=device) if bias else None
        self.small_m = gemv.enabled()

    def forward(self, x: torch.Tensor | ReducedNorm) -> torch.Tensor:
        """x may be what a fused all-reduce left (ReducedNorm): its normalised input is made first (rms_norm)."""
        return _project(materialized(x), self.weight, self.small_m, bias=self.bias)

    def forward_silu_and_mul(self, x: torch.Tensor | ReducedNorm) -> torch.Tensor:
        """silu_and_mul(forward(x)) for a cat(gate, up) weight. With the small-M kernel on, one launch whose epilogue
        makes the activation (same bits), where it applies, and which takes a fused all-reduce's ReducedNorm as its
        staged input and RMS scale (within bf16 rounding); else the two steps."""
        if len(self.output_sizes) != 2 or self.output_sizes[0] != self.output_sizes[1]:
            raise ValueError(f"silu_and_mul needs two equal parts (gate, up), this layer has {self.output_sizes}")
        # (the fused kernel has no bias: a biased gate_up takes the two steps)
        fused = gemv.gate_up_silu(x, self.weight) if self.small_m and self.bias is None else None
        return fused if fused is not None else silu_and_mul(self.forward(x))

    def shard_specs(self) -> list[ShardSpec]:
        specs, dst = [], 0
        for hf_name, hf_rows, src_start, local in self.parts:
            specs.append(ShardSpec(self.weight, hf_name, (hf_rows, self.weight.shape[1]), 0, src_start, local, dst))
            if self.bias is not None:
                specs.append(ShardSpec(self.bias, _bias_name(hf_name), (hf_rows,), 0, src_start, local, dst))
            dst += local
        return specs


class RowParallelLinear(nn.Module):
    """Partial y = x_local @ W_local^T, W split along input columns. The caller all-reduces."""

    def __init__(self, input_size: int, output_size: int, hf_name: str, tp_rank: int, tp_size: int,
                 dtype: torch.dtype, device: torch.device, bias: bool = False) -> None:
        super().__init__()
        self.hf_name, self.input_size = hf_name, input_size
        self.src_start, local = even_split(input_size, tp_rank, tp_size)
        self.weight = _param(output_size, local, dtype=dtype, device=device)
        # the whole bias on every rank; rank 0 adds it to its partial sums, so the all-reduce's sum holds it once
        self.bias = _param(output_size, dtype=dtype, device=device) if bias else None
        self.adds_bias = bias and tp_rank == 0
        self.small_m = gemv.enabled()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """This rank's partial sums."""
        return _project(x, self.weight, self.small_m, bias=self.bias if self.adds_bias else None)

    def pending(self, x: torch.Tensor) -> PendingProjection:
        """This projection of x, left for the all-reduce after it to run (with the all-reduce in its epilogue where
        it can: TPCommunicator.all_reduce_add_rmsnorm)."""
        return PendingProjection(x, self)

    def shard_specs(self) -> list[ShardSpec]:
        shape = (self.weight.shape[0], self.input_size)
        specs = [ShardSpec(self.weight, self.hf_name, shape, 1, self.src_start, self.weight.shape[1])]
        return specs if self.bias is None else specs + [whole(self.bias, _bias_name(self.hf_name))]


class VocabShard:
    """The vocabulary padded up to a multiple of TP and cut into equal per-rank ranges."""

    def __init__(self, vocab_size: int, tp_rank: int, tp_size: int) -> None:
        self.vocab_size = vocab_size
        self.padded_size = -(-vocab_size // tp_size) * tp_size
        self.per_rank = self.padded_size // tp_size
        self.start = tp_rank * self.per_rank
        self.end = self.start + self.per_rank
        self.real_rows = max(0, min(self.end, vocab_size) - self.start)  # the rest are padding rows


class VocabParallelEmbedding(nn.Module):
    """Each rank holds a vocab range; ids outside it contribute zeros. The caller all-reduces."""

    def __init__(self, vocab_size: int, hidden_size: int, hf_name: str, tp_rank: int, tp_size: int,
                 dtype: torch.dtype, device: torch.device) -> None:
        super().__init__()
        self.hf_name, self.hidden_size = hf_name, hidden_size
        self.shard = VocabShard(vocab_size, tp_rank, tp_size)
        self.tp_size = tp_size
        self.weight = _param(self.shard.per_rank, hidden_size, dtype=dtype, device=device)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.tp_size == 1:
            return F.embedding(input_ids, self.weight)
        # the range mask and the lookup in one kernel on GPUs (the torch sequence is about seven small kernels)
        return vocab_shard_embedding(input_ids, self.weight, self.shard.start)

    def shard_specs(self) -> list[ShardSpec]:
        if self.shard.real_rows == 0:
            return []
        shape = (self.shard.vocab_size, self.hidden_size)
        return [ShardSpec(self.weight, self.hf_name, shape, 0, self.shard.start, self.shard.real_rows)]


class ParallelLMHead(nn.Module):
    """Logits for this rank's vocab range (padding rows are zero and sliced off after the gather)."""

    def __init__(self, embedding: VocabParallelEmbedding, hf_name: str | None, dtype: torch.dtype,
                 device: torch.device) -> None:
        super().__init__()
        self.shard = embedding.shard
        if hf_name is None:  # tied: share the embedding's storage, load nothing
            self.weight = embedding.weight
            self.hf_name = None
        else:
            self.weight = _param(*embedding.weight.shape, dtype=dtype, device=device)
            self.hf_name = hf_name
        self.small_m = gemv.enabled()

    def forward(self, hidden: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        return _project(hidden, self.weight, self.small_m, out)

    def shard_specs(self) -> list[ShardSpec]:
        if self.hf_name is None or self.shard.real_rows == 0:
            return []
        shape = (self.shard.vocab_size, self.weight.shape[1])
        return [ShardSpec(self.weight, self.hf_name, shape, 0, self.shard.start, self.shard.real_rows)]


class RMSNorm(nn.Module):
    """Replicated. Normalises in fp32 and casts back before the weight, as HF Llama does."""

    def __init__(self, hidden_size: int, eps: float, hf_name: str, dtype: torch.dtype,
                 device: torch.device) -> None:
        super().__init__()
        self.eps, self.hf_name = eps, hf_name
        self.weight = nn.Parameter(torch.ones(hidden_size, dtype=dtype, device=device), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps)

    def add(self, x: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(norm(x + residual), x + residual) in one kernel: the residual add HF does before this norm."""
        return add_rms_norm(x, residual, self.weight, self.eps)

    def shard_specs(self) -> list[ShardSpec]:
        return [whole(self.weight, self.hf_name)]
