"""The cost model: from tree statistics and a link profile to a plan with predicted seconds per strategy."""
from __future__ import annotations

import math
from dataclasses import dataclass, field, replace

LARGE_FILE_BYTES = 64 << 20       # hybrid: files at least this big travel individually
INLINE_MAX_BYTES = 16 << 20       # inline: a selection's bytes travel in one message, held in memory once
INLINE_MAX_FILES = 10_000         # inline: and as many files at most
SIMPLER_WINS_WITHIN = 0.05        # individual is chosen unless another strategy is >5 % faster


# A tar member's headers and padding: a 512-byte ustar header, a pax header for sub-second mtimes (two more
# blocks), and half a block of padding on average. zstd shrinks them at least 20-fold: 4,000 random 1 KiB
# files pack to 4.29 MB with zstd, of which 4.10 MB is their data (about 47 bytes per member).
TAR_BYTES_PER_MEMBER = 512 * 3 + 256
HEADER_RATIO = 0.05
DEFAULT_SPREAD = (0.5, 3.0)       # a generic profile's predictions: measured time within 0.5x to 3x of them
MIN_SPREAD = (0.6, 1.6)           # the narrowest range a measured profile gives (other work on the machine, write-back)
# zstd levels a profile has compress rates and ratios for (`pallet calibrate`); the defaults were measured on CSV
# text like W1's by one core of a 2-core development machine (docs/benchmarks.md)
CALIBRATED_LEVELS = (-5, -1, 1, 2, 3, 6, 9)
DEFAULT_LEVEL_RATES = (570e6, 360e6, 315e6, 213e6, 95e6, 42e6, 26e6)
DEFAULT_LEVEL_RATIOS = (0.818, 0.722, 0.437, 0.422, 0.441, 0.419, 0.408)


@dataclass(frozen=True)
class TreeStats:
    """What the planner needs to know about a tree: file count, total bytes, and bytes in large files."""

    files: int
    bytes: int
    large_files: int = 0
    large_bytes: int = 0

    @classmethod
    def from_sizes(cls, sizes, large_file_bytes: int = LARGE_FILE_BYTES) -> TreeStats:
        large = [s for s in sizes if s >= large_file_bytes]
        return cls(len(sizes), sum(sizes), len(large), sum(large))


@dataclass(frozen=True)
class LinkProfile:
    """A measured (or default) description of one source → destination route.

    Rates are bytes/s per process; ``per_file_s`` is what one more file
    costs the individual transport in a batch; ``create_rate`` is files/s
    one writer creates at the destination. ``spread_low`` and
    ``spread_high`` bound the measured time as factors of the predicted one
    (from repeated measurements of the route; the default's are generic),
    so a prediction is the range predicted × [low, high];
    ``per_file_samples`` are the recent per-file costs they come from.
    ``levels``, ``level_compress_rates`` and ``level_ratios``: zstd's
    compress rate (one core) and compressed/raw size on the calibration
    sample at each of those levels, from which a stream's level is fitted
    (staging_core.planning.level).
    """

    name: str = "default"
    rtt_s: float = 0.04
    bandwidth: float = 100e6
    per_file_s: float = 1e-3
    create_rate: float = 5_000.0
    compress_rate: float = 300e6
    decompress_rate: float = 1_000e6
    pack_per_file_s: float = 15e-6
    stream_cap: float = 0.0          # bytes/s one stream reaches (0: the full bandwidth)
    concurrency: int = 4             # streams the individual transport runs at once
    cores: int = 2
    create_rate_measured: bool = False
    spread_low: float = DEFAULT_SPREAD[0]
    spread_high: float = DEFAULT_SPREAD[1]
    per_file_samples: tuple[float, ...] = ()
    observed: int = 0                # real copies folded into the samples (local profiles)
    levels: tuple[int, ...] = CALIBRATED_LEVELS
    level_compress_rates: tuple[float, ...] = DEFAULT_LEVEL_RATES
    level_ratios: tuple[float, ...] = DEFAULT_LEVEL_RATIOS
    is_default: bool = True


def spread_of(samples: list[float], floor: tuple[float, float] = MIN_SPREAD) -> tuple[float, float]:
    """The range, as factors of the samples' geometric mean, in which one more measurement of the same cost
    falls 9 times in 10: a prediction interval of the samples' logarithms (Student's t, so few samples give
    a wide range), at least ``floor`` wide."""
    logs = [math.log(max(sample, 1e-12)) for sample in samples]
    if len(logs) < 2:
        return floor
    mean = sum(logs) / len(logs)
    deviation = math.sqrt(sum((x - mean) ** 2 for x in logs) / (len(logs) - 1))
    k = _T_95[min(len(logs) - 1, len(_T_95)) - 1] * deviation * math.sqrt(1 + 1 / len(logs))
    return min(floor[0], math.exp(-k)), max(floor[1], math.exp(k))


def typical(samples: list[float]) -> float:
    """The samples' geometric mean: the centre of :func:`spread_of`'s range."""
    return math.exp(sum(math.log(max(sample, 1e-12)) for sample in samples) / len(samples))


