"""Tensor-parallel Llama (2, 3, 3.1, 3.2). Every all-reduce and all-gather is called here, in plain sight."""

from __future__ import annotations

import torch
from torch import nn

from tpgraph.comm import TPCommunicator
from tpgraph.config import ModelConfig
from tpgraph.kernels import gemv
from tpgraph.kernels._counters import last_split_reduces
from tpgraph.kernels.activation import silu_and_mul
from tpgraph.kernels.lamport import PendingProjection, ReducedNorm, materialized
from tpgraph.kernels.rope_store import HeadNorm, rope_and_store
from tpgraph.model.attention import AttentionMetadata, KVCache
from tpgraph.model.layers import (
    ColumnParallelLinear,
    ParallelLMHead,
    RMSNorm,
    RowParallelLinear,
    VocabParallelEmbedding,
)
from tpgraph.model.rotary import RotaryEmbedding
from tpgraph.model.shards import ShardSpec, even_split


def kv_head_split(num_kv_heads: int, tp_rank: int, tp_size: int) -> tuple[int, int]:
    """(first kv head, local kv heads): split when kv >= tp, else each rank keeps one replicated head."""
    if num_kv_heads >= tp_size:
        return even_split(num_kv_heads, tp_rank, tp_size)
    return tp_rank // (tp_size // num_kv_heads), 1


class LlamaAttention(nn.Module):
    def __init__(self, cfg: ModelConfig, prefix: str, comm: TPCommunicator, dtype: torch.dtype,
                 device: torch.device) -> None:
        super().__init__()
        rank, tp = comm.rank, comm.world_size
        self.comm = comm
        self.head_dim = cfg.head_dim
        self.num_heads = cfg.num_attention_heads // tp
        kv_start, self.num_kv_heads = kv_head_split(cfg.num_key_value_heads, rank, tp)
        d = cfg.head_dim
        self.qkv_proj = ColumnParallelLinear(cfg.hidden_size, [
            (f"{prefix}.q_proj.weight", cfg.q_size, rank * self.num_heads * d, self.num_heads * d),
            (f"{prefix}.k_proj.weight", cfg.kv_size, kv_start * d, self.num_kv_heads * d),
            (f"{prefix}.v_proj.weight", cfg.kv_size, kv_start * d, self.num_kv_heads * d),
        ], dtype, device, bias=cfg.qkv_bias)
        self.o_proj = RowParallelLinear(cfg.q_size, cfg.hidden_size, f"{prefix}.o_proj.weight", rank, tp, dtype,
                                        device, bias=cfg.o_proj_bias)
        # Qwen3's norms over each head of q and k (replicated: [head_dim] each)
        self.q_norm, self.k_norm = (RMSNorm(d, cfg.rms_norm_eps, f"{prefix}.{name}.weight", dtype, device)
                                    for name in ("q_norm", "k_norm")) if cfg.qk_norm else (None, None)
        self.scale = d ** -0.5
        self.kv_cache: KVCache | None = None  # bound by the runner once the cache is sized
        self.fused_qkv_rope = True  # with the small-M kernel and last-split reductions; +unfused turns it off

    def head_norm(self) -> HeadNorm | None:
        """Qwen3's norms over each head of q and k, as the rotation kernels apply them after the projection and before
        the rotation (None without them)."""
        return None if self.q_norm is None else (self.q_norm.weight, self.k_norm.weight, self.q_norm.eps)

    def forward(self, positions: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], x: torch.Tensor | ReducedNorm,
                meta: AttentionMetadata) -> PendingProjection:
        """x: the normalised input, or what a fused all-reduce left for it (ReducedNorm). Returns o_proj of the
        attention output, for the caller's all-reduce to run (this rank's partial sums)."""
        cache = self.kv_cache
        if cache is None:
            raise RuntimeError("attention layer has no KV cache bound; allocate it through the runner")
        if not meta.is_prefill and self.fused_qkv_rope and self.qkv_proj.small_m and last_split_reduces():
            # decode rows: the projection, rope and the cache writes in one kernel (None: it does not apply here)
            # (positions and slots are the step's metadata, copied in before its first kernel: settled early)
            q = gemv.qkv_rope_store(x, self.qkv_proj.weight, positions, rope, meta.slot_mapping, cache.k, cache.v,
                                    self.num_heads, self.num_kv_heads, self.head_dim,
                                    inputs_early=gemv.rope_inputs_early(), bias=self.qkv_proj.bias,
                                    head_norm=self.head_norm())
            if q is not None:
                out = meta.boundary(meta.backend.decode, q, cache, meta, self.scale)
                return self.o_proj.pending(out.view(out.shape[0], -1))
        qkv = self.qkv_proj(x)
        # one kernel: (Qwen3: norm q's and k's heads,) rotate q and k, write k and v into the paged cache
        q, k = rope_and_store(qkv, positions, rope, meta.slot_mapping, cache.k, cache.v, self.num_heads,
                              self.num_kv_heads, self.head_dim, head_norm=self.head_norm())
        # the attention core is where piecewise capture splits its graphs (meta.boundary)
        if meta.is_prefill:
            v = qkv[:, -self.num_kv_heads * self.head_dim:].view(-1, self.num_kv_heads, self.head_dim)
            out = meta.boundary(meta.backend.prefill, q, k, v, cache, meta, self.scale)
        else:
            out = meta.boundary(meta.backend.decode, q, cache, meta, self.scale)
        return self.o_proj.pending(out.view(out.shape[0], -1))  # this rank's partial sums: the caller all-reduces


