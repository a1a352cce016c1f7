"""bench_push.py's report: the medians table, the targets with PASS/MISS, the grid table, and the PNG chart."""
from __future__ import annotations

from dataclasses import dataclass

from push_grid import NEVER_WORSE, WITHIN, GridCase, GridScore
from push_methods import Method


@dataclass(frozen=True)
class Target:
    """One headline target: ``value`` (None: not measured) against ``limit`` (None: shown for scale only)."""

    name: str
    value: float | None
    limit: float | None
    at_least: bool = False
    note: str = ""

    @property
    def verdict(self) -> str:
        if self.limit is None:
            return "-"
        if self.value is None:
            return "MISS (not measured)"
        passed = self.value >= self.limit if self.at_least else self.value <= self.limit
        return "PASS" if passed else "MISS"

    def to_json(self) -> dict:
        return {"name": self.name, "value": self.value, "limit": self.limit, "at_least": self.at_least,
                "verdict": self.verdict, "note": self.note}


def ratio(numerator: Method, denominator: Method) -> float | None:
    if numerator.median is None or denominator.median is None:
        return None
    return numerator.median / denominator.median


def print_methods(title: str, methods: list[Method]) -> None:
    print(f"\n{title}")
    print(f"  {'method':44s} {'median s':>10s}  runs")
    for method in methods:
        median = f"{method.median:10.2f}" if method.median is not None else f"{'failed':>10s}"
        runs = " ".join(f"{s:.2f}" for s in method.seconds)
        scale = f"  (sample x {method.scale:.1f})" if method.scale != 1.0 else ""
        print(f"  {method.name:44s} {median}  {runs}{scale}")
        for error in dict.fromkeys(method.errors):
            print(f"  {'':44s} error: {error}")


def print_targets(targets: list[Target]) -> None:
    print("\nTargets")
    for target in targets:
        value = f"{target.value:8.2f}" if target.value is not None else f"{'-':>8s}"
        limit = f"{'>=' if target.at_least else '<='} {target.limit:<5g}" if target.limit is not None else " " * 8
        note = f"  ({target.note})" if target.note else ""
        print(f"  {target.name:62s} {value}  {limit} {target.verdict}{note}")


def print_grid(cases: list[GridCase], scores: list[GridScore]) -> None:
    print("\nPlanner accuracy grid (medians, s; pick/best: the pick's median over the best strategy's)")
    print(f"  {'tree':34s} {'link':18s} {'individual':>10s} {'bundle':>8s} {'hybrid':>8s}  {'best':10s} "
          f"{'calibrated pick':24s} {'default pick':24s}")
    for case in cases:
        cells = [_cell(case.methods.get(s)) for s in ("individual", "bundle", "hybrid")]
        best = case.best[0] if case.best else "-"
        picks = [_pick(case, w) for w in ("calibrated", "default")]
        print(f"  {case.tree:34s} {case.link.label:18s} {cells[0]:>10s} {cells[1]:>8s} {cells[2]:>8s}  "
              f"{best:10s} {picks[0]:24s} {picks[1]:24s}")
    for s in scores:
        verdict = "PASS" if s.passed else "MISS"
        print(f"  {s.which} profile: within {WITHIN:.2f}x of the best in {s.within}/{s.scored} cases, worst "
              f"{s.worst:.2f}x (goal: >= 90 % of cases, never > {NEVER_WORSE}x)  {verdict}")


def _cell(method: Method | None) -> str:
    if method is None:
        return "n/a"
    return f"{method.median:.2f}" if method.median is not None else "failed"


def _pick(case: GridCase, which: str) -> str:
    value = case.pick_ratio(which)
    return f"{case.picks[which][:12]} {value:.2f}x" if value is not None else case.picks[which][:24]


def write_chart(path: str, headline: tuple[tuple[str, list[Method]], tuple[str, list[Method]]] | None,
                cases: list[GridCase], title: str) -> None:
    """A PNG of what was measured: the headline's W1 (log scale) and W2 medians side by side, each given as
    (label, methods), and/or the grid's pick/best ratios. Raises SystemExit when there is nothing to draw."""
    if headline is None and not cases:
        raise SystemExit("--chart: nothing was measured, so there is nothing to draw")
    try:
        import matplotlib
    except ImportError:
        raise SystemExit("--chart needs matplotlib: .venv/bin/python -m pip install matplotlib") from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    parts = (headline is not None) + bool(cases)
    figure = plt.figure(figsize=(13, 4.5 * parts), layout="constrained")
    rows = list(figure.subfigures(parts, 1)) if parts > 1 else [figure]
    if headline is not None:
        (w1_label, w1), (w2_label, w2) = headline
        axes = rows[0].subplots(1, 2, width_ratios=[3, 2])
        _bars(axes[0], w1, f"{w1_label}: seconds (log scale)")
        _bars(axes[1], w2, f"{w2_label}: seconds")
    if cases:
        _grid_axes(rows[-1].subplots(), cases)
    figure.suptitle(title)
    figure.savefig(path, dpi=110)
    plt.close(figure)
    print(f"chart written to {path}")


def _bars(ax, methods: list[Method], title: str) -> None:
    names = [m.name for m in methods]
    values = [m.median or 0.0 for m in methods]
    bars = ax.barh(names, values, color=["tab:blue" if m.name.startswith("pallet") else "tab:gray" for m in methods])
    for bar, method in zip(bars, methods, strict=True):
        label = f"{method.median:.1f} s" if method.median is not None else "failed"
        ax.annotate(label, (bar.get_width(), bar.get_y() + bar.get_height() / 2), xytext=(3, 0),
                    textcoords="offset points", va="center", fontsize=8)
    if "log" in title and any(values):
        ax.set_xscale("log")
    ax.invert_yaxis()
    ax.set_title(title)
    ax.tick_params(axis="y", labelsize=8)


def _grid_axes(ax, cases: list[GridCase]) -> None:
    labels = [f"{c.tree.split(' ')[0]}\n{c.link.rtt_ms:g} ms\n{c.link.rate}" for c in cases]
    positions = range(len(cases))
    for offset, which, color in ((-0.2, "calibrated", "tab:blue"), (0.2, "default", "tab:orange")):
        values = [c.pick_ratio(which) or 0.0 for c in cases]
        ax.bar([p + offset for p in positions], values, width=0.4, color=color, label=f"pick, {which} profile")
    ax.axhline(WITHIN, color="green", linestyle="--", linewidth=1, label=f"{WITHIN:.2f}x of best")
    ax.axhline(NEVER_WORSE, color="red", linestyle=":", linewidth=1, label=f"{NEVER_WORSE}x of best")
    ax.set_xticks(list(positions), labels, fontsize=7)
    ax.set_ylabel("pick median / best median")
    ratios = [c.pick_ratio(w) or 0.0 for c in cases for w in ("calibrated", "default")]
    ax.set_ylim(0, max(NEVER_WORSE + 0.2, *ratios) * 1.05)
    ax.set_title("Planner accuracy: the picked strategy against the best measured one (0: not measured)")
    ax.legend(fontsize=8, loc="upper right")