_T_95 = (6.314, 2.920, 2.353, 2.132, 2.015, 1.943, 1.895, 1.860, 1.833, 1.812)    # one-sided 95 %, 1..10 df


LOCAL_PROFILE_PREFIX = "local-"      # profiles measured by the first local copy to a file system


@dataclass(frozen=True)
class Candidate:
    """One strategy with its settings and predicted seconds."""

    strategy: str
    predicted_seconds: float
    codec: str = ""
    ranks: int = 1
    note: str = ""
    low_seconds: float = 0.0        # the range the measured time should fall in (the profile's spread)
    high_seconds: float = 0.0


@dataclass
class Plan:
    """The chosen candidate, every candidate considered, and why."""

    strategy: str
    candidates: list[Candidate]
    reason: str
    details: dict = field(default_factory=dict)

    @property
    def chosen(self) -> Candidate:
        return next(c for c in self.candidates if c.strategy == self.strategy)

    def to_json(self) -> dict:
        return {"strategy": self.strategy, "reason": self.reason, "details": self.details,
                "candidates": [c.__dict__ for c in self.candidates]}


def stream_rate(profile: LinkProfile, streams: int) -> float:
    """Bytes/s that ``streams`` parallel streams reach on the link."""
    cap = profile.stream_cap or profile.bandwidth
    return min(profile.bandwidth, cap * max(1, streams))


def individual_seconds(files: int, nbytes: int, profile: LinkProfile) -> float:
    """Per-file transfer: every file pays the per-file cost and a create at the far side."""
    if files == 0:
        return 0.0
    return (profile.rtt_s + files * profile.per_file_s + nbytes / stream_rate(profile, profile.concurrency)
            + files / profile.create_rate)


def inline_seconds(files: int, nbytes: int, profile: LinkProfile) -> float:
    """One request over a warm host session: a round trip, the bytes at one stream's rate, the creates."""
    return profile.rtt_s + nbytes / stream_rate(profile, 1) + files / profile.create_rate


def inline_fits(stats: TreeStats) -> bool:
    """Whether a selection is small enough to travel inline (memory holds it once, whole)."""
    return stats.bytes <= INLINE_MAX_BYTES and stats.files <= INLINE_MAX_FILES


def bundle_bytes(files: int, nbytes: int, ratio: float, compress: bool) -> tuple[float, float]:
    """The bundle's raw (tar) bytes and the bytes it puts on the wire: file contents (shrunk by ``ratio`` when
    compressed) plus each member's tar headers and padding, which compress to almost nothing."""
    raw = nbytes + files * TAR_BYTES_PER_MEMBER
    wire = nbytes * ratio + files * TAR_BYTES_PER_MEMBER * HEADER_RATIO if compress else raw
    return raw, wire


def bundle_seconds(files: int, nbytes: int, profile: LinkProfile, ratio: float, compress: bool, ranks: int) -> float:
    """Pack, send and unpack overlapped as a stream: the slowest stage sets the pace."""
    if files == 0:
        return 0.0
    workers = max(1, profile.cores)
    raw, on_wire = bundle_bytes(files, nbytes, ratio, compress)
    pack = files * profile.pack_per_file_s / workers + (raw / (profile.compress_rate * workers) if compress else 0)
    wire = on_wire / stream_rate(profile, 1)
    unpack = (files / (profile.create_rate * max(1, ranks))
              + (raw / (profile.decompress_rate * ranks) if compress else 0))
    return profile.rtt_s * 2 + max(pack, wire, unpack)


