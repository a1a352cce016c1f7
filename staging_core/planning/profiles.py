"""Link profiles: measure a route (`pallet calibrate`) and store it as TOML under the XDG config dir."""
from __future__ import annotations

import os
import posixpath
import random
import shlex
import shutil
import subprocess
import sys
import tempfile
import time
import tomllib
from dataclasses import asdict, dataclass, fields, replace
from typing import Any

import zstandard

from bundles.errors import UsageError
from bundles.writer import PackOptions, pack

from staging_core.planning.planner import CALIBRATED_LEVELS, LinkProfile, spread_of, typical
from staging_core.scratch import scratch_dir
from staging_core.transports.base import Direction, Transport

PROBE_FILES = 400
PER_FILE_RUNS = 3                # the per-file probe's repeats: their spread bounds the plan's ranges
PROBE_BYTES = 32 << 20
CREATE_PROBE_FILES = 2000
CODEC_SAMPLE_ROWS = 25_000      # about 1 MB of CSV text: each calibrated level compresses it once
_CREATE_PROBE = """\
import os, sys, time
root, count = sys.argv[1], int(sys.argv[2])
os.makedirs(root, exist_ok=True)
data = b"x" * 1024
started = time.perf_counter()
for n in range(count):
    fd = os.open(os.path.join(root, "c%05d" % n), os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    os.write(fd, data)
    os.close(fd)
print(count / max(time.perf_counter() - started, 1e-6))
"""


def profile_dir() -> str:
    """Where profiles live: $XDG_CONFIG_HOME/pallet/profiles (default ~/.config/pallet/profiles)."""
    base = os.environ.get("XDG_CONFIG_HOME") or os.path.join(os.path.expanduser("~"), ".config")
    return os.path.join(base, "pallet", "profiles")


def save_profile(profile: LinkProfile) -> str:
    """Write ``profile`` as NAME.toml (atomically) and return the path."""
    os.makedirs(profile_dir(), exist_ok=True)
    path = os.path.join(profile_dir(), f"{profile.name}.toml")
    lines = ["# pallet link profile, measured by `pallet calibrate` (local-*: by the first local push)"]
    lines += [f"{key} = {_toml_value(value)}" for key, value in asdict(profile).items() if key != "is_default"]
    fd, tmp = tempfile.mkstemp(prefix=f".{profile.name}.", suffix=".tmp", dir=profile_dir())
    with open(fd, "w") as handle:
        handle.write("\n".join(lines) + "\n")
    os.replace(tmp, path)
    return path


def _toml_value(value) -> str:
    if isinstance(value, (tuple, list)):
        return "[" + ", ".join(_toml_value(item) for item in value) + "]"
    if isinstance(value, bool):
        return "true" if value else "false"
    return f'"{value}"' if isinstance(value, str) else repr(value)


def load_profile(name: str | None) -> LinkProfile:
    """The named profile, or the documented default (``is_default`` True) when ``name`` is None."""
    if name is None:
        return LinkProfile()
    path = os.path.join(profile_dir(), f"{name}.toml")
    try:
        with open(path, "rb") as handle:
            values = tomllib.load(handle)
    except FileNotFoundError:
        raise UsageError(f"no link profile named {name!r}", path, f"measure one: pallet calibrate --name {name} URL") \
            from None
    except OSError as exc:
        raise UsageError(f"cannot read link profile {name!r} ({exc.strerror})", path,
                         "make it readable, or point $XDG_CONFIG_HOME at a profile directory of your own") from None
    except tomllib.TOMLDecodeError as exc:
        raise UsageError(f"link profile {name!r} is not valid TOML ({exc})", path,
                         f"fix the file or measure it again: pallet calibrate --name {name} URL") from None
    known = {f.name for f in fields(LinkProfile)}
    stored: dict[str, Any] = {k: tuple(v) if isinstance(v, list) else v for k, v in values.items() if k in known}
    return replace(LinkProfile(), **stored, is_default=False)


def calibrate(transport: Transport, remote_dir: str, name: str, remote_python: str = "python3") -> LinkProfile:
    """Measure round trip, bandwidth, per-file cost, create rate, pack cost and codec rates on a route.

    ``remote_dir`` is a scratch directory on the far side, created and, where
    the transport can (local, remote exec), removed again. The destination's
    create rate (1 KiB files by one writer) is measured by ``remote_python``
    there when the transport can run commands; otherwise the default stays
    and ``create_rate_measured`` is False.
    """
    if not name.replace("-", "").replace("_", "").replace(".", "").isalnum():
        raise UsageError(f"profile name {name!r} may hold only letters, digits, '-', '_' and '.'")
    local = scratch_dir("pallet-calibrate-")
    try:
        transport.mkdir(remote_dir)
        rtt = _round_trip(transport, remote_dir)
        bandwidth = _bandwidth(transport, local, remote_dir)
        per_file_samples = _per_file(transport, local, remote_dir, bandwidth)
        create_rate = _create_rate(transport, os.path.join(remote_dir, "create"), remote_python)
        pack_per_file = _pack_per_file(local)
        rates = _codec_rates()
    finally:
        shutil.rmtree(local, ignore_errors=True)
        _remove_scratch(transport, remote_dir)
    default = LinkProfile()
    low, high = spread_of(per_file_samples)
    per_file = typical(per_file_samples)
    return LinkProfile(name=name, rtt_s=rtt, bandwidth=bandwidth, per_file_s=per_file,
                       create_rate=create_rate or default.create_rate, compress_rate=rates.compress,
                       decompress_rate=rates.decompress, pack_per_file_s=pack_per_file,
                       concurrency=transport.capabilities.concurrency, cores=len(os.sched_getaffinity(0)),
                       create_rate_measured=create_rate is not None, spread_low=low, spread_high=high,
                       per_file_samples=tuple(per_file_samples), levels=CALIBRATED_LEVELS,
                       level_compress_rates=rates.by_level, level_ratios=rates.ratios, is_default=False)


