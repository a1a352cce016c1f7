"""Decompression bombs and false size claims in a bundle's shards: refused in one line, within bounded memory
(each unpack runs under `prlimit --as`, so a claimed size that were allocated would fail the process)."""
from __future__ import annotations

import dataclasses
import io
import random
import shutil
import struct
import subprocess
import tarfile
import time
import zlib
from pathlib import Path

import pytest
import zstandard

from bundles import Bundle, PackOptions, container, pack
from bundles.index import content_hash
from tests.programs import program, python_module, user_env

ADDRESS_SPACE = 1 << 30       # far below the sizes claimed or packed below


def _frame_without_size(data_chunks) -> bytes:
    out = io.BytesIO()
    with zstandard.ZstdCompressor().stream_writer(out, closefd=False) as writer:
        for chunk in data_chunks:
            writer.write(chunk)
    return out.getvalue()


def _frame_of_size(count: int, chunk: bytes) -> bytes:
    """A zstd frame of ``count`` copies of ``chunk`` that declares its content size."""
    out = io.BytesIO()
    with zstandard.ZstdCompressor().stream_writer(out, size=count * len(chunk), closefd=False) as writer:
        for _ in range(count):
            writer.write(chunk)
    return out.getvalue()


def _crafted(tmp_path: Path, frame: bytes, claimed_raw: int) -> Path:
    """A one-shard bundle whose shard is ``frame`` and whose (sidecar) index says it holds ``claimed_raw``."""
    src = tmp_path / "src"
    src.mkdir()
    (src / "file.txt").write_bytes(b"x" * 1000)
    with Bundle.open(pack(src, tmp_path / "good.tar.zst").bundle) as good:
        index = good.index
    index.shards[0] = dataclasses.replace(index.shards[0], offset=0, length=len(frame), hash=content_hash(frame),
                                          raw_size=claimed_raw)
    bundle = tmp_path / "crafted.tar.zst"
    bundle.write_bytes(frame)
    Path(f"{bundle}{container.SIDECAR_SUFFIX}").write_bytes(index.to_bytes())
    return bundle


def _unpack_limited(bundle: Path, dest: Path) -> subprocess.CompletedProcess:
    return subprocess.run(["prlimit", f"--as={ADDRESS_SPACE}", program("pallet"), "unpack", "--quiet", str(bundle),
                           str(dest)], capture_output=True, text=True, env=user_env(), stdin=subprocess.DEVNULL,
                          timeout=120)


def _refused_in_one_line(done: subprocess.CompletedProcess, bundle: Path) -> None:
    assert done.returncode == 1, done.stderr
    assert "Traceback" not in done.stderr and "internal error" not in done.stderr, done.stderr
    assert done.stderr.startswith(f"pallet unpack: error: {bundle}"), done.stderr


pytestmark = [pytest.mark.skipif(shutil.which("prlimit") is None, reason="util-linux prlimit is not installed"),
              pytest.mark.usefixtures("each_engine")]


def test_a_small_frame_claiming_8_gib_is_refused_without_allocating_it(tmp_path):
    bundle = _crafted(tmp_path, _frame_without_size([b"x" * 3072]), 8 << 30)
    _refused_in_one_line(_unpack_limited(bundle, tmp_path / "dest"), bundle)


def test_a_frame_inflating_to_2_gib_is_stopped_at_the_claimed_size(tmp_path):
    zeros = bytes(1 << 20)
    bundle = _crafted(tmp_path, _frame_without_size(zeros for _ in range(2048)), 4096)
    done = _unpack_limited(bundle, tmp_path / "dest")
    _refused_in_one_line(done, bundle)
    assert not any((tmp_path / "dest").glob("file.txt"))


def _with_embedded_index(tmp_path: Path, payload: bytes) -> Path:
    """A real bundle's shards followed by ``payload`` as its embedded index (no sidecar)."""
    src = tmp_path / "src"
    src.mkdir()
    (src / "file.txt").write_bytes(b"x" * 1000)
    good = pack(src, tmp_path / "good.tar.zst").bundle
    with Bundle.open(good) as opened:
        end = container.read_locator(opened.fd, opened.size, opened.codec.name).data_end
    bundle = tmp_path / "crafted.tar.zst"
    bundle.write_bytes(Path(good).read_bytes()[:end] + container.index_section("zstd", payload, end))
    return bundle


