"""A consistent, self-hashed index whose entries are not covered by exactly one shard is refused by every reader
(unpack, mpi_stager, verify, mount, pallet://), naming the bundle and the entry; nothing is created or served."""
from __future__ import annotations

import dataclasses
import os
import shutil
import subprocess
import textwrap
import time
from array import array
from pathlib import Path

import pytest

from bundles import Bundle, CorruptBundleError, container
from bundles.index import Index, content_hash
from bundles.tarformat import Kind
from tests.conftest import make_files, run_pallet
from tests.programs import program, python_module, user_env

pytestmark = pytest.mark.usefixtures("each_engine")
needs_fuse = pytest.mark.skipif(not os.path.exists("/dev/fuse") or not shutil.which("fusermount3"),
                                reason="FUSE is not available (./bootstrap.sh installs fuse3)")


@pytest.fixture(scope="module")
def sharded(tmp_path_factory) -> str:
    """A real bundle of 60 files in 3 directories, cut into several shards."""
    root = tmp_path_factory.mktemp("sharded")
    src = make_files(root / "src", 60, 3, lambda n: bytes([65 + n % 26]) * 3000)
    bundle = str(root / "good.tar.zst")
    run_pallet("pack", "--quiet", "--shard-size", "64K", src, bundle, check=True)
    with Bundle.open(bundle) as opened:
        assert len(opened.index.shards) >= 3
    return bundle


def _append_entry(index: Index, path: bytes, kind: Kind, link: bytes, shard: int, data_offset: int,
                  size: int, digest: bytes) -> None:
    """Add one entry after the last one, in no shard's entry range (the shards are left as they are)."""
    for column, value in (("paths", path), ("links", link)):
        getattr(index, column).append(value)
    for column, value in (("kinds", int(kind)), ("modes", 0o644), ("mtimes", 0), ("sizes", size),
                          ("link_groups", -1), ("shard_of", shard), ("offsets", 0), ("data_offsets", data_offset)):
        getattr(index, column).append(value)
    index.hashes += digest


def _file_past_the_last_shard(index: Index, raw: bytes) -> str:
    """A file whose content is the first tar header of shard 0 (what a reader that trusts it would serve)."""
    header = raw[:512]
    _append_entry(index, b"extra.txt", Kind.FILE, b"", 0, 0, len(header), content_hash(header))
    return "extra.txt"


def _symlink_past_the_last_shard(index: Index, raw: bytes) -> str:
    _append_entry(index, b"evil-link", Kind.SYMLINK, b"d0", len(index.shards) - 1, 0, 0, bytes(16))
    return "evil-link"


def _gap_between_shards(index: Index, raw: bytes) -> str:
    shard = index.shards[1]
    index.shards[1] = dataclasses.replace(shard, first_entry=shard.first_entry + 1,
                                          entry_count=shard.entry_count - 1)
    return index.entry(shard.first_entry).name


def _overlapping_shards(index: Index, raw: bytes) -> str:
    shard = index.shards[1]
    index.shards[1] = dataclasses.replace(shard, first_entry=shard.first_entry - 1,
                                          entry_count=shard.entry_count + 1)
    return index.entry(shard.first_entry - 1).name


def _shard_past_the_entries(index: Index, raw: bytes) -> str:
    last = index.shards[-1]
    index.shards[-1] = dataclasses.replace(last, entry_count=last.entry_count + 1)
    return "shard " + str(last.number)


def _shard_column_names_another_shard(index: Index, raw: bytes) -> str:
    i = next(i for i in range(index.shards[1].first_entry, len(index)) if index.kinds[i] == Kind.FILE)
    index.shard_of[i] = 0
    return index.entry(i).name


LIES = {
    "a file past the last shard": _file_past_the_last_shard,
    "a symlink past the last shard": _symlink_past_the_last_shard,
    "a gap between shards": _gap_between_shards,
    "overlapping shards": _overlapping_shards,
    "a shard past the last entry": _shard_past_the_entries,
    "an entry whose shard column names another shard": _shard_column_names_another_shard,
}


def _lying(good: str, out: Path, lie) -> tuple[Path, str]:
    """``good`` with its embedded index changed by ``lie`` (self-hashed, consistent); returns it and the name
    the refusal must give."""
    with Bundle.open(good) as bundle:
        index = bundle.index
        locator = container.read_locator(bundle.fd, bundle.size, bundle.codec.name)
        raw = bundle.codec.decompress(bundle.read_shard(index.shards[0]), index.shards[0].raw_size)
    named = lie(index, raw)
    data = Path(good).read_bytes()[:locator.data_end]
    out.write_bytes(data + container.index_section(index.codec, index.to_bytes(), locator.data_end))
    return out, named