def plan(stats: TreeStats, profile: LinkProfile, compress_ratio: float = 1.0, ranks: int = 1,
         bundle_possible: bool = True, in_place: int | None = None, inline_possible: bool = False,
         level: int | None = None) -> Plan:
    """Choose how to move a tree. Pure: the same inputs always give the same plan.

    ``compress_ratio`` is compressed/original size measured on a sample
    (1.0 = incompressible); ``bundle_possible`` is False when no route can
    unpack at the destination, which leaves only individual transfer.
    ``in_place``: DEST was compared with the source, ``stats`` are what
    differs and ``in_place`` files are there already (the plan is the
    incremental one, and says so); None: DEST was not compared.
    ``inline_possible``: a warm host session could carry the files in one
    request (a workflow's small operation); inline is then a candidate when
    the files fit (:func:`inline_fits`), and chosen unless another is more
    than 5 % faster, as the simplest.
    A bundle that is compressed streams at a level fitted to the link
    (staging_core.planning.level; ``level``: the user's, which wins): the
    details' ``level`` and the reason say which and why.
    """
    raw, compressed = bundle_bytes(stats.files, stats.bytes, compress_ratio, True)
    bundle_ratio = compressed / raw if raw else 1.0
    compress = _compression_pays(profile, bundle_ratio)
    candidates = [Candidate("individual", individual_seconds(stats.files, stats.bytes, profile))]
    if bundle_possible:
        codec = "zstd" if compress else "none"
        candidates.append(Candidate("bundle", bundle_seconds(stats.files, stats.bytes, profile, compress_ratio,
                                                             compress, ranks), codec, ranks))
        if 0 < stats.large_files < stats.files:
            small_files, small_bytes = stats.files - stats.large_files, stats.bytes - stats.large_bytes
            hybrid = max(individual_seconds(stats.large_files, stats.large_bytes, profile),
                         bundle_seconds(small_files, small_bytes, profile, compress_ratio, compress, ranks),
                         stats.bytes / stream_rate(profile, profile.concurrency + 1))
            candidates.append(Candidate("hybrid", hybrid, codec, ranks,
                                        f"{stats.large_files} large file(s) individually"))
    candidates = [replace(c, low_seconds=c.predicted_seconds * profile.spread_low,
                          high_seconds=c.predicted_seconds * profile.spread_high) for c in candidates]
    if inline_possible and inline_fits(stats):
        seconds = inline_seconds(stats.files, stats.bytes, profile)
        candidates.insert(0, Candidate("inline", seconds, low_seconds=seconds * profile.spread_low,
                                       high_seconds=seconds * profile.spread_high))
    best = min(candidates, key=lambda c: c.predicted_seconds)
    if candidates[0].predicted_seconds <= best.predicted_seconds * (1 + SIMPLER_WINS_WITHIN):
        best = candidates[0]          # the simplest unless another is clearly faster
    reason = _reason(best, candidates, stats, profile, compress, compress_ratio)
    fitted = _fitted(best, stats, profile, compress_ratio, ranks, level) if bundle_possible else None
    reason += f"; {fitted['why']}" if fitted and compress and best.strategy in ("bundle", "hybrid") else ""
    if in_place is not None:
        reason = _incremental(stats, in_place, reason)
    return Plan(best.strategy, candidates, reason,
                {"compress": compress, "compress_ratio": compress_ratio, "bundle_ratio": round(bundle_ratio, 4),
                 "profile": profile.name, "default_profile": profile.is_default,
                 "spread": [profile.spread_low, profile.spread_high],
                 **({"level": fitted} if fitted else {}),
                 **({} if in_place is None else {"incremental": True, "in_place": in_place})})


def _fitted(best: Candidate, stats: TreeStats, profile: LinkProfile, ratio: float, ranks: int,
            level: int | None) -> dict:
    """The level a zstd bundle of the plan streams at (staging_core.planning.level), as JSON (the bundle
    may be forced on an individual plan, or zstd on one that would not compress)."""
    from staging_core.planning.level import fit_level       # it builds on this module's model
    bundled = stats if best.strategy != "hybrid" else TreeStats(stats.files - stats.large_files,
                                                               stats.bytes - stats.large_bytes)
    return fit_level(bundled, profile, ratio, ranks, "zstd", level).to_json()


def _incremental(stats: TreeStats, in_place: int, reason: str) -> str:
    """The reason of a plan made after comparing DEST: what differs, and the plan for it."""
    if stats.files == 0:
        return f"no file to send: DEST holds all {in_place} files as they are"
    return (f"incremental: {stats.files} of {stats.files + in_place} files differ from DEST "
            f"({in_place} already in place); {reason}")


def _compression_pays(profile: LinkProfile, ratio: float) -> bool:
    """Compress only when both compressing and decompressing outrun the link, and the bundle (``ratio``:
    compressed / raw, tar headers included) shrinks."""
    workers = max(1, profile.cores)
    return ratio < 0.9 and min(profile.compress_rate * workers, profile.decompress_rate) > profile.bandwidth


def _reason(best: Candidate, candidates: list[Candidate], stats: TreeStats, profile: LinkProfile,
            compress: bool, ratio: float) -> str:
    per_file_total = stats.files * profile.per_file_s
    others = ", ".join(f"{c.strategy} {c.predicted_seconds:.2f} s" for c in candidates if c is not best) \
        or ("nothing else (a local copy runs in parallel and needs no bundle; --strategy bundle to force one)"
            if profile.name.startswith(LOCAL_PROFILE_PREFIX)
            else "nothing else (no route to unpack a bundle at the destination)")
    why = {"individual": f"{stats.files} files cost only {per_file_total:.2f} s in per-file overhead",
           "bundle": f"{stats.files} files would cost {per_file_total:.2f} s in per-file overhead alone",
           "hybrid": "large files stream well alone while the small ones need a bundle",
           "inline": f"{stats.files} files ({stats.bytes} bytes) fit in one request over the warm host "
                     "session"}[best.strategy]
    codec = (f"; compress (ratio {ratio:.2f}): compression and decompression both outrun the link"
             if compress else "; no compression: it would not outrun the link or the data does not shrink")
    default = " (default link profile: generic figures, not measured on this route)" if profile.is_default else ""
    codec = codec if best.strategy not in ("individual", "inline") else ""
    return f"{best.strategy} ({best.predicted_seconds:.2f} s): {why}; vs {others}{codec}{default}"