@pytest.mark.parametrize("declared", [True, False], ids=["size declared", "size not declared"])
def test_an_index_inflating_to_2_gib_is_refused_early(tmp_path, declared):
    zeros = bytes(1 << 20)
    payload = _frame_of_size(2048, zeros) if declared else _frame_without_size(zeros for _ in range(2048))
    bundle = _with_embedded_index(tmp_path, payload)
    _refused_in_one_line(_unpack_limited(bundle, tmp_path / "dest"), bundle)
    verified = subprocess.run(["prlimit", f"--as={ADDRESS_SPACE}", program("pallet"), "verify", str(bundle)],
                              capture_output=True, text=True, env=user_env(), stdin=subprocess.DEVNULL, timeout=120)
    assert verified.returncode == 1 and "index is" in verified.stderr and "Traceback" not in verified.stderr, \
        verified.stderr


# ---------------------------------------------------------------- every other payload pallet inflates

def _limited(*argv: str) -> subprocess.CompletedProcess:
    return subprocess.run(["prlimit", f"--as={ADDRESS_SPACE}", *argv], capture_output=True, text=True, env=user_env(),
                          stdin=subprocess.DEVNULL, timeout=120)


def _index_readers(bundle: Path, dest: Path) -> dict[str, list[str]]:
    """The commands that read a bundle's index, each as a user runs it."""
    return {"pallet unpack": [program("pallet"), "unpack", "--quiet", str(bundle), str(dest)],
            "mpi_stager unpack": [*python_module("mpi_stager"), "unpack", str(bundle), str(dest / "by-stager")],
            "pallet verify": [program("pallet"), "verify", str(bundle)]}


def _one_line_refusal(done: subprocess.CompletedProcess, bundle: Path, program_name: str) -> None:
    assert done.returncode == 1, (program_name, done.returncode, done.stderr)
    assert "Traceback" not in done.stderr and "internal error" not in done.stderr, done.stderr
    assert done.stderr.startswith(f"{program_name}: error: {bundle}:"), done.stderr


def _gzip_member_of(payload: bytes, zeros: int) -> bytes:
    """A gzip member whose content is ``payload`` then ``zeros`` MiB of zeros: deflated to about 1 KiB per MiB,
    by repeating one byte-aligned piece, so it is made in moments whatever it inflates to."""
    head = zlib.compressobj(9, zlib.DEFLATED, -15)
    first = head.compress(payload) + head.flush(zlib.Z_FULL_FLUSH)
    piece = zlib.compressobj(9, zlib.DEFLATED, -15)
    mib = bytes(1 << 20)
    repeated = piece.compress(mib) + piece.flush(zlib.Z_FULL_FLUSH)
    crc = zlib.crc32(payload)
    for _ in range(zeros):
        crc = zlib.crc32(mib, crc)
    size = (len(payload) + (zeros << 20)) & 0xFFFFFFFF
    return (b"\x1f\x8b\x08\x00" + bytes(4) + b"\x00\xff" + first + repeated * zeros + b"\x03\x00"
            + struct.pack("<II", crc, size))


def test_a_gzip_index_member_inflating_to_3_gib_is_refused_at_once(tmp_path):
    """The issue's case: 3 MB of bundle whose index member holds the real index followed by 3 GiB of zeros
    (which the index's decoder would ignore). It took 6.3 GB and exited 0; pallet stores that member
    uncompressed, so one inflating beyond its stored size is refused, never inflated."""
    src = tmp_path / "src"
    src.mkdir()
    (src / "file.txt").write_bytes(b"x" * 1000)
    good = pack(src, tmp_path / "good.tar.gz", PackOptions(codec="gzip")).bundle
    with Bundle.open(good) as opened:
        end = container.read_locator(opened.fd, opened.size, opened.codec.name).data_end
        payload = opened.index.to_bytes()
    bundle = tmp_path / "bomb.tar.gz"
    bomb = _gzip_member_of(payload, 3 << 10)
    bundle.write_bytes(Path(good).read_bytes()[:end] + container.located("gzip", bomb, end))
    assert bundle.stat().st_size < 4 << 20
    for name, argv in _index_readers(bundle, tmp_path / "dest").items():
        started = time.monotonic()
        _one_line_refusal(_limited(*argv), bundle, name)
        assert time.monotonic() - started < 60, name


