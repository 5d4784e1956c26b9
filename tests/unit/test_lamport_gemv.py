"""The all-reduce fused into the row-parallel projection's epilogue (kernels/lamport.py), with ranks emulated in one
process, on CPU (Triton's interpreter) and on one GPU. The ranks run one after another: a rank's data that a lower rank
would wait for is written into that rank's slots beforehand, as the later rank's push would land there. (Concurrent
ranks on one GPU, one stream each, deadlock on the first launch: loading a kernel's module waits for the kernels
running, and the first rank's kernel waits for the second's. Two GPUs run them for real: tests/gpu.)"""

import os
import re

import pytest
import torch
import torch.nn.functional as F
from tpgtest.lamport_emul import phases_view, slots_view
from tpgtest.markers import interpreted
from tpgtest.polled import spy_polled_rope
from tpgtest.ptx import gemv_signature, sm90_ptx

from tpgraph.errors import ConfigError
from tpgraph.kernels.activation import silu_and_mul
from tpgraph.kernels.gemv import GemvConfig, gate_up_silu, linear_all_reduce_norm, linear_small_m, qkv_rope_store
from tpgraph.kernels.lamport import EPILOGUE_ALGO, GRANULE, epilogue_enabled, local_channels, solo_channel
from tpgraph.kernels.norm import add_rms_norm
from tpgraph.kernels.rope_store import rope_and_store, rope_cos_sin_table

triton = pytest.importorskip("triton")
DEVICES = [pytest.param("cpu", marks=interpreted), pytest.param("cuda", marks=pytest.mark.gpu)]
EPS = 1e-5


@pytest.fixture(autouse=True)
def _default_rows(monkeypatch):
    """Every test starts from 16 rows (TPGRAPH_GEMV_MAX_M=16); the wide tests set 32 themselves."""
    monkeypatch.setenv("TPGRAPH_GEMV_MAX_M", "16")
HEADS, KV_HEADS, DIM, BLOCK_SIZE = 2, 1, 32, 4
HIDDEN, KIN, INTER = 128, 96, 64


class Ranks:
    """Per-rank weights around one layer boundary, and their channels."""

    def __init__(self, world_size: int, device: str, dtype: torch.dtype, seed: int = 0) -> None:
        g = torch.Generator().manual_seed(seed)

        def rnd(*shape, scale=0.1):
            return (torch.randn(*shape, generator=g) * scale).to(dtype).to(device)

        self.ws, self.device, self.dtype, self.rnd = world_size, device, dtype, rnd
        # one rank: the solo channel (the epilogue adds the residual and stages the norm, nothing to exchange)
        self.channels = [solo_channel(device)] if world_size == 1 else local_channels(world_size, 32 * HIDDEN,
                                                                                       device)
        self.w_row = [rnd(HIDDEN, KIN) for _ in range(world_size)]  # o_proj / down: [hidden, K_local]
        self.w_gate_up = [rnd(2 * INTER, HIDDEN) for _ in range(world_size)]
        self.w_qkv = [rnd((HEADS + 2 * KV_HEADS) * DIM, HIDDEN) for _ in range(world_size)]
        self.norm_w = (1 + rnd(HIDDEN)).contiguous()
        self.rope = rope_cos_sin_table(1.0 / (10000 ** (torch.arange(0, DIM, 2).float() / DIM)), 64, dtype, device)

    def partials(self, xs, cfg):
        """Each rank's partial sums, as its projection computes them (the same kernel and tiles)."""
        return [linear_small_m(x, w, use_triton=True, config=cfg) for x, w in zip(xs, self.w_row, strict=True)]

    def boundary(self, xs, residual, cfg, residual_early=False):
        """Every rank's projection with the all-reduce in its epilogue -> each rank's ReducedNorm. residual_early:
        the residual was written before xs (the caller's promise; the kernel then reads it before its PDL wait)."""
        run = [lambda r=r: linear_all_reduce_norm(xs[r], self.w_row[r], self.channels[r], residual, self.norm_w,
                                                  EPS, residual_early=residual_early, use_triton=True, config=cfg)
               for r in range(self.ws)]
        if self.ws == 1:
            return [run[0]()]
        # one at a time: the later ranks' tiles are put where their pushes would land, and the pushes that then land
        # in an earlier rank's region (already read) are re-armed, as that rank's reader would have
        rows = xs[0].shape[0]
        parts = self.partials(xs, cfg)
        phase = int(phases_view(self.channels[0])[0])
        out = []
        for r in range(self.ws):
            for q in range(r + 1, self.ws):
                data = parts[q].clone()
                data[data.view(torch.int16) == -32768] = 0  # -0.0 travels as +0.0
                slots_view(self.channels[r], self.dtype)[phase, q, : rows * HIDDEN] = data.flatten()
            out.append(run[r]())
        for r in range(self.ws):
            for q in range(r):  # rank r's real push into rank q's region: its tile as rank q would have read it
                landed = slots_view(self.channels[q], self.dtype)[phase, r, : rows * HIDDEN]
                sent = parts[r].clone()
                sent[sent.view(torch.int16) == -32768] = 0
                assert torch.equal(landed.view(torch.int16), sent.flatten().view(torch.int16)), (r, q)
                landed.view(torch.int16).fill_(-32768)
        return out


