"""The all-reduce fused into the projections around it (kernels/lamport.py), with ranks emulated in one process: every
rank's row-parallel projection pushes, then every rank's next projection receives. On CPU under Triton's
interpreter; the same tests run on one GPU (the `gpu` variants), where the kernels are compiled for real."""

import os

import pytest
import torch
import torch.nn.functional as F
from tpgtest.lamport_emul import control_view, emulated_channels, slots_view
from tpgtest.ptx import gemv_signature, sm90_ptx

from tpgraph.kernels.activation import silu_and_mul
from tpgraph.kernels.gemv import GemvConfig, gate_up_silu, linear_push, linear_small_m, qkv_rope_store
from tpgraph.kernels.lamport import reduced_norm
from tpgraph.kernels.norm import add_rms_norm
from tpgraph.kernels.rope_store import rope_and_store, rope_cos_sin_table

triton = pytest.importorskip("triton")
interpreted = pytest.mark.skipif(torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1",
                                 reason="CPU-tensor kernel tests need TRITON_INTERPRET=1")
DEVICES = [pytest.param("cpu", marks=interpreted), pytest.param("cuda", marks=pytest.mark.gpu)]
EPS = 1e-5
HEADS, KV_HEADS, DIM, BLOCK_SIZE = 2, 1, 32, 4
HIDDEN, KIN, INTER = 128, 96, 64


class Ranks:
    """Per-rank weights of one layer boundary chain, and the unfused sequence to compare with."""

    def __init__(self, world_size: int, device: str, dtype: torch.dtype, seed: int = 0) -> None:
        g = torch.Generator().manual_seed(seed)

        def rnd(*shape, scale=0.1):
            return (torch.randn(*shape, generator=g) * scale).to(dtype).to(device)

        self.ws, self.device, self.dtype = world_size, device, dtype
        self.channels = emulated_channels(world_size, 16 * HIDDEN, device)
        self.w_row = [rnd(HIDDEN, KIN) for _ in range(world_size)]  # o_proj / down: [hidden, K_local]
        self.w_gate_up = [rnd(2 * INTER, HIDDEN) for _ in range(world_size)]
        self.w_qkv = [rnd((HEADS + 2 * KV_HEADS) * DIM, HIDDEN) for _ in range(world_size)]
        self.norm_w = (1 + rnd(HIDDEN)).contiguous()
        self.rnd = rnd
        self.rope = rope_cos_sin_table(1.0 / (10000 ** (torch.arange(0, DIM, 2).float() / DIM)), 64, dtype, device)

    def reduced(self, xs, cfg):
        """The unfused reference: each rank's partial (the same kernel and tiles), summed in rank order and
        rounded as 1shot_push does."""
        parts = [linear_small_m(x, w, use_triton=True, config=cfg) for x, w in zip(xs, self.w_row, strict=True)]
        total = parts[0].float()
        for p in parts[1:]:
            total += p.float()
        return total.to(self.dtype)


def assert_next_phase_armed(ranks: Ranks) -> None:
    """After a receive, the phase the next push writes holds only the sentinel in every rank's region (its rows were
    re-armed one boundary after their receive): no stale data can pass for a peer's."""
    for ch in ranks.channels:
        nxt = int(control_view(ch)[0])
        bits = slots_view(ch)[nxt].view(torch.int16)
        assert (bits == -32768).all(), f"rank {ch.rank}: phase {nxt} holds {(bits != -32768).sum()} stale elements"


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("world_size", [2, 3])
def test_pushes_and_receives_match_the_unfused_sequence_across_phases(device, world_size):
    """Seven boundaries (more than the 3 phases, rows changing so that re-arming must follow the rows used), each
    received by one of the three receivers: the gate_up projection, the qkv + rope projection, and the stand-alone
    receive + norm. The new residual is the unfused one bit for bit, identical on every rank; the stand-alone norm is
    the unfused add + RMSNorm kernel's bits; the projections are within bf16 rounding of the unfused sequence."""
    dtype = torch.bfloat16
    ranks = Ranks(world_size, device, dtype, seed=world_size)
    row_cfg = GemvConfig(16, 32, 4, 2, 1)
    rows_each = [3, 1, 5, 2, 16, 4, 1]
    receivers = ["gate_up", "qkv", "norm", "gate_up", "qkv", "norm", "qkv"]
    for step, (rows, receiver) in enumerate(zip(rows_each, receivers, strict=True)):
        xs = [ranks.rnd(rows, KIN, scale=1.0) for _ in range(world_size)]
        residual = ranks.rnd(rows, HIDDEN, scale=1.0)
        cfg = row_cfg if step % 2 else GemvConfig(16, 32, 4, 2, 2)  # split-K pushers reduce in their last split
        pushed = [linear_push(x, w, ch, use_triton=True, config=cfg)
                  for x, w, ch in zip(xs, ranks.w_row, ranks.channels, strict=True)]
        assert all(p is not None for p in pushed)
        normed, new_residual = add_rms_norm(ranks.reduced(xs, cfg), residual, ranks.norm_w, EPS, use_triton=True)
        for r in range(world_size):
            got = reduced_norm(pushed[r], residual, ranks.norm_w, EPS)
            if receiver == "norm":
                assert torch.equal(got.materialize(), normed)
            elif receiver == "gate_up":
                y = gate_up_silu(got, ranks.w_gate_up[r], use_triton=True, config=GemvConfig(32, 32, 4, 2, 1))
                ref = silu_and_mul(F.linear(normed.float(), ranks.w_gate_up[r].float()).to(dtype))
                torch.testing.assert_close(y, ref, rtol=2e-2, atol=2e-2)
            else:
                slots = torch.arange(rows, device=device) * 2 + 1
                positions = torch.arange(rows, device=device) + step
                caches = [torch.zeros(16, BLOCK_SIZE, KV_HEADS, DIM, dtype=dtype, device=device) for _ in range(4)]
                q = qkv_rope_store(got, ranks.w_qkv[r], positions, ranks.rope, slots, caches[0], caches[1], HEADS,
                                   KV_HEADS, DIM, use_triton=True, config=GemvConfig(16, 32, 4, 2, 3))
                qkv = F.linear(normed.float(), ranks.w_qkv[r].float()).to(dtype)
                rq, _ = rope_and_store(qkv, positions, ranks.rope, slots, caches[2], caches[3], HEADS, KV_HEADS, DIM,
                                       use_triton=True)
                torch.testing.assert_close(q, rq, rtol=2e-2, atol=2e-2)
                torch.testing.assert_close(caches[0], caches[2], rtol=2e-2, atol=2e-2)
                torch.testing.assert_close(caches[1], caches[3], rtol=2e-2, atol=2e-2)
            assert got.taken
            assert torch.equal(got.residual_out, new_residual), f"step {step} rank {r}"
        assert_next_phase_armed(ranks)


