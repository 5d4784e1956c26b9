"""Per-step graph metrics: (phase, mode, unpadded, padded) frequencies, padding cost, and mode downgrades.

Metrics live in a CollectorRegistry owned by (or handed to) this object, never the process-global one, so two
engines in one process (or two tests) never collide.
"""

from __future__ import annotations

from collections import Counter as Tally

from prometheus_client import CollectorRegistry, Counter, Gauge

from tpgraph.errors import ConfigError
from tpgraph.graphs.dispatcher import GraphMode
from tpgraph.graphs.modes import Downgrade


class GraphStats:
    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry if registry is not None else CollectorRegistry()
        labels = ("phase", "mode")
        try:
            self._steps = Counter("tpgraph_graph_steps", "Steps run, by phase and graph mode", labels,
                                  registry=self.registry)
            self._padded = Counter("tpgraph_graph_padded_tokens", "Tokens run including padding", labels,
                                   registry=self.registry)
            self._real = Counter("tpgraph_graph_real_tokens", "Real (unpadded) tokens run", labels,
                                 registry=self.registry)
            self._downgrade = Gauge("tpgraph_graph_mode_downgrade", "1 for each graph mode downgraded at start-up",
                                    ("phase", "requested", "resolved", "reason"), registry=self.registry)
        except ValueError as e:  # prometheus refuses a second metric of the same name
            raise ConfigError(f"this registry already holds tpgraph graph metrics ({e}); give each GraphStats "
                              f"its own registry") from None
        self._table: Tally[tuple[str, str, int, int]] = Tally()
        self._tokens: dict[str, list[int]] = {}  # phase -> [padded, real]
        self._children: dict[tuple[str, str], tuple] = {}  # label lookups cached off the per-step path
        self._downgrades: list[Downgrade] = []

    def record(self, phase: str, unpadded: int, padded: int, mode: GraphMode) -> None:
        if not 1 <= unpadded <= padded:
            raise ConfigError(f"a step needs 1 <= unpadded <= padded, got unpadded={unpadded}, padded={padded}")
        key = (phase, mode.value)
        children = self._children.get(key)
        if children is None:
            children = self._children[key] = tuple(m.labels(*key) for m in (self._steps, self._padded, self._real))
        steps, padded_tokens, real_tokens = children
        steps.inc()
        padded_tokens.inc(padded)
        real_tokens.inc(unpadded)
        self._table[(phase, mode.value, unpadded, padded)] += 1
        totals = self._tokens.setdefault(phase, [0, 0])
        totals[0] += padded
        totals[1] += unpadded

    def record_downgrade(self, phase: str, requested: str, resolved: str, reason: str) -> None:
        self._downgrade.labels(phase, requested, resolved, reason).set(1)
        self._downgrades.append(Downgrade(phase, requested, resolved, reason))

    @property
    def downgrades(self) -> tuple[Downgrade, ...]:
        return tuple(self._downgrades)

    def frequency_table(self) -> list[tuple[str, str, int, int, int]]:
        """(phase, mode, unpadded, padded, count), most frequent first (ties in key order, so output is stable)."""
        rows = [(*key, count) for key, count in self._table.items()]
        return sorted(rows, key=lambda r: (-r[4], r[:4]))

    def padding_ratio(self, phase: str | None = None) -> float:
        """Padded tokens / real tokens - 1 over everything recorded (for `phase`, or all phases); 0.0 if nothing."""
        totals = [t for p, t in self._tokens.items() if phase is None or p == phase]
        real = sum(t[1] for t in totals)
        return sum(t[0] for t in totals) / real - 1.0 if real else 0.0

    def summary(self) -> str:
        rows = self.frequency_table()
        if not rows and not self._downgrades:
            return "graph steps: none recorded"
        header = ("phase", "mode", "unpadded", "padded", "count")
        cells = [header, *((p, m, str(u), str(pd), str(c)) for p, m, u, pd, c in rows)]
        widths = [max(len(r[i]) for r in cells) for i in range(len(header))]
        lines = ["  ".join(c.rjust(w) if i >= 2 else c.ljust(w) for i, (c, w) in enumerate(zip(r, widths, strict=True)))
                 for r in cells]
        lines.insert(1, "  ".join("-" * w for w in widths))
        for phase in sorted(self._tokens):
            lines.append(f"{phase} padding: {self.padding_ratio(phase):.1%} extra tokens")
        lines += [f"downgraded {d.describe()}" for d in self._downgrades]
        return "\n".join(lines)