def test_an_index_too_large_for_the_memory_limit_is_one_line(tmp_path):
    """An index frame within the decode ratio (2 GiB from more than 2 MiB) that this process cannot hold: the
    allocation fails under `prlimit --as`, and that is pallet's own error, not an internal one."""
    noise = random.Random(7).randbytes(3 << 20)
    out = io.BytesIO()
    with zstandard.ZstdCompressor(level=1).stream_writer(out, size=len(noise) + (2 << 30), closefd=False) as writer:
        writer.write(noise)
        zeros = bytes(16 << 20)
        for _ in range(128):
            writer.write(zeros)
    bundle = _with_embedded_index(tmp_path, out.getvalue())
    for name, argv in _index_readers(bundle, tmp_path / "dest").items():
        done = _limited(*argv)
        _one_line_refusal(done, bundle, name)
        assert "does not fit in this process's memory" in done.stderr, done.stderr


def _pax_member(name: str, kind: bytes, data: bytes = b"", link: str = "") -> bytes:
    info = tarfile.TarInfo(name)
    info.type, info.size, info.linkname, info.mtime = kind, len(data), link, 1_700_000_000
    return info.tobuf(format=tarfile.USTAR_FORMAT) + data + bytes(-len(data) % tarfile.BLOCKSIZE)


def _pax_record(keyword: str, value: bytes) -> bytes:
    body = f" {keyword}=".encode() + value + b"\n"
    digits = len(str(len(body)))
    length = len(body) + digits + (len(str(len(body) + digits)) - digits)
    return str(length).encode() + body


def test_global_pax_headers_are_bounded_over_the_whole_archive(tmp_path):
    """The issue's case: each global pax header adds a record of about 1 MB to those every later member
    inherits (tarfile keeps them all): 70 KB of archive took 3 GB and minutes. They count against one
    budget for the whole archive."""
    archive = tmp_path / "globals.tar.zst"
    with open(archive, "wb") as raw, zstandard.ZstdCompressor(level=3).stream_writer(raw) as writer:
        for n in range(1200):
            writer.write(_pax_member("pax_global_header", tarfile.XGLTYPE, _pax_record(f"g{n}", b"v" * 1_000_000)))
            writer.write(_pax_member(f"f{n}", tarfile.REGTYPE, b"x"))
        writer.write(bytes(2 * tarfile.BLOCKSIZE))
    assert archive.stat().st_size < 200_000
    started = time.monotonic()
    done = _limited(program("pallet"), "unpack", "--quiet", str(archive), str(tmp_path / "dest"))
    _one_line_refusal(done, archive, "pallet unpack")
    assert "global pax headers" in done.stderr and time.monotonic() - started < 60, done.stderr


_READ_A_LISTING = """
import io, sys, types
from bundles.errors import PalletError
from staging_core.far_side.session import _read_listing
block = open(sys.argv[1], "rb").read()
far = types.SimpleNamespace(url="ssh://far/dest", stdout=io.BytesIO(b"listing %d\\n" % len(block) + block))
try:
    print(len(_read_listing(far)), "bytes listed")
except PalletError as exc:
    print("refused:", exc)
"""


def test_a_far_side_listing_inflating_to_2_gib_is_refused_before_it_is_held(tmp_path):
    """The listing a far-side session sends before a push (one zstd frame): decoded within the index's bound
    of its stored size, so a talkative or hostile far side cannot make the pushing side allocate gigabytes."""
    listing = tmp_path / "listing.zst"
    listing.write_bytes(_frame_of_size(2048, bytes(1 << 20)))
    done = _limited(program("python"), "-c", _READ_A_LISTING, str(listing))
    assert done.returncode == 0 and "Traceback" not in done.stderr, done.stderr
    assert done.stdout.startswith("refused: ssh://far/dest: the session's listing is refused"), done.stdout