@interpreted
def test_a_push_is_received_once():
    ranks = Ranks(2, "cpu", torch.bfloat16)
    xs = [ranks.rnd(2, KIN) for _ in range(2)]
    pushed = [linear_push(x, w, ch, use_triton=True, config=GemvConfig(16, 32, 4, 2, 1))
              for x, w, ch in zip(xs, ranks.w_row, ranks.channels, strict=True)]
    got = reduced_norm(pushed[0], ranks.rnd(2, HIDDEN), ranks.norm_w, EPS)
    got.materialize()
    with pytest.raises(RuntimeError, match="received twice"):
        got.materialize()
    with pytest.raises(ValueError, match="does not match"):
        reduced_norm(pushed[1], ranks.rnd(3, HIDDEN), ranks.norm_w, EPS)


@interpreted
def test_the_push_declines_what_the_channel_cannot_carry(monkeypatch):
    ranks = Ranks(2, "cpu", torch.bfloat16)
    ch, w = ranks.channels[0], ranks.w_row[0]
    x = ranks.rnd(17, KIN)
    assert linear_push(x, w, ch, use_triton=True) is None  # over the small-M kernel's 16 rows
    assert linear_push(x[:2].float(), w.float(), ch, use_triton=True) is None  # 16-bit slots only
    assert linear_push(x[:2], w, ch, use_triton=False) is None  # no Triton asked for
    small = emulated_channels(2, HIDDEN, "cpu")[0]
    assert linear_push(x[:2], w, small, use_triton=True) is None  # two rows do not fit a one-row slot
    monkeypatch.setenv("TPGRAPH_LAST_SPLIT_REDUCES", "0")  # split-K would need its second kernel to push
    assert linear_push(x[:2], w, ch, use_triton=True, config=GemvConfig(16, 32, 4, 2, 2)) is None
    assert not control_view(ch).any()  # nothing launched


GEMV_FLAGS = {"BLOCK_M": 16, "BLOCK_N": 32, "BLOCK_K": 128, "SOFT_BF16": False, "IEEE": False, "EXACT": True,
              "PDL": True, "PREFETCH_TILES": 2, "LINE": 64, "WS": 2, "RANK": 1, "PIECES": 8}


def test_the_pushing_projection_compiles_for_sm90_and_pushes_after_its_wait():
    """Ahead of time, without a GPU: the pushes and the re-arming stores come after griddepcontrol.wait (the
    receivers before them are done), the phase is read past L1, and the last split pushes what it reduced."""
    ptx = sm90_ptx("tpgraph.kernels.gemv", "_gemv_kernel", gemv_signature("bf16", "fp32"), [],
                   {**GEMV_FLAGS, "GATE_UP": False, "LAST_REDUCES": True, "SPLIT": True, "RECV": False,
                    "PUSH": True})
    wait = ptx.index("griddepcontrol.wait")
    assert "ld.volatile.global" in ptx and wait < ptx.index("ld.volatile.global")
    assert wait < ptx.index("st.global")
    assert "atom.global.gpu.acq_rel.add" in ptx


def test_the_receiving_gate_up_compiles_for_sm90_and_polls_after_its_wait():
    """The receive reads its phase with a volatile load and polls its slots with ld.global.cv (never a stale cached
    line), all after the PDL wait; the weight prefetches come before it."""
    ptx = sm90_ptx("tpgraph.kernels.gemv", "_gemv_kernel", gemv_signature("bf16", "bf16"), [],
                   {**GEMV_FLAGS, "GATE_UP": True, "LAST_REDUCES": False, "SPLIT": False, "RECV": True,
                    "PUSH": False})
    wait = ptx.index("griddepcontrol.wait")
    assert wait < ptx.index("ld.volatile.global") < ptx.index("ld.global.cv")
    assert ptx.rindex("prefetch.global.L2") < wait