def _assert_refused(done: subprocess.CompletedProcess, bundle: Path, named: str) -> None:
    assert done.returncode == 1, (done.returncode, done.stdout, done.stderr)
    assert "Traceback" not in done.stderr and "internal error" not in done.stderr, done.stderr
    assert str(bundle) in done.stderr and "shard" in done.stderr and named in done.stderr, done.stderr


def _run(*argv: str) -> subprocess.CompletedProcess:
    return subprocess.run(list(argv), capture_output=True, text=True, env=user_env(), stdin=subprocess.DEVNULL,
                          timeout=120)


@pytest.mark.parametrize("lie", LIES, ids=list(LIES))
def test_unpack_verify_and_mpi_stager_refuse_an_entry_not_in_exactly_one_shard(sharded, tmp_path, lie):
    bundle, named = _lying(sharded, tmp_path / "lying.tar.zst", LIES[lie])
    for argv in ([program("pallet"), "unpack", str(bundle), str(tmp_path / "dest")],
                 [*python_module("mpi_stager"), "unpack", str(bundle), str(tmp_path / "dest2")],
                 [program("pallet"), "verify", str(bundle)]):
        _assert_refused(_run(*argv), bundle, named)
    for dest in ("dest", "dest2"):
        created = [p.name for p in (tmp_path / dest).rglob("*")] if (tmp_path / dest).exists() else []
        assert "evil-link" not in created and "extra.txt" not in created, created


_OPEN_WITH_FSSPEC = """
import sys, fsspec
from bundles import BundleError
try:
    fs = fsspec.filesystem("pallet", fo=sys.argv[1], skip_instance_cache=True)
    print("served:", len(fs.cat_file(sys.argv[2])) if fs.exists(sys.argv[2]) else "(not listed)", "bytes")
except BundleError as exc:
    print("refused:", exc)
"""


@pytest.mark.parametrize("lie", ["a file past the last shard", "an entry whose shard column names another shard"])
def test_pallet_fsspec_refuses_the_index_instead_of_serving_header_bytes(sharded, tmp_path, lie):
    bundle, named = _lying(sharded, tmp_path / "lying.tar.zst", LIES[lie])
    done = _run(program("python"), "-c", textwrap.dedent(_OPEN_WITH_FSSPEC), str(bundle), named)
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith(f"refused: {bundle}:") and named in done.stdout, done.stdout


@needs_fuse
@pytest.mark.parametrize("lie", ["a file past the last shard", "a symlink past the last shard"])
def test_pallet_mount_refuses_the_index(sharded, tmp_path, lie):
    bundle, named = _lying(sharded, tmp_path / "lying.tar.zst", LIES[lie])
    mountpoint = tmp_path / "mnt"
    mountpoint.mkdir()
    done = run_pallet("mount", "--log", str(tmp_path / "mount.log"), str(bundle), str(mountpoint), timeout=120)
    if done.returncode == 0:                # mounted: look at what it serves, then take it down
        served = sorted(os.listdir(mountpoint))
        subprocess.run(["fusermount3", "-u", str(mountpoint)], check=False, timeout=60)
        time.sleep(0.5)
        pytest.fail(f"the lying index was mounted, serving {served}")
    assert "Traceback" not in done.stderr and str(bundle) in done.stderr and named in done.stderr, done.stderr
    assert os.listdir(mountpoint) == [] and not os.path.ismount(mountpoint)


def test_the_check_names_the_first_uncovered_entry_in_process(sharded, tmp_path):
    bundle, named = _lying(sharded, tmp_path / "lying.tar.zst", _gap_between_shards)
    with pytest.raises(CorruptBundleError, match=named) as refused:
        Bundle.open(bundle)
    assert refused.value.path == str(bundle)


def test_an_honest_index_of_a_million_entries_is_checked_in_well_under_a_second():
    """The check is columnar: a million entries in 1,000 shards cost a few milliseconds, not a Python loop."""
    entries, shards = 1_000_000, 1_000
    index = Index("zstd", 3, 4 << 20)
    per = entries // shards
    index.shard_of = array("I", b"".join(array("I", [n]).tobytes() * per for n in range(shards)))
    index.paths = [b""] * entries
    from bundles.index import Shard
    index.shards = [Shard(n, 0, 0, 0, n * per, per, 0, bytes(16)) for n in range(shards)]
    started = time.perf_counter()
    index.check_shard_ranges("million.pidx")
    assert time.perf_counter() - started < 0.5
    index.shard_of[entries - 1] = 3
    with pytest.raises(CorruptBundleError, match="shard 999"):
        index.check_shard_ranges("million.pidx")
