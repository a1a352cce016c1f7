"""Decompression bombs and false size claims in a bundle's shards: refused in one line, within bounded memory
(each unpack runs under `prlimit --as`, so a claimed size that were allocated would fail the process)."""
from __future__ import annotations

import dataclasses
import io
import shutil
import subprocess
from pathlib import Path

import pytest
import zstandard

from bundles import Bundle, container, pack
from bundles.index import content_hash
from tests.programs import program, user_env

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
