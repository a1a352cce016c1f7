"""unpack and verify stay within the documented peak-memory formula (bundles.memory), checked under `prlimit --as`."""
from __future__ import annotations

import os
import shutil
import subprocess
import tarfile
from pathlib import Path

import pytest
import zstandard

from bundles import Bundle
from bundles.memory import BASE_BYTES, peak_bytes
from tests.conftest import assert_same_tree, make_files, run_pallet
from tests.programs import program, user_env

pytestmark = [pytest.mark.skipif(shutil.which("prlimit") is None, reason="util-linux prlimit is not installed"),
              pytest.mark.usefixtures("each_engine")]
WORKERS = 2
LARGE = 256 << 20


def _limited(limit: int, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(["prlimit", f"--as={limit}", program("pallet"), *args], capture_output=True, text=True,
                          env=user_env(), stdin=subprocess.DEVNULL, timeout=300)


@pytest.fixture(scope="module")
def mixed_bundle(tmp_path_factory) -> str:
    """5,000 small files in 8 MiB shards and one 256 MiB file (streamed through its own shard)."""
    root = tmp_path_factory.mktemp("memory")
    src = make_files(root / "src", 5000, 50, lambda n: os.urandom(200) * (1 + n % 10))
    with open(Path(src) / "large.bin", "wb") as handle:
        handle.truncate(LARGE)
    run_pallet("pack", "--quiet", "--shard-size", "8M", src, str(root / "mixed.tar.zst"), check=True)
    return str(root / "mixed.tar.zst")


def test_unpack_and_verify_fit_in_the_formula(mixed_bundle, tmp_path):
    with Bundle.open(mixed_bundle) as bundle:
        limit = peak_bytes(bundle.index, WORKERS)
    assert limit < LARGE, "the formula must stay below the input's largest file"
    unpacked = _limited(limit, "unpack", "--quiet", "--jobs", str(WORKERS), mixed_bundle, str(tmp_path / "dest"))
    assert unpacked.returncode == 0, unpacked.stderr
    assert os.path.getsize(tmp_path / "dest" / "large.bin") == LARGE
    verified = _limited(limit, "verify", "--jobs", str(WORKERS), mixed_bundle, str(tmp_path / "dest"))
    assert verified.returncode == 0, verified.stderr


def test_the_limit_binds_below_the_formula(tmp_path):
    """A control: with one shard of 48 MiB (a target above twice the tree's size), a limit that leaves out
    the shard term is too small, so the check above is a real bound, not a limit that nothing reaches."""
    src = make_files(tmp_path / "src", 12, 1, lambda n: os.urandom(1 << 20) * 4)
    bundle = tmp_path / "big-shards.tar.zst"
    run_pallet("pack", "--quiet", "--shard-size", "128M", src, str(bundle), check=True)
    with Bundle.open(bundle) as opened:
        assert max(s.raw_size for s in opened.index.shards) >= 40 << 20
        enough = peak_bytes(opened.index, 1)
    assert _limited(enough, "verify", "--jobs", "1", str(bundle)).returncode == 0
    assert _limited(BASE_BYTES, "verify", "--jobs", "1", str(bundle)).returncode != 0


@pytest.fixture(scope="module")
def one_large_shard(tmp_path_factory) -> tuple[str, str]:
    """1,280 files of 256 KiB (zeros) cut as one shard of 320 MiB by a large --shard-size: the tree and bundle."""
    root = tmp_path_factory.mktemp("one-shard")
    src = make_files(root / "src", 1280, 16, lambda n: bytes(256 << 10))
    run_pallet("pack", "--quiet", "--shard-size", "1G", src, str(root / "one-shard.tar.zst"), check=True)
    return src, str(root / "one-shard.tar.zst")


def test_a_shard_cut_at_a_large_shard_size_is_unpacked_and_verified_as_a_stream(one_large_shard, tmp_path):
    """Held whole, the shard alone would need its 320 MiB decoded; the formula counts it as stream buffers,
    and unpack and verify fit in it."""
    src, bundle = one_large_shard
    with Bundle.open(bundle) as opened:
        assert len(opened.index.shards) == 1 and opened.index.shards[0].raw_size >= 320 << 20
        limit = peak_bytes(opened.index, 1)
    assert limit < 300 << 20
    unpacked = _limited(limit, "unpack", "--quiet", "--jobs", "1", bundle, str(tmp_path / "dest"))
    assert unpacked.returncode == 0, unpacked.stderr
    assert_same_tree(src, tmp_path / "dest")
    verified = _limited(limit, "verify", "--jobs", "1", bundle, str(tmp_path / "dest"))
    assert verified.returncode == 0, verified.stderr


PLAIN_ADDRESS_SPACE = 1 << 30       # docs/cli.md: a plain archive unpacks within 1 GiB, whatever its headers hold


def test_global_pax_records_are_not_copied_into_every_member_kept(tmp_path):
    """One global pax header of 60,000 records (within the 1 MiB budget), then 5,000 symlinks: tarfile copies
    the global records into every member, and each symlink is kept until the end (40 KB of archive took
    more than 1 GiB). Only the records tarfile applies are kept, and it unpacks within the bound."""
    from tests.test_bombs import _pax_member, _pax_record
    records = b"".join(_pax_record(f"k{n}", b"v") for n in range(60_000))
    assert len(records) < 1 << 20
    members = [_pax_member("pax_global_header", tarfile.XGLTYPE, records), _pax_member("t", tarfile.REGTYPE, b"x")]
    members += [_pax_member(f"l{n}", tarfile.SYMTYPE, link="t") for n in range(5000)]
    archive = tmp_path / "records.tar.zst"
    archive.write_bytes(zstandard.ZstdCompressor(level=19).compress(b"".join(members) + bytes(1024)))
    done = _limited(PLAIN_ADDRESS_SPACE, "unpack", "--quiet", str(archive), str(tmp_path / "dest"))
    assert done.returncode == 0, done.stderr
    assert len(os.listdir(tmp_path / "dest")) == 5001 and os.readlink(tmp_path / "dest" / "l4999") == "t"
