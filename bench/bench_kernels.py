"""Every decode kernel against its bandwidth floor, and decode attention against torch SDPA. One GPU.

    python bench/bench_kernels.py --out bench/results/.../kernels.json

Llama-3-8B at TP=2 (per rank: 16 query heads, 4 KV heads of 128, hidden 4096, intermediate 7168), bf16, at the
decode batch sizes `--batches`. For each kernel: the bytes it must move (reads + writes, `moved_bytes`), its floor
(those bytes over the HBM copy bandwidth measured the same way as bench_decode.py), the time by the one timing method
(tpgraph/tune/timing.py: a graph of 64 calls cycling through enough input copies that they cannot sit in L2, the
median of 20 replays after a GPU sleep), and the floor's share of that time. The projections come from
tpgraph/kernels/gemv.py (the shipped tiles) beside cuBLAS; at a batch above the small-M kernels' rows (32, or
TPGRAPH_GEMV_MAX_M) the engine runs cuBLAS, timed alone, and the table and JSON list the Triton rows as not
applicable, as they do a fused kernel that declines a shape. Attention: ours (paged, GQA-grouped, split-KV) against
`F.scaled_dot_product_attention` on a contiguous cache (`enable_gqa`), at contexts `--contexts`.
Writes JSON, a markdown table (`.md`) and a plot (`.png`).
"""

from __future__ import annotations

import argparse
import itertools
import json
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

HIDDEN, INTER, HEADS, KV_HEADS, HEAD_DIM, VOCAB = 4096, 7168, 16, 4, 128, 64128  # per rank at TP=2
BLOCK_SIZE = 16
L2_MULTIPLE = 4  # inputs cycled through at least this many times the L2 size
BF16 = 2
# each projection's weight [N, K] at those shapes
PROJECTION_SHAPES = {"qkv": ((HEADS + 2 * KV_HEADS) * HEAD_DIM, HIDDEN), "o_proj": (HIDDEN, HEADS * HEAD_DIM),
                     "gate_up": (2 * INTER, HIDDEN), "down": (HIDDEN, INTER), "lm_head": (VOCAB, HIDDEN)}


@dataclass
class KernelRow:
    kernel: str
    batch: int
    context: int | None
    moved_bytes: int
    us: float
    floor_us: float

    @property
    def of_floor(self) -> float:
        """The floor's share of the time: 1.0 is a kernel at the bandwidth floor."""
        return self.floor_us / self.us


@dataclass
class NotApplicable:
    """A kernel the engine does not run at this batch (a row left out would read as forgotten): why, and what runs."""
    kernel: str
    batch: int
    why: str


def moved_bytes(kernel: str, m: int, context: int = 0) -> int:
    """Bytes a kernel must read and write at m rows (decode: one token per sequence), bf16 unless said. `kernel` may
    carry an implementation in parentheses ("qkv (Triton)")."""
    q_width, kv_width = HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM
    name = kernel.split(" (")[0]
    if name == "rope_and_store":  # qkv in; q, k out; k, v into the cache; the cos and sin rows (D/2 each)
        return (m * (q_width + 2 * kv_width) + m * (q_width + kv_width) + 2 * m * kv_width + m * HEAD_DIM) * BF16
    elements = {
        "rms_norm": 2 * m * HIDDEN + HIDDEN,  # x in, out; weight
        "add_rms_norm": 4 * m * HIDDEN + HIDDEN,  # x, residual in; out, residual out; weight
        "silu_and_mul": m * 2 * INTER + m * INTER,
        "attention": 2 * m * context * kv_width + 2 * m * q_width,  # K and V of every cached token; q in, out
        "qkv": (q_width + 2 * kv_width) * HIDDEN + m * (HIDDEN + q_width + 2 * kv_width),
        # the same weight and x; q out, k and v into the cache, the cos and sin rows
        "qkv+rope_store": (q_width + 2 * kv_width) * HIDDEN + m * (HIDDEN + q_width + 2 * kv_width + HEAD_DIM),
        "o_proj": HIDDEN * q_width + m * (q_width + HIDDEN),
        "gate_up": 2 * INTER * HIDDEN + m * (HIDDEN + 2 * INTER),
        "gate_up+silu": 2 * INTER * HIDDEN + m * (HIDDEN + INTER),  # the activation out, not gate and up
        "down": HIDDEN * INTER + m * (INTER + HIDDEN),
        "lm_head": VOCAB * HIDDEN + m * (HIDDEN + VOCAB),
    }
    return elements[name] * BF16


