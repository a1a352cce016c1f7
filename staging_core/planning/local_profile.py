"""The local route's costs: measured once per destination file system by copying a sample, kept as a profile."""
from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
import time
from dataclasses import replace

from bundles import native
from bundles.errors import PalletError, UsageError
from bundles.scan import scan
from bundles.state import ensure_state_dir, prune

from staging_core.planning.planner import LOCAL_PROFILE_PREFIX, MIN_SPREAD, LinkProfile, spread_of, typical
from staging_core.planning.profiles import load_profile, save_profile
from staging_core.options import StagingOptions
from staging_core.transports.registry import declared_capabilities
from staging_core.transports.base import Capabilities, Direction, Endpoint, parse_url
from staging_core.transports.local import LocalTransport

SAMPLE_FILES = 1000
SAMPLE_DIRS = 10
SAMPLE_BIG_BYTES = 16 << 20
SAMPLE_COPIES = 3                 # copies of the small sample when a file system is first measured
SAMPLE_WINDOW = 10                # per-file costs kept (measured, then observed): the plan's centre and range
FIRST_SPREAD = (0.4, 3.0)         # a first measurement's range at least: one copy on a busy disk varies that much


def copies_locally(capabilities: Capabilities | None, profile: str | None) -> bool:
    """True when a transfer by a transport with ``capabilities`` (``local_copy``: a copy between this host's
    paths) is one the native engine runs in parallel, planned with the measured local profile (a user's
    ``--profile`` still wins)."""
    return capabilities is not None and capabilities.local_copy and profile is None and native.module() is not None


def uses_local_copy(scheme: str, profile: str | None) -> bool:
    """:func:`copies_locally` for the transport registered for ``scheme`` (its declared capabilities, read
    without connecting): for callers that have not opened it (``pallet plan``)."""
    return copies_locally(declared_capabilities(scheme), profile)


def local_profile(dest: str, measure_now: bool = True) -> LinkProfile:
    """The profile of copying into ``dest``'s file system: loaded, or measured now and saved as
    ``local-DEVICE`` (see :func:`measure`); without ``measure_now``, or where it cannot be measured (the
    parent directory is full or not writable), the default profile."""
    parent = _existing_parent(dest)
    name = f"{LOCAL_PROFILE_PREFIX}{os.stat(parent).st_dev}"
    try:
        return load_profile(name)
    except UsageError:
        if not measure_now:
            return LinkProfile()
    try:
        profile = _measure_beside(parent, parent == os.path.abspath(dest), name)
        save_profile(profile)
    except (OSError, PalletError):      # no room or no right to measure here: plan with the generic figures
        return LinkProfile()
    return profile


def measure(directory: str, name: str) -> LinkProfile:
    """Time what a local push does (scan, then the parallel copy) for SAMPLE_FILES files of 1 KiB, and for one
    file of 16 MiB, in a scratch directory under ``directory``; return them as per-file and per-byte costs."""
    scratch = tempfile.mkdtemp(prefix=".pallet-calibrate-", dir=directory)
    try:
        small = _sample(os.path.join(scratch, "small"), [1024] * SAMPLE_FILES)
        big = _sample(os.path.join(scratch, "big"), [SAMPLE_BIG_BYTES])
        samples = [_copy_seconds(small, os.path.join(scratch, f"small-copy{n}")) / SAMPLE_FILES
                   for n in range(SAMPLE_COPIES)]
        bandwidth = SAMPLE_BIG_BYTES / max(_copy_seconds(big, os.path.join(scratch, "big-copy")), 1e-6)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    return with_samples(replace(LinkProfile(), name=name, rtt_s=0.0, bandwidth=bandwidth, create_rate=float("inf"),
                                concurrency=1, is_default=False), samples, FIRST_SPREAD)


