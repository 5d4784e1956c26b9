"""Per-step graph metrics: (phase, mode, unpadded, padded) frequencies, padding cost, and mode downgrades.

Metrics live in a CollectorRegistry owned by (or handed to) this object, never the process-global one, so two
engines in one process (or two tests) never collide.
"""

from __future__ import annotations

from collections import Counter as Tally
from collections.abc import Iterator

from prometheus_client import CollectorRegistry
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from tpgraph.errors import ConfigError
from tpgraph.graphs.dispatcher import GraphMode
from tpgraph.graphs.modes import Downgrade


class GraphStats:
    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry if registry is not None else CollectorRegistry()
        self._table: Tally[tuple[str, str, int, int]] = Tally()
        self._by_mode: dict[tuple[str, str], list[int]] = {}  # (phase, mode) -> [steps, padded tokens, real tokens]
        self._downgrades: list[Downgrade] = []
        try:
            self.registry.register(_GraphMetrics(self))
        except ValueError as e:  # prometheus refuses a second metric of the same name
            raise ConfigError(f"this registry already holds tpgraph graph metrics ({e}); give each GraphStats "
                              f"its own registry") from None

    def record(self, phase: str, unpadded: int, padded: int, mode: GraphMode) -> None:
        """One step. On the decode path: a few dict updates; Prometheus reads the totals when it scrapes."""
        if not 1 <= unpadded <= padded:
            raise ConfigError(f"a step needs 1 <= unpadded <= padded, got unpadded={unpadded}, padded={padded}")
        key = (phase, mode.value)
        totals = self._by_mode.get(key)
        if totals is None:
            totals = self._by_mode[key] = [0, 0, 0]
        totals[0] += 1
        totals[1] += padded
        totals[2] += unpadded
        self._table[(phase, mode.value, unpadded, padded)] += 1

    def restart_steps(self) -> None:
        """Forget the steps recorded so far (not the downgrades): a server counts from the end of its warm-up."""
        self._table = Tally()
        self._by_mode = {}

    def record_downgrade(self, phase: str, requested: str, resolved: str, reason: str) -> None:
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
        totals = [t for (p, _), t in self._by_mode.items() if phase is None or p == phase]
        real = sum(t[2] for t in totals)
        return sum(t[1] for t in totals) / real - 1.0 if real else 0.0

    def totals(self) -> dict[tuple[str, str], tuple[int, int, int]]:
        """(phase, mode) -> (steps, padded tokens, real tokens), a snapshot."""
        return {key: tuple(t) for key, t in list(self._by_mode.items())}

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
        for phase in sorted({p for p, _ in self._by_mode}):
            lines.append(f"{phase} padding: {self.padding_ratio(phase):.1%} extra tokens")
        lines += [f"downgraded {d.describe()}" for d in self._downgrades]
        return "\n".join(lines)


class _GraphMetrics:
    """The Prometheus view of a GraphStats, built when scraped (a custom collector), so a step never takes the
    client's counter locks."""

    def __init__(self, stats: GraphStats) -> None:
        self.stats = stats

    @staticmethod
    def _families() -> tuple[CounterMetricFamily, CounterMetricFamily, CounterMetricFamily, GaugeMetricFamily]:
        labels = ("phase", "mode")
        return (CounterMetricFamily("tpgraph_graph_steps", "Steps run, by phase and graph mode", labels=labels),
                CounterMetricFamily("tpgraph_graph_padded_tokens", "Tokens run including padding", labels=labels),
                CounterMetricFamily("tpgraph_graph_real_tokens", "Real (unpadded) tokens run", labels=labels),
                GaugeMetricFamily("tpgraph_graph_mode_downgrade", "1 for each graph mode downgraded at start-up",
                                  labels=("phase", "requested", "resolved", "reason")))

    def describe(self) -> Iterator[Metric]:
        return iter(self._families())  # the names, for the registry's duplicate check

    def collect(self) -> Iterator[Metric]:
        steps, padded, real, downgrade = self._families()
        for key, (n, p, r) in self.stats.totals().items():
            steps.add_metric(key, n)
            padded.add_metric(key, p)
            real.add_metric(key, r)
        for d in self.stats.downgrades:
            downgrade.add_metric((d.phase, d.requested, d.resolved, d.reason), 1)
        return iter((steps, padded, real, downgrade))