def assert_armed_and_advanced(ranks: Ranks, boundaries: int) -> None:
    """Every slot of every phase holds the sentinel again (each reader re-armed what it read), and every granule of
    the hidden columns has advanced once per boundary (a solo channel has neither)."""
    if ranks.ws == 1:
        return
    for ch in ranks.channels:
        bits = slots_view(ch, ranks.dtype).view(torch.int16)
        assert (bits == -32768).all(), f"rank {ch.rank}: {(bits != -32768).sum()} elements not re-armed"
        assert (phases_view(ch)[: HIDDEN // GRANULE] == boundaries % 3).all()


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("world_size", [1, 2, 3])
def test_the_fused_all_reduce_matches_the_unfused_sequence_across_phases(monkeypatch, device, world_size):
    """With the count (TPGRAPH_POLLED_PARTIALS=0; polling, the default, below): eight boundaries (more than the 3
    phases; rows changing), split-K and not, each taken by one of the three consumers: the gate_up projection, the
    qkv + rope projection (the last with Qwen3's per-head norms), and the plain norm (materialize), every other one
    with the residual read before the PDL wait (written before the inputs, as in the model). The new residual is the
    unfused one bit for bit on every rank, the materialized norm is the unfused add + RMSNorm's bits, and the
    projections are within bf16 rounding of the unfused sequence."""
    monkeypatch.setenv("TPGRAPH_POLLED_PARTIALS", "0")
    check_boundaries(Ranks(world_size, device, torch.bfloat16, seed=world_size), device, [3, 1, 5, 2, 16, 4, 1, 3],
                     ["gate_up", "qkv", "norm", "gate_up", "qkv", "norm", "qkv", "qkv_normed"])


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("world_size", [1, 2])
@pytest.mark.parametrize("polled", ["0", "1"])
def test_paired_qkv_tiles_take_the_staged_input(monkeypatch, device, world_size, polled):
    """TPGRAPH_QKV_PAIRED=1 (each column block rotates its own rows), counted or polled: the qkv + rope boundaries
    scale the staged input's sums by the rows' 1 / RMS as the head reducers do, within bf16 rounding of the unfused
    sequence, and the new residual and the materialized norm bit for bit."""
    monkeypatch.setenv("TPGRAPH_QKV_PAIRED", "1")
    monkeypatch.setenv("TPGRAPH_POLLED_PARTIALS", polled)
    check_boundaries(Ranks(world_size, device, torch.bfloat16, seed=21 + world_size), device, [3, 1, 16, 2],
                     ["qkv", "norm", "qkv", "qkv"])


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("world_size", [1, 2])
@pytest.mark.parametrize("rope", ["0", "1"])
def test_the_fused_all_reduce_with_polled_partials_matches_the_unfused_sequence(monkeypatch, device, world_size, rope):
    """As above with polled partials (the default): the split-K boundaries reduce by polling the sentinel buffer (the
    same bits as the count), and every partial slot is back at the sentinel after each; rope: the qkv + rope
    kernel's heads polled too (TPGRAPH_POLLED_ROPE)."""
    from tpgraph.kernels import gemv
    from tpgraph.kernels._counters import PARTIAL_SENTINEL, partials_buffer

    monkeypatch.delenv("TPGRAPH_POLLED_PARTIALS", raising=False)
    monkeypatch.setenv("TPGRAPH_POLLED_ROPE", rope)
    rope_polled = spy_polled_rope(monkeypatch)
    taken, real = [], gemv.partials_buffer

    def spy(dev, n):
        buf = real(dev, n)
        taken.extend([n] if buf is not None else [])
        return buf

    monkeypatch.setattr(gemv, "partials_buffer", spy)
    check_boundaries(Ranks(world_size, device, torch.bfloat16, seed=11 + world_size), device, [3, 1, 5, 2],
                     ["gate_up", "qkv", "norm", "qkv"])
    # equal bits alone would not show that anything polled: the split-K projections did, and (rope) both qkv + rope
    # boundaries, at 1 and 2 rows
    assert len(taken) > len(rope_polled) and len(rope_polled) == (2 * world_size if rope == "1" else 0)
    assert (partials_buffer(torch.device(device), 1).view(torch.int32) == PARTIAL_SENTINEL).all()


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("world_size", [1, 2])
def test_the_fused_all_reduce_takes_17_to_32_rows_with_the_wide_setting(monkeypatch, device, world_size):
    """TPGRAPH_GEMV_MAX_M=32: 24, 32 and 17 rows through the epilogue in 32-row tiles (squares [tiles, 32]), each
    consumer once, as above; a row over 32 is declined."""
    monkeypatch.setenv("TPGRAPH_GEMV_MAX_M", "32")
    ranks = Ranks(world_size, device, torch.bfloat16, seed=7 + world_size)
    check_boundaries(ranks, device, [24, 32, 17, 3], ["qkv", "gate_up", "norm", "qkv"])
    x, res = ranks.rnd(33, KIN), ranks.rnd(33, HIDDEN)  # over the small-M kernels' 32 rows
    assert linear_all_reduce_norm(x, ranks.w_row[0], ranks.channels[0], res, ranks.norm_w, EPS,
                                  use_triton=True) is None


def check_boundaries(ranks: Ranks, device: str, rows_each: list[int], consumers: list[str]) -> None:
    """One layer boundary per entry (rows, consumer), phases rotating, the tiles rotating (split-K, resident: at one
    row, and at several its whole-K tile run plain; plain), the residual read early on every other one: see the test
    above."""
    dtype, world_size = ranks.dtype, ranks.ws
    for step, (rows, consumer) in enumerate(zip(rows_each, consumers, strict=True)):
        residual = ranks.rnd(rows, HIDDEN, scale=1.0)  # before xs: the early read's promise
        xs = [ranks.rnd(rows, KIN, scale=1.0) for _ in range(world_size)]
        # split-K (the last split sums), a program's whole K as one tile loaded before the wait (resident), plain
        cfg = (GemvConfig(32, 32, 4, 2, 2), GemvConfig(16, 128, 4, 1, 1, True), GemvConfig(16, 32, 4, 2, 1))[step % 3]
        parts = ranks.partials(xs, cfg)
        total = parts[0].float()
        for p in parts[1:]:
            total += p.float()
        normed, new_residual = add_rms_norm(total.to(dtype), residual, ranks.norm_w, EPS, use_triton=True)
        reduced = ranks.boundary(xs, residual, cfg, residual_early=step % 2 == 0)
        for r, got in enumerate(reduced):
            assert got is not None
            assert torch.equal(got.residual_out, new_residual), f"step {step} rank {r}"
            if consumer == "norm":
                assert torch.equal(got.materialize(), normed)
            elif consumer == "gate_up":
                y = gate_up_silu(got, ranks.w_gate_up[r], use_triton=True, config=GemvConfig(32, 32, 4, 2, 1))
                ref = silu_and_mul(F.linear(normed.float(), ranks.w_gate_up[r].float()).to(dtype))
                torch.testing.assert_close(y, ref, rtol=2e-2, atol=2e-2)
            else:
                slots = torch.arange(rows, device=device) * 2 + 1
                positions = torch.arange(rows, device=device) + step
                caches = [torch.zeros(16, BLOCK_SIZE, KV_HEADS, DIM, dtype=dtype, device=device) for _ in range(4)]
                head_norm = (torch.linspace(0.5, 1.5, DIM, device=device).to(dtype),
                             torch.linspace(1.5, 0.5, DIM, device=device).to(dtype), EPS)
                head_norm = head_norm if consumer == "qkv_normed" else None
                q = qkv_rope_store(got, ranks.w_qkv[r], positions, ranks.rope, slots, caches[0], caches[1], HEADS,
                                   KV_HEADS, DIM, use_triton=True, config=GemvConfig(16, 32, 4, 2, 3),
                                   head_norm=head_norm)
                qkv = F.linear(normed.float(), ranks.w_qkv[r].float()).to(dtype)
                rq, _ = rope_and_store(qkv, positions, ranks.rope, slots, caches[2], caches[3], HEADS, KV_HEADS, DIM,
                                       use_triton=True, head_norm=head_norm)
                torch.testing.assert_close(q, rq, rtol=2e-2, atol=2e-2)
                torch.testing.assert_close(caches[0], caches[2], rtol=2e-2, atol=2e-2)
                torch.testing.assert_close(caches[1], caches[3], rtol=2e-2, atol=2e-2)
        assert_armed_and_advanced(ranks, step + 1)


@interpreted
def test_the_fused_all_reduce_declines_what_the_channel_cannot_carry(monkeypatch):
    ranks = Ranks(2, "cpu", torch.bfloat16)
    ch, w, nw = ranks.channels[0], ranks.w_row[0], ranks.norm_w
    x, res = ranks.rnd(17, KIN), ranks.rnd(17, HIDDEN)
    assert linear_all_reduce_norm(x, w, ch, res, nw, EPS, use_triton=True) is None  # over 16 rows
    assert linear_all_reduce_norm(x[:2].float(), w.float(), ch, res[:2].float(), nw.float(), EPS,
                                  use_triton=True) is None  # bf16 slots only
    half = [t.half() for t in (x[:2], w, res[:2], nw)]
    assert linear_all_reduce_norm(*half[:2], ch, *half[2:], EPS, use_triton=True) is None  # fp16 could overflow
    assert linear_all_reduce_norm(x[:2], w, ch, res[:2], nw, EPS, use_triton=False) is None  # no Triton asked for
    assert linear_all_reduce_norm(x[:2], w, ch, res[:3], nw, EPS, use_triton=True) is None  # residual of other rows
    small = local_channels(2, HIDDEN, "cpu")[0]
    assert linear_all_reduce_norm(x[:2], w, small, res[:2], nw, EPS, use_triton=True) is None  # 2 rows > a 1-row slot
    monkeypatch.setenv("TPGRAPH_LAST_SPLIT_REDUCES", "0")  # split-K would reduce in a second kernel
    assert linear_all_reduce_norm(x[:2], w, ch, res[:2], nw, EPS, use_triton=True,
                                  config=GemvConfig(16, 32, 4, 2, 2)) is None
    assert not phases_view(ch).any()  # nothing launched


def test_a_residual_that_must_be_copied_is_not_read_before_the_wait(monkeypatch):
    """residual_early reads the residual before the PDL wait; a strided one is first copied by a kernel launched just
    before ours, which those reads would run ahead of: early only where no copy was made."""
    from tpgraph.kernels import gemv

    ranks = Ranks(1, "cpu", torch.bfloat16)
    x, res = ranks.rnd(2, KIN), ranks.rnd(2, 2 * HIDDEN)
    seen = []
    monkeypatch.setattr(gemv, "_launch", lambda *a, residual_early=False, **kw: seen.append(residual_early))
    for residual in (res[:, :HIDDEN].contiguous(), res[:, ::2]):
        linear_all_reduce_norm(x, ranks.w_row[0], ranks.channels[0], residual, ranks.norm_w, EPS, residual_early=True,
                               use_triton=True)
    assert seen == [True, False]


GEMV_FLAGS = {"BLOCK_M": 16, "BLOCK_N": 32, "BLOCK_K": 128, "SOFT_BF16": False, "IEEE": False, "EXACT": True,
              "PDL": True, "PREFETCH_TILES": 2, "LINE": 64, "WS": 2, "RANK": 1, "PIECES": 8, "EARLY_TRIGGER": True,
              "RES_EARLY": False, "RESIDENT": False, "POLLED": False}


@pytest.mark.parametrize("block_m", [16, 32])
def test_the_all_reducing_projection_compiles_for_sm90_with_its_polls_after_the_wait(block_m):
    """Ahead of time, without a GPU: the phases are read and the peers' tiles polled past L1 (ld.volatile.global,
    which every Triton emits for volatile loads; for `.cv` torch 2.11's Triton 3.6 emitted no ld.global.cv), after
    griddepcontrol.wait (the kernels before touched them last); the last split (after its arrival count) pushes what
    it reduced, then polls. 32: TPGRAPH_GEMV_MAX_M=32's row tile."""
    ptx = sm90_ptx("tpgraph.kernels.gemv", "_gemv_kernel", gemv_signature("bf16", "fp32"), [],
                   {**GEMV_FLAGS, "BLOCK_M": block_m, "GATE_UP": False, "LAST_REDUCES": True, "SPLITS": 2,
                    "ALL_REDUCE": True, "STAGED": False})
    wait = ptx.index("griddepcontrol.wait")
    assert "ld.volatile.global" in ptx and wait < ptx.index("ld.volatile.global")
    assert "ld.global.cv" not in ptx
    atom = ptx.index("atom.global.gpu.acq_rel.add")
    push = ptx.index("st.global", atom)  # after the arrival count: the push, then the polls of the peers' tiles
    assert "ld.volatile.global" in ptx[push:]
    assert "trap;" in ptx and "%globaltimer" in ptx  # a peer that never pushes ends the context instead of hanging it
    assert_no_grid_wide_wait(ptx)


@pytest.mark.parametrize("early", [True, False])
def test_the_all_reducing_projection_lets_the_next_kernel_in_after_its_loop_or_at_exit(early):
    """EARLY_TRIGGER: griddepcontrol.launch_dependents after the K loop's last mma and before the epilogue's stores;
    without it (TPGRAPH_GEMV_AR_LATE_TRIGGER=1) none at all, so the kernel after becomes resident at this one's exit."""
    ptx = sm90_ptx("tpgraph.kernels.gemv", "_gemv_kernel", gemv_signature("bf16", "bf16"), [],
                   {**GEMV_FLAGS, "WS": 1, "RANK": 0, "GATE_UP": False, "LAST_REDUCES": False, "SPLITS": 1,
                    "ALL_REDUCE": True, "STAGED": False, "EARLY_TRIGGER": early})
    assert ("griddepcontrol.launch_dependents" in ptx) == early
    if early:
        trigger = ptx.index("griddepcontrol.launch_dependents")
        assert ptx.rindex("mma.sync") < trigger < ptx.index("st.global")


@pytest.mark.parametrize("early", [True, False])
def test_an_early_residual_is_loaded_before_the_wait_and_its_layout_change_with_it(early):
    """RES_EARLY (the model's residual, written two launches back): the residual tile's load and its shared-memory
    layout change (st.shared, bar.sync, ld.shared) come before griddepcontrol.wait, so that after the wait the first
    memory instructions are the K loop's loads; without it they follow the wait and hold those loads back. Both
    bypass L1 (.cg)."""
    ptx = sm90_ptx("tpgraph.kernels.gemv", "_gemv_kernel", gemv_signature("bf16", "bf16"), [],
                   {**GEMV_FLAGS, "WS": 1, "RANK": 0, "GATE_UP": False, "LAST_REDUCES": False, "SPLITS": 1,
                    "ALL_REDUCE": True, "STAGED": False, "RES_EARLY": early}, num_stages=5)
    wait = ptx.index("griddepcontrol.wait")
    first_cg = ptx.index("ld.global.cg")
    assert (first_cg < wait) == early
    after = ptx[wait:]
    first_loop_load = re.search(r"ld\.global\.(b|v)|cp\.async", after).start()  # x or the weights
    if early:
        assert "st.shared" in ptx[first_cg:wait] and "bar.sync" in ptx[first_cg:wait]
        assert "ld.global.cg" not in after[:first_loop_load] and "st.shared" not in after[:first_loop_load]
    else:
        assert "st.shared" in after[:first_loop_load]  # the residual's layout change, before any loop load


def assert_no_grid_wide_wait(ptx: str) -> None:
    """The only waits are on peers' data (no other program of the kernel is waited for): no acquire loads, and the
    only atomics are the last split's arrival count, its reset, and the timeout record's claim (system scope, before
    the trap, after a fence that lets the record reach host memory)."""
    assert "ld.acquire" not in ptx
    atoms = re.findall(r"\batom\.[a-z0-9.]+", ptx)
    claims = [a for a in atoms if ".sys." in a and "cas" in a]
    assert len(atoms) == 3 and len(claims) == 1, atoms
    assert ptx.count("trap;") == 1 and "fence.sc.sys; trap;" in ptx


def test_the_staged_gate_up_compiles_for_sm90_as_a_plain_projection():
    """The projection after a fused all-reduce has the plain K loop (its x loads pipelined as cp.async like the
    weight's) and no polls at all: it only scales its sums."""
    ptx = sm90_ptx("tpgraph.kernels.gemv", "_gemv_kernel", gemv_signature("bf16", "bf16"), [],
                   {**GEMV_FLAGS, "GATE_UP": True, "LAST_REDUCES": False, "SPLITS": 1, "ALL_REDUCE": False,
                    "STAGED": True})
    assert "ld.global.cv" not in ptx and "ld.volatile" not in ptx
    assert ptx.rindex("prefetch.global.L2") < ptx.index("griddepcontrol.wait")


def interpreted_o_proj(monkeypatch, ranks: Ranks):
    """Rank 0's o_proj (RowParallelLinear holding ranks.w_row[0], small-M kernel on), with the projection kernels
    routed through Triton's interpreter at one fixed config -> (layer, config)."""
    from tpgraph.kernels import gemv
    from tpgraph.model.layers import RowParallelLinear

    layer = RowParallelLinear(ranks.ws * KIN, HIDDEN, "o_proj", 0, ranks.ws, torch.bfloat16, torch.device("cpu"))
    layer.weight.data.copy_(ranks.w_row[0])
    layer.small_m = True
    cfg = GemvConfig(16, 32, 4, 2, 1)
    monkeypatch.setattr(gemv, "config_for", lambda *a: cfg)
    monkeypatch.setattr(gemv, "_device_takes", lambda *a: True)
    monkeypatch.setattr(gemv, "linear_small_m",
                        lambda x, w, out=None, bias=None: linear_small_m(x, w, use_triton=True, config=cfg, out=out,
                                                                          bias=bias))
    monkeypatch.setattr(gemv, "linear_all_reduce_norm",
                        lambda *a, **kw: linear_all_reduce_norm(*a, **kw, use_triton=True, config=cfg))
    return layer, cfg


@interpreted
def test_the_communicator_runs_a_pending_projection_fused_where_the_channel_takes_it(monkeypatch):
    """all_reduce_add_rmsnorm on a row-parallel projection left pending: decode rows go through the channel (a
    ReducedNorm whose new residual is the unfused one); rows the channel cannot carry run the projection, then the
    all-reduce and the add + RMSNorm kernel."""
    from tpgraph.comm.communicator import TPCommunicator
    from tpgraph.distributed import ParallelState
    from tpgraph.kernels.lamport import PendingProjection, ReducedNorm

    ranks = Ranks(2, "cpu", torch.bfloat16, seed=5)
    layer, cfg = interpreted_o_proj(monkeypatch, ranks)

    class Custom:  # the custom all-reduce as rank 0 of two, whose peer always holds the same partial sums
        def push_channel(self, residual):
            ch = ranks.channels[0]
            return ch if ch.takes(residual) else None

        def try_all_reduce_add_rmsnorm(self, x, residual, weight, eps):
            return None

        def try_all_reduce(self, x):
            return (x.float() * 2).to(x.dtype)

    comm = TPCommunicator(ParallelState(0, 2, 0, torch.device("cpu"), None, None), use_custom_allreduce=False)
    comm.custom = Custom()
    for rows in (3, 20):
        x = ranks.rnd(rows, KIN, scale=1.0)
        residual = ranks.rnd(rows, HIDDEN, scale=1.0)
        partial = linear_small_m(x, layer.weight, use_triton=True, config=cfg)
        normed, new_residual = add_rms_norm((partial.float() * 2).to(torch.bfloat16), residual, ranks.norm_w, EPS,
                                            use_triton=True)
        if rows <= 16:  # the peer's tile, where its push would land
            data = partial.clone()
            data[data.view(torch.int16) == -32768] = 0
            phase = int(phases_view(ranks.channels[0])[0])
            slots_view(ranks.channels[0])[phase, 1, : rows * HIDDEN] = data.flatten()
        out, res = comm.all_reduce_add_rmsnorm(PendingProjection(x, layer), residual, ranks.norm_w, EPS)
        assert isinstance(out, ReducedNorm) == (rows <= 16)
        assert torch.equal(res, new_residual)
        if rows <= 16:
            assert torch.equal(out.materialize(), normed)


def test_the_epilogue_is_on_at_tp1_opt_in_above_and_refuses_a_bad_setting(monkeypatch):
    monkeypatch.delenv("TPGRAPH_GEMV_ALLREDUCE", raising=False)
    assert epilogue_enabled(1) and not epilogue_enabled(2) and not epilogue_enabled(8)
    monkeypatch.setenv("TPGRAPH_GEMV_ALLREDUCE", "0")
    assert not epilogue_enabled(1) and not epilogue_enabled(2)
    monkeypatch.setenv("TPGRAPH_GEMV_ALLREDUCE", "1")
    assert epilogue_enabled(1) and epilogue_enabled(2)
    monkeypatch.setenv("TPGRAPH_GEMV_ALLREDUCE", "yes")
    with pytest.raises(ConfigError, match="TPGRAPH_GEMV_ALLREDUCE must be 0 or 1"):
        epilogue_enabled(1)


@interpreted
def test_one_rank_runs_a_pending_projection_with_the_add_and_norm_in_its_epilogue(monkeypatch):
    """TP=1: all_reduce_add_rmsnorm on a pending o_proj / down gives a ReducedNorm from the solo channel (the new
    residual is the unfused add's bits, the materialized norm the add + RMSNorm kernel's); rows over 16 (over 32
    with TPGRAPH_GEMV_MAX_M=32), fp32, the fused norm turned off, or TPGRAPH_GEMV_ALLREDUCE=0 run the projection and
    the add + RMSNorm kernel (unset: the epilogue, the TP=1 default)."""
    from tpgraph.comm.communicator import TPCommunicator
    from tpgraph.comm.custom_ar import CustomAllReduceConfig
    from tpgraph.distributed import ParallelState
    from tpgraph.kernels.lamport import PendingProjection, ReducedNorm

    monkeypatch.setenv("TPGRAPH_GEMV_ALLREDUCE", "1")
    ranks = Ranks(1, "cpu", torch.bfloat16, seed=9)
    layer, cfg = interpreted_o_proj(monkeypatch, ranks)
    state = ParallelState(0, 1, 0, torch.device("cpu"), None, None)
    comm = TPCommunicator(state, use_custom_allreduce=False)
    unfused = TPCommunicator(state, use_custom_allreduce=False, custom_config=CustomAllReduceConfig(fused_norm=False))
    assert comm.solo is not None and unfused.solo is None

    def boundary(c, rows, dtype=torch.bfloat16):
        residual = ranks.rnd(rows, HIDDEN, scale=1.0).to(dtype)  # before x, as the model writes them
        x = ranks.rnd(rows, KIN, scale=1.0).to(dtype)
        layer.weight.data = ranks.w_row[0].to(dtype)
        normed, new_residual = add_rms_norm(linear_small_m(x, layer.weight, use_triton=True, config=cfg), residual,
                                            ranks.norm_w.to(dtype), EPS, use_triton=True)
        out, res = c.all_reduce_add_rmsnorm(PendingProjection(x, layer), residual, ranks.norm_w.to(dtype), EPS)
        assert torch.equal(res, new_residual)
        assert torch.equal(out.materialize() if isinstance(out, ReducedNorm) else out, normed)
        return isinstance(out, ReducedNorm)

    assert boundary(comm, 1) and boundary(comm, 16)
    assert not boundary(comm, 17)  # prefill rows: the projection, then the add + RMSNorm kernel
    assert not boundary(comm, 2, torch.float32)  # bf16 only
    assert not boundary(unfused, 2)
    monkeypatch.setenv("TPGRAPH_GEMV_ALLREDUCE", "0")  # turned off
    assert not boundary(comm, 2)
    monkeypatch.delenv("TPGRAPH_GEMV_ALLREDUCE")  # on by default at TP=1
    assert boundary(comm, 2)
    monkeypatch.setenv("TPGRAPH_GEMV_MAX_M", "32")  # 17-32 rows through the small-M kernels, the epilogue too
    assert boundary(comm, 24) and not boundary(comm, 33)


TRAP_SCRIPT = """
import dataclasses, json, torch
from tpgraph.kernels.gemv import GemvConfig, linear_all_reduce_norm
from tpgraph.kernels.lamport import local_channels, timeout_record
channels = local_channels(2, 16 * 128, "cuda")
rank0 = dataclasses.replace(channels[0], timeout_ns=50_000_000)  # rank 1 never pushes: 50 ms, then the trap
x, w = torch.randn(2, 96, device="cuda").bfloat16(), torch.randn(128, 96, device="cuda").bfloat16()
res, nw = torch.randn(2, 128, device="cuda").bfloat16(), torch.ones(128, device="cuda").bfloat16()
try:
    linear_all_reduce_norm(x, w, rank0, res, nw, 1e-5, use_triton=True, config=GemvConfig(32, 32, 4, 2, 1))
    torch.cuda.synchronize()
    print("no trap")
except RuntimeError:
    print("record", json.dumps(timeout_record(channels[0])))
"""


@pytest.mark.gpu
def test_a_peer_that_never_pushes_traps_and_is_named_in_the_record():
    """Rank 0 of two emulated ranks, whose peer never pushes: the kernel traps after its timeout, and the record
    (host memory, read after the trap) names rank 0, the epilogue's algorithm, peer 1 and one of its 4 tiles."""
    import json
    import subprocess
    import sys

    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    run = subprocess.run([sys.executable, "-c", TRAP_SCRIPT], capture_output=True, text=True, timeout=240,
                         env={**os.environ, "TRITON_INTERPRET": "0"})
    line = next((ln for ln in run.stdout.splitlines() if ln.startswith(("record", "no trap"))), run.stderr[-2000:])
    assert line.startswith("record {"), line
    record = json.loads(line.removeprefix("record "))
    assert record["fired"] == 1 and record["rank"] == 0 and record["algo"] == EPILOGUE_ALGO and record["peer"] == 1
    assert 0 <= record["tile"] < 4


def test_local_channels_end_with_their_timeout_record():
    """addrs: every rank's region, then the record's address (none off the GPU: the interpreter never traps)."""
    channels = local_channels(2, 16 * HIDDEN, "cpu")
    assert channels[0].addrs.shape == (3,) and int(channels[0].addrs[2]) == 0
    assert solo_channel("cpu").addrs.shape == (2,)


@interpreted
def test_the_late_trigger_setting_reaches_only_all_reducing_launches(monkeypatch):
    """TPGRAPH_GEMV_AR_LATE_TRIGGER=1: the projection with the epilogue launches with EARLY_TRIGGER off; a plain
    projection keeps it on; a bad value is refused by name."""
    from tpgraph.kernels import gemv

    launched = []

    class Recorder:  # stands in for the kernel: records each launch's EARLY_TRIGGER
        def __getitem__(self, grid):
            return lambda *args, **kw: launched.append(kw["EARLY_TRIGGER"])

    monkeypatch.setattr(gemv, "_gemv_kernel", Recorder())
    ranks = Ranks(1, "cpu", torch.bfloat16)
    x, res = ranks.rnd(2, KIN), ranks.rnd(2, HIDDEN)
    cfg = GemvConfig(16, 32, 4, 2, 1)
    for late in ("0", "1"):
        monkeypatch.setenv("TPGRAPH_GEMV_AR_LATE_TRIGGER", late)
        linear_small_m(x, ranks.w_row[0], use_triton=True, config=cfg)
        linear_all_reduce_norm(x, ranks.w_row[0], ranks.channels[0], res, ranks.norm_w, EPS, use_triton=True,
                               config=cfg)
    assert launched == [True, True, True, False]
    monkeypatch.setenv("TPGRAPH_GEMV_AR_LATE_TRIGGER", "on")
    with pytest.raises(ConfigError, match="TPGRAPH_GEMV_AR_LATE_TRIGGER must be 0 or 1"):
        linear_all_reduce_norm(x, ranks.w_row[0], ranks.channels[0], res, ranks.norm_w, EPS, use_triton=True,
                               config=cfg)
