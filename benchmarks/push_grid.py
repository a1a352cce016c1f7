"""The planner accuracy grid: every strategy on every workload and link setting, against the planner's pick."""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from push_methods import (Manifest, Method, MethodFailed, MethodSpec, Rig, measure, pallet_calibrate, pallet_plan,
                          pallet_push)
from wan import LinkCheck, LinkSpec, WanLink

STRATEGIES = ("individual", "bundle", "hybrid")
WITHIN = 1.10            # a pick counts as right when its median is within 10 % of the best strategy's
GOAL_SHARE = 0.90        # ... in at least 90 % of the cases
NEVER_WORSE = 1.5        # and never more than 1.5x the best


@dataclass(frozen=True)
class Tree:
    """A source tree on disk with its label, manifest and whether the planner may consider hybrid."""

    label: str
    path: Path
    expected: Manifest
    hybrid: bool


@dataclass
class GridCase:
    """One workload on one link: the planner's picks (calibrated / default profile) and every strategy measured."""

    tree: str
    link: LinkSpec
    check: LinkCheck
    profile: dict
    picks: dict[str, str]                        # "calibrated" / "default" -> strategy, or "error: ..."
    methods: dict[str, Method] = field(default_factory=dict)

    @property
    def best(self) -> tuple[str, float] | None:
        measured = [(name, m.median) for name, m in self.methods.items() if m.median is not None]
        return min(measured, key=lambda item: item[1]) if measured else None

    def pick_ratio(self, which: str) -> float | None:
        """The pick's median over the best median (None when either was not measured)."""
        pick, best = self.methods.get(self.picks.get(which, "")), self.best
        if pick is None or pick.median is None or best is None:
            return None
        return pick.median / best[1]

    def to_json(self) -> dict:
        best = self.best
        return {"tree": self.tree, "rtt_ms": self.link.rtt_ms, "rate": self.link.rate,
                "ping_ms": self.check.ping_ms, "stream_mbit": self.check.stream_mbit, "profile": self.profile,
                "picks": self.picks, "best": best[0] if best else None,
                "pick_ratio": {w: self.pick_ratio(w) for w in self.picks},
                "strategies": {name: m.to_json() for name, m in self.methods.items()}}


@dataclass(frozen=True)
class GridScore:
    """How often a pick was within WITHIN of the best, and its worst ratio, over the cases with a ratio."""

    which: str
    within: int
    scored: int
    worst: float

    @property
    def passed(self) -> bool:
        return self.scored > 0 and self.within >= GOAL_SHARE * self.scored and self.worst <= NEVER_WORSE


def grid_links(rtt_ms: float) -> list[LinkSpec]:
    """No added delay and ``rtt_ms``, each at 1 Gbit and 100 Mbit."""
    return [LinkSpec(rtt, rate) for rtt in (0.0, rtt_ms) for rate in ("1gbit", "100mbit")]


def run_grid(link: WanLink, rig: Rig, trees: list[Tree], rtt_ms: float, repeat: int) -> list[GridCase]:
    """Per link setting: apply it, check it, calibrate a profile; then every tree under every strategy."""
    cases = []
    for spec in grid_links(rtt_ms):
        link.apply(spec)
        check = link.checked()
        print(f"\n== grid link {spec.label}: ping -U {check.ping_ms:.1f} ms, one TCP stream "
              f"{check.stream_mbit:.0f} Mbit/s", flush=True)
        name = f"bench-{spec.slug}"
        profile = _calibrate(rig, name)
        for tree in trees:
            case = GridCase(tree.label, spec, check, profile, _picks(rig, tree.path, name))
            _measure(case, rig, tree, name, repeat)
            cases.append(case)
            rig.clear_destinations()
    return cases


def _calibrate(rig: Rig, name: str) -> dict:
    try:
        profile = pallet_calibrate(rig, name)
    except MethodFailed as exc:
        print(f"   calibrate failed: {exc}")
        return {"error": str(exc)}
    print(f"   profile {name}: rtt {profile['rtt_s'] * 1e3:.1f} ms, {profile['bandwidth'] / 1e6:.1f} MB/s, "
          f"{profile['per_file_s'] * 1e3:.3f} ms per file", flush=True)
    return profile


def _picks(rig: Rig, src: Path, profile: str) -> dict[str, str]:
    picks = {}
    for which, name in (("calibrated", profile), ("default", None)):
        try:
            picks[which] = pallet_plan(rig, src, name)["strategy"]
        except (MethodFailed, KeyError) as exc:
            picks[which] = f"error: {exc}"
    return picks


def _measure(case: GridCase, rig: Rig, tree: Tree, profile: str, repeat: int) -> None:
    """Every strategy ``repeat`` times, alternating the order, each into a fresh destination."""
    names = [s for s in STRATEGIES if tree.hybrid or s != "hybrid"]
    specs = [MethodSpec(s, f"grid-{s}", pallet_push(rig, s, profile), tree.expected) for s in names]
    print(f"   {tree.label}: picks {case.picks['calibrated']} (calibrated), {case.picks['default']} (default)",
          flush=True)
    case.methods = {m.name: m for m in measure(rig, tree.path, specs, repeat)}


def score(cases: list[GridCase], which: str) -> GridScore:
    ratios = [r for r in (c.pick_ratio(which) for c in cases) if r is not None]
    return GridScore(which, sum(r <= WITHIN for r in ratios), len(ratios), max(ratios, default=float("inf")))
