"""Golden files pin bundle format version 1: same tree and options give these exact bytes."""
from __future__ import annotations

import os
from pathlib import Path

import pytest

from bundles import FORMAT_VERSION, Bundle, PackOptions, pack, unpack, verify_bundle
from tests.conftest import assert_same_tree

# the shared tests of both engines (see tests/test_native_parity.py)
pytestmark = pytest.mark.usefixtures("each_engine")

GOLDEN = Path(__file__).parent / "golden"
EARLIER_CUTS = GOLDEN / "earlier-cuts"      # written before shards were cut by content: still read as they are
CASES = [("zstd", "v1.tar.zst"), ("gzip", "v1.tar.gz"), ("none", "v1.tar")]


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


def test_format_version_is_1():
    assert FORMAT_VERSION == 1


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
@pytest.mark.parametrize("codec,name", CASES)
def test_golden_bundles_still_read_verify_and_unpack(tmp_path, codec, name, where):
    with Bundle.open(where / name) as bundle:
        assert bundle.index.codec == codec and len(bundle.index.shards) > 1
        assert verify_bundle(bundle).ok
    unpack(where / name, tmp_path / "out")
    assert_same_tree(make_golden_tree(tmp_path / "src"), tmp_path / "out")