def copies_for(nbytes: int, l2: int) -> int:
    """Input copies a graph cycles through so that they cannot sit in L2."""
    return max(1, -(-L2_MULTIPLE * l2 // max(1, nbytes)))


def cycling_graph(fn: Callable[[int], object], copies: int) -> torch.cuda.CUDAGraph:
    """A graph of the timing method's K_OPS calls fn(i), i cycling through the input copies."""
    from tpgraph.tune.timing import K_OPS, capture

    turn = itertools.cycle(range(copies))
    return capture(lambda: fn(next(turn)), K_OPS)


def per_op_us(fn: Callable[[int], object], copies: int) -> float:
    from tpgraph.tune.timing import K_OPS, graph_op_us

    return graph_op_us(None, cycling_graph(fn, copies), K_OPS)


def elementwise_rows(batches: list[int], hbm: float, l2: int, device: torch.device) -> list[KernelRow]:
    from tpgraph.kernels.activation import silu_and_mul
    from tpgraph.kernels.norm import add_rms_norm, rms_norm

    weight = torch.ones(HIDDEN, dtype=torch.bfloat16, device=device)

    def at(m: int) -> list[KernelRow]:  # one batch size (a function: the timed closures bind its inputs)
        rows = []
        n = copies_for(moved_bytes("add_rms_norm", m), l2)
        xs = [torch.randn(m, HIDDEN, dtype=torch.bfloat16, device=device) for _ in range(n)]
        res = [torch.randn(m, HIDDEN, dtype=torch.bfloat16, device=device) for _ in range(n)]
        rows.append(_row("rms_norm", m, None, hbm, per_op_us(lambda i: rms_norm(xs[i], weight, 1e-5), n)))
        rows.append(_row("add_rms_norm", m, None, hbm,
                         per_op_us(lambda i: add_rms_norm(xs[i], res[i], weight, 1e-5), n)))
        n = copies_for(moved_bytes("silu_and_mul", m), l2)
        gu = [torch.randn(m, 2 * INTER, dtype=torch.bfloat16, device=device) for _ in range(n)]
        rows.append(_row("silu_and_mul", m, None, hbm, per_op_us(lambda i: silu_and_mul(gu[i]), n)))
        rows += rope_rows(m, hbm, l2, device)
        return rows

    return [row for m in batches for row in at(m)]


def rope_rows(m: int, hbm: float, l2: int, device: torch.device,
              per_program: tuple[int | None, ...] = (None,)) -> list[KernelRow]:
    """rope_and_store at m tokens, one row per tokens-a-program setting (None: the shipped choice). Prefill sizes
    (--prefill-tokens) compare one token a program, decode's launch, with the token blocks prefill takes."""
    from tpgraph.kernels.rope_store import rope_and_store

    n = copies_for(moved_bytes("rope_and_store", m), l2)
    width = (HEADS + 2 * KV_HEADS) * HEAD_DIM
    qkv = [torch.randn(m, width, dtype=torch.bfloat16, device=device) for _ in range(n)]
    blocks = m * 4 + 1
    kc = torch.zeros(blocks, BLOCK_SIZE, KV_HEADS, HEAD_DIM, dtype=torch.bfloat16, device=device)
    vc = torch.zeros_like(kc)
    cos = torch.rand(4096, HEAD_DIM // 2, device=device).to(torch.bfloat16)  # tables in the model dtype
    sin = torch.rand(4096, HEAD_DIM // 2, device=device).to(torch.bfloat16)
    pos = (torch.arange(m, device=device) + 100) % 4096
    slots = torch.arange(m, device=device) * BLOCK_SIZE
    rows = []
    for tpp in per_program:
        name = "rope_and_store" if tpp is None else f"rope_and_store ({tpp} token{'s' * (tpp > 1)} a program)"
        rows.append(_row(name, m, None, hbm, per_op_us(
            lambda i, tpp=tpp: rope_and_store(qkv[i], pos, (cos, sin), slots, kc, vc, HEADS, KV_HEADS, HEAD_DIM,
                                              tokens_per_program=tpp), n)))
    return rows


def projection_rows(batches: list[int], hbm: float, l2: int,
                    device: torch.device) -> tuple[list[KernelRow], list[NotApplicable]]:
    """Each projection by cuBLAS and by the small-M kernels at each batch, and the fused ones where they apply. Above
    the small-M kernels' rows the engine runs cuBLAS: that row is timed, the Triton ones listed as not applicable (as is
    a fused kernel that declines a shape: decode then runs the two steps)."""
    from tpgraph.kernels.gemv import gate_up_silu, linear_small_m, max_rows, qkv_rope_store

    most = max_rows(2)  # 32 (16 with TPGRAPH_GEMV_MAX_M=16)
    above = f"above the small-M kernels' {most} rows (max_rows, TPGRAPH_GEMV_MAX_M): the engine runs cuBLAS"
    two_steps = "does not apply at this shape and batch: decode runs the two steps"

    rope = (torch.rand(4096, HEAD_DIM // 2, device=device).to(torch.bfloat16),
            torch.rand(4096, HEAD_DIM // 2, device=device).to(torch.bfloat16))
    rope_rows = torch.arange(most, device=device)  # positions and cache slots of the rows
    kc = torch.zeros(most // BLOCK_SIZE + 1, BLOCK_SIZE, KV_HEADS, HEAD_DIM, dtype=torch.bfloat16, device=device)
    vc = torch.zeros_like(kc)
    skipped: list[NotApplicable] = []

    def at(name: str, n: int, k: int) -> list[KernelRow]:  # one shape (the timed closures bind its inputs)
        rows = []
        copies = copies_for(n * k * BF16, l2)
        ws = [torch.randn(n, k, dtype=torch.bfloat16, device=device) * 0.02 for _ in range(copies)]
        fused = {"gate_up": "gate_up+silu (Triton)", "qkv": "qkv+rope_store (Triton)"}.get(name)
        for m in batches:
            x = torch.randn(m, k, dtype=torch.bfloat16, device=device)
            timed = {f"{name} (cuBLAS)": lambda i, x=x: F.linear(x, ws[i])}
            if m > most:
                skipped.extend(NotApplicable(label, m, above) for label in (f"{name} (Triton)", fused) if label)
                rows += [_row(label, m, None, hbm, per_op_us(fn, copies)) for label, fn in timed.items()]
                continue
            timed[f"{name} (Triton)"] = lambda i, x=x: linear_small_m(x, ws[i])
            if name == "gate_up" and gate_up_silu(x, ws[0]) is not None:  # None: these tiles split K, no epilogue
                timed[fused] = lambda i, x=x: gate_up_silu(x, ws[i])
            # (None: where it does not apply, decode runs the two steps; a row then would time a no-op)
            if name == "qkv" and qkv_rope_store(x, ws[0], rope_rows[:m], rope, rope_rows[:m], kc, vc, HEADS, KV_HEADS,
                                                HEAD_DIM) is not None:
                timed[fused] = lambda i, x=x, rows=rope_rows[:m]: qkv_rope_store(
                    x, ws[i], rows, rope, rows, kc, vc, HEADS, KV_HEADS, HEAD_DIM)
            if fused and fused not in timed:
                skipped.append(NotApplicable(fused, m, two_steps))
            rows += [_row(label, m, None, hbm, per_op_us(fn, copies)) for label, fn in timed.items()]
        ws.clear()
        torch.cuda.empty_cache()
        return rows

    rows = [row for name, (n, k) in PROJECTION_SHAPES.items() for row in at(name, n, k)]
    return rows, skipped


def attention_rows(batches: list[int], contexts: list[int], hbm: float, l2: int,
                   device: torch.device) -> list[KernelRow]:
    from tpgraph.kernels.decode_attention import paged_decode_attention_v2

    scale = HEAD_DIM ** -0.5

    def at(m: int, ctx: int) -> list[KernelRow]:  # one batch x context (the timed closures bind its inputs)
        rows = []
        nbytes = moved_bytes("attention", m, ctx)
        copies = copies_for(nbytes, l2)
        if copies * nbytes > 24 << 30:  # the largest batch x context: as many copies as 24 GiB holds
            copies = max(1, (24 << 30) // nbytes)
        per_seq = -(-ctx // BLOCK_SIZE)
        q = torch.randn(m, HEADS, HEAD_DIM, dtype=torch.bfloat16, device=device)
        caches = [(torch.randn(m * per_seq, BLOCK_SIZE, KV_HEADS, HEAD_DIM, dtype=torch.bfloat16, device=device),
                   torch.randn(m * per_seq, BLOCK_SIZE, KV_HEADS, HEAD_DIM, dtype=torch.bfloat16, device=device))
                  for _ in range(copies)]
        tables = torch.arange(m * per_seq, dtype=torch.int32, device=device).view(m, per_seq)
        lens = torch.full((m,), ctx, dtype=torch.int32, device=device)
        ours = per_op_us(lambda i: paged_decode_attention_v2(q, caches[i][0], caches[i][1], tables, lens, scale,
                                                             max_seq_len=ctx), copies)
        rows.append(_row("attention (ours, paged)", m, ctx, hbm, ours, nbytes))
        caches.clear()
        # SDPA on a contiguous cache [B, Hkv, ctx, D], the query group served through enable_gqa
        sq = q.unsqueeze(2)  # [B, Hq, 1, D]
        contiguous = [(torch.randn(m, KV_HEADS, ctx, HEAD_DIM, dtype=torch.bfloat16, device=device),
                       torch.randn(m, KV_HEADS, ctx, HEAD_DIM, dtype=torch.bfloat16, device=device))
                      for _ in range(copies)]
        sdpa = per_op_us(lambda i: F.scaled_dot_product_attention(sq, contiguous[i][0], contiguous[i][1],
                                                                  scale=scale, enable_gqa=True), copies)
        rows.append(_row("attention (SDPA, contiguous)", m, ctx, hbm, sdpa, nbytes))
        contiguous.clear()
        torch.cuda.empty_cache()
        return rows

    return [row for m, ctx in itertools.product(batches, contexts) for row in at(m, ctx)]


def _row(kernel: str, m: int, context: int | None, hbm: float, us: float, nbytes: int | None = None) -> KernelRow:
    nbytes = moved_bytes(kernel, m, context or 0) if nbytes is None else nbytes
    return KernelRow(kernel, m, context, nbytes, us, nbytes / hbm * 1e6)


def table(rows: list[KernelRow], hbm: float, skipped: Sequence[NotApplicable] = ()) -> str:
    """The markdown table: a row per timed kernel, then one per kernel not applicable at its batch, saying why."""
    lines = [f"HBM copy bandwidth {hbm / 1e12:.2f} TB/s; floor = bytes moved / that bandwidth", "",
             "| kernel | batch | context | bytes moved | µs | floor µs | floor ÷ time |",
             "|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r.kernel} | {r.batch} | {r.context or ''} | {r.moved_bytes:,} | {r.us:.2f} | "
                     f"{r.floor_us:.2f} | {r.of_floor:.0%} |")
    for s in skipped:
        lines.append(f"| {s.kernel} | {s.batch} |  |  | not applicable: {s.why} |  |  |")
    return "\n".join(lines)


def plot(rows: list[KernelRow], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (bars, attn) = plt.subplots(1, 2, figsize=(14, 0.28 * len(rows) + 2))
    flat = [r for r in rows if r.context is None]
    labels = [f"{r.kernel}, M={r.batch}" for r in flat]
    bars.barh(range(len(flat)), [r.of_floor for r in flat], color="tab:blue")
    bars.set_yticks(range(len(flat)), labels, fontsize=7)
    bars.axvline(0.88, color="gray", ls="--", lw=0.8)
    bars.set(xlabel="bandwidth floor ÷ measured time", title="kernels against their floor (M: rows or tokens)")
    bars.invert_yaxis()
    for kernel in sorted({r.kernel for r in rows if r.context is not None}):
        for m in sorted({r.batch for r in rows if r.kernel == kernel}):
            pts = sorted((r.context, r.us) for r in rows if r.kernel == kernel and r.batch == m)
            attn.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=f"{kernel}, batch {m}")
    attn.set(xscale="log", yscale="log", xlabel="context (tokens)", ylabel="µs per call", title="decode attention")
    attn.legend(fontsize=7)
    attn.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def whole_numbers(flag: str, text: str, empty_ok: bool = False) -> list[int]:
    """'1,8' -> [1, 8]; anything but positive whole numbers (or, where `empty_ok`, nothing) refused by name."""
    try:
        values = [int(v) for v in text.split(",")] if text else []
    except ValueError:
        raise SystemExit(f"{flag}: comma-separated whole numbers, got {text!r}") from None
    if (not values and not empty_ok) or any(v < 1 for v in values):
        raise SystemExit(f"{flag}: each must be >= 1, got {text!r}")
    return values


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The arguments, every one checked before the GPU work (a bad one surfaced as a traceback, some after minutes
    of timing), with --out's folder created."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, default=Path("kernels.json"))
    p.add_argument("--batches", default="1,8")
    p.add_argument("--contexts", default="512,4096,32768")
    p.add_argument("--prefill-tokens", default="256,1024,8192",
                   help="token counts at which rope_and_store runs one token a program and 16 (empty: none)")
    args = p.parse_args(argv)
    args.batches = whole_numbers("--batches", args.batches)
    args.contexts = whole_numbers("--contexts", args.contexts)
    args.prefill_tokens = whole_numbers("--prefill-tokens", args.prefill_tokens, empty_ok=True)
    if args.out.suffix in (".md", ".png"):
        p.error(f"--out {args.out}: the table and the plot are written beside the JSON as .md and .png, which would "
                f"overwrite it")
    try:
        args.out.resolve().parent.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        p.error(f"--out {args.out}: cannot create its folder ({e.strerror})")
    return args


def main() -> None:
    args = parse_args()
    from bench_decode import hbm_bandwidth  # bench/ is on the path when this script runs

    device = torch.device("cuda")
    hbm = hbm_bandwidth(device)
    l2 = torch.cuda.get_device_properties(device).L2_cache_size
    batches, contexts = args.batches, args.contexts
    rows = elementwise_rows(batches, hbm, l2, device)
    projections, skipped = projection_rows(batches, hbm, l2, device)
    rows += projections
    rows += attention_rows(batches, contexts, hbm, l2, device)
    for m in args.prefill_tokens:
        rows += rope_rows(m, hbm, l2, device, per_program=(1, 16))
    text = table(rows, hbm, skipped)
    print(text, flush=True)
    args.out.write_text(json.dumps({"gpu": torch.cuda.get_device_name(), "hbm_bytes_per_s": hbm,
                                    "rows": [asdict(r) | {"of_floor": r.of_floor} for r in rows],
                                    "not_applicable": [asdict(s) for s in skipped]}, indent=1))
    args.out.with_suffix(".md").write_text(text + "\n")
    try:
        plot(rows, args.out.with_suffix(".png"))
    except ImportError:  # the JSON and the table are written: no traceback for the plot alone
        print("matplotlib missing: no plot (pip install -e '.[bench]')")


if __name__ == "__main__":
    main()
