"""Golden files pin bundle format versions 2 (written) and 1 (still read): same tree and options give these bytes."""
from __future__ import annotations

import os
import shutil
import subprocess
import tarfile
from pathlib import Path

import pytest

from bundles import FORMAT_VERSION, Bundle, PackOptions, pack, unpack, verify_bundle
from bundles.index import READABLE_FORMATS
from tests.conftest import assert_same_tree

# the shared tests of both engines (see tests/test_native_parity.py)
pytestmark = pytest.mark.usefixtures("each_engine")

GOLDEN = Path(__file__).parent / "golden"
EARLIER_CUTS = GOLDEN / "earlier-cuts"      # written before shards were cut by content: still read as they are
CASES = [("zstd", "v2.tar.zst"), ("gzip", "v2.tar.gz"), ("none", "v2.tar")]
READ_CASES = [(codec, name.replace("v2", version), version) for codec, name in CASES for version in ("v1", "v2")]


def make_golden_tree(root: Path) -> Path:
    """A small fixed tree; every mode and mtime is set explicitly, so it is the same everywhere."""
    files = {"README": b"golden tree\n", "data/a.csv": b"1,2,3\n" * 50, "data/b.csv": b"",
             "data/deep/c.txt": "ünïcødé\n".encode(), "bin/run.sh": b"#!/bin/sh\necho hi\n"}
    for rel, content in files.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(content)
        path.chmod(0o755 if rel.endswith(".sh") else 0o644)
    os.symlink("../README", root / "data" / "readme_link")
    os.link(root / "data" / "a.csv", root / "data" / "a_again.csv")
    for n, path in enumerate(sorted(root.rglob("*"), reverse=True)):
        if path.is_dir() and not path.is_symlink():
            path.chmod(0o750)
        os.utime(path, ns=(1_600_000_000_000_000_000 + n * 1_000_000_007,) * 2, follow_symlinks=False)
    return root


def test_format_version_is_2_and_1_is_still_read():
    assert FORMAT_VERSION == 2 and READABLE_FORMATS == (1, 2)


@pytest.mark.parametrize("codec,name", CASES)
def test_packing_the_golden_tree_reproduces_the_golden_bundle(tmp_path, codec, name):
    src = make_golden_tree(tmp_path / "src")
    out = tmp_path / name
    pack(src, out, PackOptions(codec=codec, shard_size=4096, jobs=2))
    if os.environ.get("PALLET_UPDATE_GOLDEN") == "1":
        (GOLDEN / name).write_bytes(out.read_bytes())
        (GOLDEN / (name + ".pidx")).write_bytes(Path(str(out) + ".pidx").read_bytes())
    assert out.read_bytes() == (GOLDEN / name).read_bytes()
    assert Path(str(out) + ".pidx").read_bytes() == (GOLDEN / (name + ".pidx")).read_bytes()


@pytest.mark.parametrize("where", [GOLDEN, EARLIER_CUTS], ids=["current", "earlier-cuts"])
@pytest.mark.parametrize("codec,name,version", READ_CASES)
def test_golden_bundles_still_read_verify_and_unpack(tmp_path, codec, name, version, where):
    if not (where / name).exists():
        assert where == EARLIER_CUTS and version == "v2"     # shards are cut by content since before format 2
        return
    with Bundle.open(where / name) as bundle:
        assert bundle.index.codec == codec and len(bundle.index.shards) > 1
        assert bundle.index.format == int(version[1:])
        assert verify_bundle(bundle).ok
    unpack(where / name, tmp_path / "out")
    assert_same_tree(make_golden_tree(tmp_path / "src"), tmp_path / "out")       # nanosecond mtimes included


def _members(path: Path) -> list[tarfile.TarInfo]:
    with tarfile.open(path) as archive:
        return archive.getmembers()


def test_format_2_headers_are_plain_ustar_with_whole_seconds():
    """Format 2 writes no pax record where ustar holds every value; format 1 wrote an mtime record per entry."""
    tree_mtimes = {info.name.rstrip("/"): info.mtime for info in _members(GOLDEN / "v2.tar")}
    assert all(info.pax_headers == {} for info in _members(GOLDEN / "v2.tar"))
    assert all(float(mtime).is_integer() for mtime in tree_mtimes.values())
    old = _members(GOLDEN / "v1.tar")
    assert sum("mtime" in info.pax_headers for info in old) == len(old) - 1     # one mtime is a whole second
    assert {info.name.rstrip("/"): int(info.mtime) for info in old} == tree_mtimes
    assert (GOLDEN / "v2.tar").stat().st_size < (GOLDEN / "v1.tar").stat().st_size


@pytest.mark.skipif(shutil.which("tar") is None, reason="needs GNU tar")
@pytest.mark.parametrize("codec,name", CASES)
def test_gnu_tar_extracts_format_2_with_whole_seconds(tmp_path, codec, name):
    """GNU tar restores the tree from a format 2 bundle with each mtime cut to its whole seconds, as from its
    own default format; pallet's unpack keeps the nanoseconds (the test above)."""
    out = tmp_path / "out"
    out.mkdir()
    subprocess.run(["tar", "-xf", str(GOLDEN / name), "-C", str(out)], check=True)
    src = make_golden_tree(tmp_path / "src")
    for path in [src, *sorted(src.rglob("*"))]:
        mine, theirs = path.lstat(), (out / path.relative_to(src)).lstat()
        assert theirs.st_mtime_ns == mine.st_mtime_ns // 1_000_000_000 * 1_000_000_000 or path == src, path
        assert (theirs.st_mode, theirs.st_size) == (mine.st_mode, mine.st_size), path