class LlamaMLP(nn.Module):
    def __init__(self, cfg: ModelConfig, prefix: str, comm: TPCommunicator, dtype: torch.dtype,
                 device: torch.device) -> None:
        super().__init__()
        rank, tp = comm.rank, comm.world_size
        self.comm = comm
        start, local = even_split(cfg.intermediate_size, rank, tp)
        self.gate_up_proj = ColumnParallelLinear(cfg.hidden_size, [
            (f"{prefix}.gate_proj.weight", cfg.intermediate_size, start, local),
            (f"{prefix}.up_proj.weight", cfg.intermediate_size, start, local),
        ], dtype, device, bias=cfg.mlp_bias)
        self.down_proj = RowParallelLinear(cfg.intermediate_size, cfg.hidden_size, f"{prefix}.down_proj.weight",
                                           rank, tp, dtype, device, bias=cfg.mlp_bias)
        # SiLU·mul made in the gate_up projection's epilogue where the small-M kernel runs (the same bits, one launch
        # and one [M, 2 * inter] round trip fewer); bench_decode's +unfused turns it off to time the two kernels
        self.fused_activation = True

    def forward(self, x: torch.Tensor | ReducedNorm) -> PendingProjection:
        # the down projection of this rank, for the caller's all-reduce to run
        if self.fused_activation:
            return self.down_proj.pending(self.gate_up_proj.forward_silu_and_mul(x))
        return self.down_proj.pending(silu_and_mul(self.gate_up_proj(x)))


class LlamaDecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, index: int, comm: TPCommunicator, dtype: torch.dtype,
                 device: torch.device) -> None:
        super().__init__()
        prefix = f"model.layers.{index}"
        eps, hidden = cfg.rms_norm_eps, cfg.hidden_size
        self.comm = comm
        self.input_layernorm = RMSNorm(hidden, eps, f"{prefix}.input_layernorm.weight", dtype, device)
        self.self_attn = LlamaAttention(cfg, f"{prefix}.self_attn", comm, dtype, device)
        self.post_attention_layernorm = RMSNorm(hidden, eps, f"{prefix}.post_attention_layernorm.weight", dtype,
                                                device)
        self.mlp = LlamaMLP(cfg, f"{prefix}.mlp", comm, dtype, device)

    def forward(self, positions: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], x: torch.Tensor | ReducedNorm,
                residual: torch.Tensor, meta: AttentionMetadata) -> tuple[PendingProjection, torch.Tensor]:
        """x: this layer's normalised input (or what a fused all-reduce left for it); residual: the stream so far.
        Returns (the MLP's down projection, still to run, the residual stream): the caller all-reduces it together
        with the next norm."""
        partial = self.self_attn(positions, rope, x, meta)
        norm = self.post_attention_layernorm
        # o_proj, the all-reduce, the residual add and the norm after it: at decode rows, o_proj with the all-reduce
        # in its epilogue and the norm staged for gate_up (kernels/lamport.py); else o_proj, then one kernel where
        # the custom all-reduce fuses the rest, or the all-reduce and then the add+RMSNorm kernel
        x, residual = self.comm.all_reduce_add_rmsnorm(partial, residual, norm.weight, norm.eps)
        return self.mlp(x), residual


