"""The tuner's plot: per-op time against size for every candidate, one panel per mode, the chosen bands shaded."""

from __future__ import annotations

from pathlib import Path

ALGOS = ("1shot_push", "1shot_pull", "2shot_pull", "nccl")
COLORS = {"1shot_push": "tab:blue", "1shot_pull": "tab:orange", "2shot_pull": "tab:green", "nccl": "tab:gray"}


def plot_curves(results: list, choices: dict, path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5), sharey=True)
    for ax, mode in zip(axes, ("graph", "eager"), strict=True):
        sizes = sorted({m.nbytes for m in results if m.mode == mode})
        owner = choices[mode].owner
        for i, nbytes in enumerate(sizes):  # shade each size's span by the algorithm the bands give it
            lo = nbytes / 2 ** 0.5 if i == 0 else (sizes[i - 1] * nbytes) ** 0.5
            hi = nbytes * 2 ** 0.5 if i == len(sizes) - 1 else (sizes[i + 1] * nbytes) ** 0.5
            ax.axvspan(lo, hi, color=COLORS[owner[i]], alpha=0.12, lw=0)
        for algo in ALGOS:
            points = sorted((m.nbytes, m.us) for m in results if m.mode == mode and m.algo == algo and m.us)
            if points:
                ax.plot(*zip(*points, strict=True), marker="o", ms=3, color=COLORS[algo], label=algo)
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("message size (bytes)")
        ax.set_title(f"{title}: {mode} (shaded: chosen band)")
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("per-op time, slowest rank (µs)")
    axes[0].legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
