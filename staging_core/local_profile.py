"""The local route's costs: measured once per destination file system by copying a sample, kept as a profile."""
from __future__ import annotations

import os
import shutil
import tempfile
import time
from dataclasses import replace

from bundles import native
from bundles.errors import PalletError, UsageError
from bundles.scan import scan
from bundles.state import ensure_state_dir, prune

from .planner import LOCAL_PROFILE_PREFIX, LinkProfile
from .profiles import load_profile, save_profile
from .options import StagingOptions
from .transports.base import Direction, Endpoint, parse_url
from .transports.local import LocalTransport

SAMPLE_FILES = 1000
SAMPLE_DIRS = 10
SAMPLE_BIG_BYTES = 16 << 20


def uses_local_copy(scheme: str, profile: str | None) -> bool:
    """True when a transfer to or from ``scheme`` is a local copy the native engine runs in parallel, planned
    with the measured local profile (a user's ``--profile`` still wins)."""
    return scheme == "file" and profile is None and native.module() is not None


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
        per_file = min(_copy_seconds(small, os.path.join(scratch, f"small-copy{n}")) for n in range(2)) / SAMPLE_FILES
        bandwidth = SAMPLE_BIG_BYTES / max(_copy_seconds(big, os.path.join(scratch, "big-copy")), 1e-6)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    return replace(LinkProfile(), name=name, rtt_s=0.0, bandwidth=bandwidth, per_file_s=per_file,
                   create_rate=float("inf"), concurrency=1, is_default=False)


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
    per-file cost moves halfway to the one this copy showed. A first measurement taken while the file
    system was busy (write-back after a large copy, say) is so corrected by the next real copies. Copies
    of fewer than SAMPLE_FILES files say too little and are ignored."""
    if files < SAMPLE_FILES:
        return
    try:
        profile = load_profile(f"{LOCAL_PROFILE_PREFIX}{os.stat(_existing_parent(dest)).st_dev}")
    except (UsageError, OSError):
        return
    shown = max(seconds - nbytes / profile.bandwidth, 0.0) / files
    try:
        save_profile(replace(profile, per_file_s=(profile.per_file_s + shown) / 2))
    except OSError:
        pass                            # the profile directory is not writable: keep planning with the old one


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
    """The link profile to plan with, and whether a bundle may be planned. Between local paths (with the native
    engine) the local profile is used (measured now unless ``measure`` is False) and, unless a strategy is
    asked for, no bundle: the parallel copy needs none. ``local_dest``: the local side of a pull (else
    ``endpoint`` is the destination)."""
    if uses_local_copy(endpoint.scheme, options.profile):
        profile = local_profile(local_dest or endpoint.path, measure)
        return profile, unpack_route and options.strategy != "auto"
    return load_profile(options.profile), unpack_route