class LlamaForCausalLM(nn.Module):
    def __init__(self, cfg: ModelConfig, comm: TPCommunicator, dtype: torch.dtype, device: torch.device,
                 max_positions: int | None = None) -> None:
        """max_positions: the rope tables' rows (default the model's context); the runner sizes them to its
        max_model_len."""
        super().__init__()
        cfg.check_tp(comm.world_size)
        self.cfg, self.comm = cfg, comm
        self.embed_tokens = VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size, "model.embed_tokens.weight",
                                                   comm.rank, comm.world_size, dtype, device)
        self.layers = nn.ModuleList(LlamaDecoderLayer(cfg, i, comm, dtype, device)
                                    for i in range(cfg.num_hidden_layers))
        self.rotary = RotaryEmbedding(cfg.head_dim, cfg.rope, max_positions or cfg.max_context, dtype, device)
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, "model.norm.weight", dtype, device)
        lm_head_name = None if cfg.tie_word_embeddings else "lm_head.weight"
        self.lm_head = ParallelLMHead(self.embed_tokens, lm_head_name, dtype, device)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """Flat tokens [T] -> final hidden states [T, hidden] (after the last norm)."""
        residual = self.comm.all_reduce(self.embed_tokens(input_ids))
        x = self.layers[0].input_layernorm(residual)
        norms = [layer.input_layernorm for layer in self.layers[1:]] + [self.norm]
        for layer, norm in zip(self.layers, norms, strict=True):
            partial, residual = layer(positions, self.rotary.tables, x, residual, meta)
            x, residual = self.comm.all_reduce_add_rmsnorm(partial, residual, norm.weight, norm.eps)
        return materialized(x)  # after a fused last all-reduce: the final norm, from its new residual (rms_norm)

    def compute_logits(self, hidden: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """[N, hidden] -> [N, vocab_size] on every rank; the vocab padding is cut off. `out` ([>= N, padded vocab]),
        if given, receives the logits (a persistent buffer that CUDA graphs write into)."""
        return self.gather_logits(self.shard_logits(hidden), out)

    def shard_logits(self, hidden: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """[N, hidden] -> [N, padded vocab / world]: this rank's vocabulary shard of the logits (no collective), into
        `out` ([>= N, padded vocab / world], contiguous) where given."""
        return self.lm_head(hidden, None if out is None else out[: len(hidden)])

    def gather_logits(self, shard: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """Every rank's shard_logits -> [N, vocab_size] on every rank (into `out`, [>= N, padded vocab], if given)."""
        logits = self.comm.all_gather(shard, dim=-1, out=None if out is None else out[: len(shard)])
        return logits[..., : self.cfg.vocab_size]

    @property
    def padded_vocab_size(self) -> int:
        return self.lm_head.shard.padded_size

    def shard_specs(self) -> list[ShardSpec]:
        specs: list[ShardSpec] = []
        for module in self.modules():
            if hasattr(module, "shard_specs") and module is not self:
                specs.extend(module.shard_specs())
        return specs

    def attention_layers(self) -> list[LlamaAttention]:
        return [layer.self_attn for layer in self.layers]
