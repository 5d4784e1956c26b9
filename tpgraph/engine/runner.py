"""ModelRunner: owns the KV cache and turns sequences into flat model inputs (prefill and decode)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tpgraph.engine.kv_cache import BlockAllocator, allocate_kv_caches
from tpgraph.engine.sequence import Sequence
from tpgraph.errors import ConfigError
from tpgraph.model.attention import AttentionMetadata
from tpgraph.model.llama import LlamaForCausalLM


@dataclass(frozen=True)
class RunnerConfig:
    block_size: int = 16
    max_batch: int = 8
    max_model_len: int | None = None  # default: min(max_position_embeddings, 4096)
    num_kv_blocks: int | None = None  # default: enough for max_batch sequences of max_model_len
    use_triton: bool | None = None  # default: on GPU

    def __post_init__(self) -> None:
        if self.block_size < 1 or self.block_size & (self.block_size - 1):
            raise ConfigError(f"block_size must be a power of two, got {self.block_size}")
        if self.max_batch < 1:
            raise ConfigError(f"max_batch must be >= 1, got {self.max_batch}")


class ModelRunner:
    def __init__(self, model: LlamaForCausalLM, cfg: RunnerConfig = RunnerConfig()) -> None:
        self.model, self.cfg = model, cfg
        mcfg = model.cfg
        self.device = model.embed_tokens.weight.device
        self.block_size = cfg.block_size
        self.max_model_len = cfg.max_model_len or min(mcfg.max_position_embeddings, 4096)
        if self.max_model_len > mcfg.max_position_embeddings:
            raise ConfigError(
                f"max_model_len {self.max_model_len} exceeds the model's max_position_embeddings "
                f"({mcfg.max_position_embeddings})"
            )
        self.max_blocks_per_seq = -(-self.max_model_len // self.block_size)
        num_blocks = cfg.num_kv_blocks or self.max_blocks_per_seq * cfg.max_batch
        self.allocator = BlockAllocator(num_blocks)
        attn = model.attention_layers()
        self.kv_caches = allocate_kv_caches(len(attn), num_blocks, self.block_size, attn[0].num_kv_heads,
                                            mcfg.head_dim, model.embed_tokens.weight.dtype, self.device)
        for layer, cache in zip(attn, self.kv_caches, strict=True):
            layer.kv_cache = cache
        self.use_triton = self.device.type == "cuda" if cfg.use_triton is None else cfg.use_triton

    # ---- cache bookkeeping -------------------------------------------------------------------
    def reserve(self, seq: Sequence, num_tokens: int) -> None:
        """Make seq's block table large enough for num_tokens tokens."""
        if num_tokens > self.max_model_len:
            raise ConfigError(f"sequence {seq.seq_id} would reach {num_tokens} tokens, over max_model_len "
                              f"{self.max_model_len}")
        seq.block_table.extend(self.allocator.allocate(seq.blocks_needed(self.block_size, num_tokens)))

    def free(self, seq: Sequence) -> None:
        self.allocator.free(seq.block_table)
        seq.block_table = []
        seq.num_cached = 0

    def _slot(self, seq: Sequence, pos: int) -> int:
        return seq.block_table[pos // self.block_size] * self.block_size + pos % self.block_size

    def _block_tables(self, seqs: list[Sequence]) -> torch.Tensor:
        width = max(len(s.block_table) for s in seqs)
        rows = [s.block_table + [0] * (width - len(s.block_table)) for s in seqs]
        return torch.tensor(rows, dtype=torch.int32, device=self.device)

    # ---- forward passes ------------------------------------------------------------------------
    @torch.inference_mode()
    def prefill(self, seqs: list[Sequence]) -> torch.Tensor:
        """Run every token of fresh sequences; return the last token's logits [B, vocab]."""
        ids, positions, slots, lens = [], [], [], []
        for seq in seqs:
            tokens = seq.token_ids
            self.reserve(seq, len(tokens))
            ids.extend(tokens)
            positions.extend(range(len(tokens)))
            slots.extend(self._slot(seq, p) for p in range(len(tokens)))
            lens.append(len(tokens))
        meta = AttentionMetadata(
            is_prefill=True,
            slot_mapping=torch.tensor(slots, dtype=torch.int64, device=self.device),
            seq_lens=torch.tensor(lens, dtype=torch.int32, device=self.device),
            block_tables=self._block_tables(seqs),
            query_lens=tuple(lens),
            use_triton=self.use_triton,
        )
        hidden = self.model(torch.tensor(ids, device=self.device), torch.tensor(positions, device=self.device), meta)
        last = torch.tensor(lens, device=self.device).cumsum(0) - 1
        for seq in seqs:
            seq.num_cached = len(seq)
        return self.model.compute_logits(hidden[last])

    @torch.inference_mode()
    def decode(self, seqs: list[Sequence]) -> torch.Tensor:
        """One new token per sequence (its last token, not yet cached); return logits [B, vocab]."""
        for seq in seqs:
            self.reserve(seq, len(seq))
        positions = [len(s) - 1 for s in seqs]
        meta = AttentionMetadata(
            is_prefill=False,
            slot_mapping=torch.tensor([self._slot(s, p) for s, p in zip(seqs, positions, strict=True)],
                                      dtype=torch.int64, device=self.device),
            seq_lens=torch.tensor([len(s) for s in seqs], dtype=torch.int32, device=self.device),
            block_tables=self._block_tables(seqs),
            use_triton=self.use_triton,
        )
        ids = torch.tensor([s.last_token for s in seqs], device=self.device)  # no list copy per step
        hidden = self.model(ids, torch.tensor(positions, device=self.device), meta)
        for seq in seqs:
            seq.num_cached = len(seq)
        return self.model.compute_logits(hidden)
