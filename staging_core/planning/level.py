"""The level a stream starts at: the cheapest whose output the link carries no slower than the CPU makes it."""
from __future__ import annotations

from dataclasses import dataclass

from bundles.level_fit import ladder

from staging_core.planning.planner import LinkProfile, TreeStats, bundle_bytes, stream_rate

REFERENCE_LEVEL = 3          # the level a tree's compression ratio is sampled at (inventory.compress_ratio)
_DEFAULT_LEVELS = {"zstd": 3, "gzip": 6, "none": 0}
TIE = 0.02                   # levels whose streams are predicted within 2 % of the least are equals: the cheapest wins


@dataclass(frozen=True)
class LevelStages:
    """A bundle stream's stages at one level, in seconds: pack (per-file work and compression, on the profile's
    cores), the wire (the compressed bytes over one stream) and unpack (creates and decompression there)."""

    level: int
    pack_s: float
    wire_s: float
    unpack_s: float

    @property
    def seconds(self) -> float:
        return max(self.pack_s, self.wire_s, self.unpack_s)

    @property
    def link_bound(self) -> bool:
        """The link holds the stream back: the CPU at either end makes or takes the bytes faster."""
        return self.wire_s > max(self.pack_s, self.unpack_s)

    @property
    def slowest_cpu(self) -> str:
        return "packing" if self.pack_s >= self.unpack_s else "unpacking"


@dataclass(frozen=True)
class FittedLevel:
    """The level a stream's shards are compressed at: ``level`` to start, then between ``low`` and ``high`` as
    the stream runs, unless ``fixed`` (asked for with ``--level``, or a codec whose level is not fitted), and
    why."""

    codec: str
    level: int
    low: int
    high: int
    fixed: bool
    why: str

    def to_json(self) -> dict:
        return {"codec": self.codec, "level": self.level, "low": self.low, "high": self.high, "fixed": self.fixed,
                "why": self.why}


def fixed_level(codec: str, asked: int | None = None) -> FittedLevel:
    """Every shard at ``asked`` (the user's ``--level``), or at ``codec``'s default when None."""
    if asked is not None:
        return FittedLevel(codec, asked, asked, asked, True, f"{codec} level {asked}, as asked (--level)")
    default = _DEFAULT_LEVELS.get(codec, 0)
    return FittedLevel(codec, default, default, default, True, f"{codec} at its default level {default}")


def planned_level(details: dict, codec: str, asked: int | None) -> FittedLevel:
    """The level a bundle of ``codec`` streams at: the user's (``asked``), else the one the plan fitted
    (its ``details``) when it fitted one for ``codec``, else the codec's default."""
    fitted = details.get("level")
    if asked is not None or not fitted or fitted.get("codec") != codec:
        return fixed_level(codec, asked)
    return FittedLevel(**fitted)


def level_stages(stats: TreeStats, profile: LinkProfile, ratio: float, ranks: int, level: int) -> LevelStages:
    """The stages of a stream of ``stats`` at ``level``: the profile's compress rate at that level, and the
    tree's ``ratio`` (sampled at REFERENCE_LEVEL) scaled to it (:func:`_scaled`)."""
    rate, scaled = _rate(profile, level), _scaled(profile, ratio, level)
    workers = max(1, profile.cores)
    raw, wire = bundle_bytes(stats.files, stats.bytes, scaled, True)
    pack = stats.files * profile.pack_per_file_s / workers + raw / (rate * workers)
    unpack = stats.files / (profile.create_rate * max(1, ranks)) + raw / (profile.decompress_rate * max(1, ranks))
    return LevelStages(level, pack, wire / stream_rate(profile, 1), unpack)


def fit_level(stats: TreeStats, profile: LinkProfile, ratio: float, ranks: int = 1, codec: str = "zstd",
              asked: int | None = None) -> FittedLevel:
    """The level a stream of ``stats`` over ``profile``'s link starts at. Pure.

    ``asked`` (the user's ``--level``) wins and stays. A codec without a
    ladder (gzip, none) keeps its default. Otherwise, of the codec's ladder
    levels the profile has rates for, the cheapest (fastest) whose stream
    is within TIE of the least time: the cheapest at which the link is not
    the bottleneck (:attr:`LevelStages.link_bound`) where a dearer level
    would only cost more CPU, the cheapest where a dearer level would not
    shrink the bytes enough to pay (incompressible data). The stream then
    moves between the ladder's cheapest level and the dearest whose compress
    rate on the profile's cores still matches the link's bandwidth (any
    harder and the CPU could not feed the link), or the start if higher.
    """
    rungs = [level for level in ladder(codec) if level in profile.levels]
    if asked is not None or not rungs:
        return fixed_level(codec, asked)
    stages = [level_stages(stats, profile, ratio, ranks, level) for level in rungs]
    least = min(s.seconds for s in stages)
    chosen = next(s for s in stages if s.seconds <= least * (1 + TIE))
    high = max([chosen.level, *(level for level in rungs if _rate(profile, level) * max(1, profile.cores)
                                >= profile.bandwidth)])
    return FittedLevel(codec, chosen.level, rungs[0], high, False, _why(codec, chosen, stages, rungs[0], high))


def _why(codec: str, chosen: LevelStages, stages: list[LevelStages], low: int, high: int) -> str:
    cheaper = [s for s in stages if s.level < chosen.level]
    if not chosen.link_bound:
        head = (f"{codec} level {chosen.level}: the cheapest at which the link ({chosen.wire_s:.2f} s) keeps up "
                f"with {chosen.slowest_cpu} ({max(chosen.pack_s, chosen.unpack_s):.2f} s)")
        if cheaper:
            head += (f"; at {', '.join(str(s.level) for s in cheaper)} the link would hold it back "
                     f"({cheaper[0].wire_s:.2f} s)")
    else:
        head = (f"{codec} level {chosen.level}: the link sets the pace ({chosen.wire_s:.2f} s) and no dearer level "
                "shortens the stream")
    return f"{head}; adjusted between {low} and {high} as the stream runs"


def _rate(profile: LinkProfile, level: int) -> float:
    return max(profile.level_compress_rates[profile.levels.index(level)], 1.0)


def _scaled(profile: LinkProfile, ratio: float, level: int) -> float:
    """The tree's ``ratio`` (sampled at REFERENCE_LEVEL) at ``level``: what it saves grows or shrinks as the
    calibration sample's savings do (incompressible data stays incompressible at every level)."""
    if REFERENCE_LEVEL not in profile.levels:
        return ratio
    saved = 1.0 - profile.level_ratios[profile.levels.index(level)]
    reference = max(1.0 - profile.level_ratios[profile.levels.index(REFERENCE_LEVEL)], 1e-3)
    return min(1.0, max(0.0, 1.0 - (1.0 - ratio) * saved / reference))