def with_samples(profile: LinkProfile, samples: list[float], floor: tuple[float, float]) -> LinkProfile:
    """``profile`` with per-file cost and spread from the per-file ``samples`` (the last SAMPLE_WINDOW): their
    typical value and the range one more copy falls in 9 times in 10 (:func:`spread_of`, at least ``floor``)."""
    kept = samples[-SAMPLE_WINDOW:]
    low, high = spread_of(kept, floor)
    return replace(profile, per_file_s=typical(kept), spread_low=low, spread_high=high, per_file_samples=tuple(kept))


def _measure_beside(directory: str, is_dest: bool, name: str) -> LinkProfile:
    """:func:`measure` in ``directory``; inside an existing DEST, in its state place, which is removed again
    when the measurement leaves it empty (a selection's push does not clear it, and DEST must hold nothing of
    pallet's after success)."""
    if not is_dest:
        return measure(directory, name)
    state = ensure_state_dir(directory)
    try:
        return measure(state, name)
    finally:
        prune(directory, state)


def observe(dest: str, files: int, nbytes: int, seconds: float) -> None:
    """Fold a finished local copy of ``files`` files (``nbytes``) into ``dest``'s profile, if it has one: its
    per-file cost this copy showed joins the samples of earlier real copies, which replace the measured
    sample's (:func:`with_samples`: the typical one of the last SAMPLE_WINDOW is the cost planned with,
    their spread the range predicted; FIRST_SPREAD at least until three copies were seen). A first
    measurement taken while the file system was busy (write-back after a large copy, say) is so corrected
    by the first real copy, and a slow copy widens the range until it leaves the window. Copies of fewer
    than SAMPLE_FILES files say too little and are ignored."""
    if files < SAMPLE_FILES:
        return
    try:
        profile = load_profile(f"{LOCAL_PROFILE_PREFIX}{os.stat(_existing_parent(dest)).st_dev}")
    except (UsageError, OSError):
        return
    shown = max(seconds - nbytes / profile.bandwidth, 0.0) / files
    samples = list(profile.per_file_samples) if profile.observed else []     # a real copy outweighs the sample's
    observed = replace(profile, observed=profile.observed + 1)
    with contextlib.suppress(OSError):  # the profile directory is not writable: keep planning with the old one
        save_profile(with_samples(observed, [*samples, shown], MIN_SPREAD if samples[2:] else FIRST_SPREAD))


def _sample(root: str, sizes: list[int]) -> str:
    for n, size in enumerate(sizes):
        directory = os.path.join(root, f"d{n % SAMPLE_DIRS}")
        os.makedirs(directory, exist_ok=True)
        with open(os.path.join(directory, f"f{n:05d}"), "wb") as handle:
            handle.write(os.urandom(size) if size > 4096 else b"x" * size)
    return root


def _copy_seconds(src: str, dest: str) -> float:
    os.makedirs(dest)
    started = time.perf_counter()
    items = [os.fsdecode(path) for path in scan(src, "none", 0).index.paths]
    LocalTransport(parse_url(dest)).transfer(Direction.PUSH, src, dest, items)
    return time.perf_counter() - started


def _existing_parent(path: str) -> str:
    path = os.path.abspath(path)
    while not os.path.isdir(path):
        path = os.path.dirname(path)
    return path


def route_profile(endpoint: Endpoint, options: StagingOptions, unpack_route: bool, local_dest: str | None = None,
                  measure: bool = True) -> tuple[LinkProfile, bool]:
    """The link profile to plan with, and whether a bundle may be planned. Where ``endpoint``'s transport copies
    between local paths (``local_copy``, with the native engine) the local profile is used (measured now
    unless ``measure`` is False) and, unless a strategy is asked for, no bundle: the parallel copy needs none.
    ``local_dest``: the local side of a pull (else ``endpoint`` is the destination)."""
    if uses_local_copy(endpoint.scheme, options.profile):
        profile = local_profile(local_dest or endpoint.path, measure)
        return profile, unpack_route and options.strategy != "auto"
    return load_profile(options.profile), unpack_route