def _remove_scratch(transport: Transport, remote_dir: str) -> None:
    if transport.endpoint.is_local:
        shutil.rmtree(remote_dir, ignore_errors=True)
    elif transport.capabilities.remote_exec:
        transport.run(["rm", "-rf", "--", remote_dir])


def _round_trip(transport: Transport, remote_dir: str) -> float:
    samples = []
    for _ in range(5):
        started = time.perf_counter()
        transport.stat(remote_dir)
        samples.append(time.perf_counter() - started)
    return sorted(samples)[len(samples) // 2]


def _bandwidth(transport: Transport, local: str, remote_dir: str) -> float:
    with open(os.path.join(local, "probe.bin"), "wb") as handle:
        handle.write(os.urandom(PROBE_BYTES))
    started = time.perf_counter()
    transport.transfer(Direction.PUSH, local, remote_dir, ["probe.bin"])
    return PROBE_BYTES / max(time.perf_counter() - started, 1e-6)


def _per_file(transport: Transport, local: str, remote_dir: str, bandwidth: float) -> list[float]:
    """Seconds per file of a batch of PROBE_FILES tiny files, measured PER_FILE_RUNS times (each into a
    directory of its own, so none finds the files there already): their spread is the profile's."""
    tiny = os.path.join(local, "tiny")
    os.makedirs(tiny)
    for n in range(PROBE_FILES):
        with open(os.path.join(tiny, f"f{n:04d}"), "wb") as handle:
            handle.write(b"x" * 1024)
    samples = []
    for run in range(PER_FILE_RUNS):
        target = posixpath.join(remote_dir, f"per-file-{run}")
        transport.mkdir(target)
        started = time.perf_counter()
        transport.transfer(Direction.PUSH, local, target, ["tiny", *(f"tiny/f{n:04d}" for n in range(PROBE_FILES))])
        elapsed = time.perf_counter() - started - PROBE_FILES * 1024 / bandwidth
        samples.append(max(elapsed, 0.0) / PROBE_FILES)
    return samples


def _create_rate(transport: Transport, directory: str, remote_python: str) -> float | None:
    """Files/s one process creates (1 KiB each) in ``directory`` at the far side; None if it cannot run there."""
    args = ["-c", _CREATE_PROBE, directory, str(CREATE_PROBE_FILES)]
    if transport.endpoint.is_local:
        output = subprocess.run([sys.executable, *args], capture_output=True, check=True).stdout
    elif transport.capabilities.remote_exec:
        output = transport.run([*shlex.split(remote_python), *args])
    else:
        return None
    return float(output.decode().strip().splitlines()[-1])


def _pack_per_file(local: str) -> float:
    """Seconds one local worker spends per tiny file when packing (scan, header, hash, zstd)."""
    tree = os.path.join(local, "pack-probe")
    os.makedirs(tree)
    for n in range(CREATE_PROBE_FILES):
        with open(os.path.join(tree, f"p{n:05d}"), "wb") as handle:
            handle.write(b"%d," % n * 100)
    started = time.perf_counter()
    pack(tree, os.path.join(local, "probe.tar.zst"), PackOptions(jobs=1))
    return (time.perf_counter() - started) / CREATE_PROBE_FILES


@dataclass(frozen=True)
class CodecRates:
    """zstd on the calibration sample: compress rate at level 3, decompress rate, and per calibrated level
    (CALIBRATED_LEVELS) its compress rate and compressed/raw size; rates in bytes/s of one core."""

    compress: float
    decompress: float
    by_level: tuple[float, ...]
    ratios: tuple[float, ...]


def _codec_rates() -> CodecRates:
    """Each calibrated level compresses a sample of CSV text (rows of random numbers, as workflows write) once."""
    rng = random.Random(0)
    sample = "".join(f"{rng.randrange(10**7)},{1_700_000_000 + rng.randrange(10**6)},s{rng.randrange(64):02d},"
                     f"{rng.uniform(-50, 150):.4f},{rng.choice('ABCD')}\n" for _ in range(CODEC_SAMPLE_ROWS)).encode()
    rates, ratios, packed = [], [], b""
    for level in CALIBRATED_LEVELS:
        started = time.perf_counter()
        out = zstandard.ZstdCompressor(level=level).compress(sample)
        rates.append(len(sample) / max(time.perf_counter() - started, 1e-6))
        ratios.append(round(len(out) / len(sample), 4))
        packed = out if level == 3 else packed
    started = time.perf_counter()
    zstandard.ZstdDecompressor().decompress(packed)
    decompress = len(sample) / max(time.perf_counter() - started, 1e-6)
    return CodecRates(rates[CALIBRATED_LEVELS.index(3)], decompress, tuple(rates), tuple(ratios))
