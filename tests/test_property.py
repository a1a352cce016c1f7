"""Property-based round trips: random trees survive pack/unpack and GNU tar exactly."""
from __future__ import annotations

import os
import shutil
import subprocess
import tempfile

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from bundles import PackOptions, pack, unpack
from bundles.index import Index
from bundles.tarformat import Kind
from tests.conftest import MTIME_NS, assert_same_tree

NAME_CHARS = st.sampled_from(list("abcXYZ019 -_.~ü日\n"))
NAMES = st.text(NAME_CHARS, min_size=1, max_size=12).filter(lambda n: n not in (".", ".."))
MODES = st.sampled_from([0o700, 0o644, 0o755, 0o600, 0o444])


@st.composite
def trees(draw):
    """A list of operations building a tree: dirs, files, relative symlinks and hard links."""
    dirs = [""]
    ops = []
    for _ in range(draw(st.integers(1, 25))):
        parent = draw(st.sampled_from(dirs))
        name = os.path.join(parent, draw(NAMES))
        kind = draw(st.sampled_from(["dir", "file", "file", "file", "symlink", "hardlink"]))
        if kind == "dir":
            dirs.append(name)
        ops.append((kind, name, draw(st.binary(max_size=3000)), draw(MODES), draw(st.integers(0, 2**33 + 1000))))
    return ops


def build(root: str, ops) -> None:
    os.makedirs(root)
    files, mtimes = [], {}
    for kind, name, data, mode, mtime_s in ops:
        mtimes[name] = mtime_s * 1_000_000_000 + len(data)
        path = os.path.join(root, name)
        if os.path.lexists(path) or not os.path.isdir(os.path.dirname(path)):
            continue
        if kind == "dir":
            os.mkdir(path)
        elif kind == "file" or (kind == "hardlink" and not files):
            with open(path, "wb") as handle:
                handle.write(data)
            os.chmod(path, mode)
            files.append(path)
        elif kind == "hardlink":
            os.link(files[len(data) % len(files)], path)
        else:
            target = os.path.relpath(files[-1], os.path.dirname(path)) if files else "dangling"
            os.symlink(target, path)
    for current, dirnames, filenames in os.walk(root, topdown=False):
        for name in filenames + dirnames:
            path = os.path.join(current, name)
            mtime = mtimes.get(os.path.relpath(path, root), MTIME_NS)
            os.utime(path, ns=(mtime, mtime), follow_symlinks=False)


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(ops=trees(), codec=st.sampled_from(["zstd", "gzip", "none"]), shard_kib=st.sampled_from([1, 4, 64]))
def test_random_trees_round_trip(ops, codec, shard_kib):
    work = tempfile.mkdtemp(prefix="pallet-prop-")
    try:
        src = os.path.join(work, "src")
        build(src, ops)
        bundle = os.path.join(work, "b.tar")
        pack(src, bundle, PackOptions(codec=codec, shard_size=shard_kib * 1024, jobs=2))
        unpack(bundle, os.path.join(work, "out"))
        assert_same_tree(src, os.path.join(work, "out"))
        os.mkdir(os.path.join(work, "tar_out"))
        subprocess.run(["tar", "-xf", bundle, "-C", os.path.join(work, "tar_out")], check=True)
        assert_same_tree(src, os.path.join(work, "tar_out"), whole_seconds=True)
    finally:
        shutil.rmtree(work)


@given(kinds=st.lists(st.sampled_from(list(Kind)), max_size=300))
def test_index_positions_are_the_entries_of_those_kinds_in_order(kinds):
    index = Index("zstd", 3, 1 << 20)
    index.kinds.extend(int(kind) for kind in kinds)
    for wanted in ((Kind.DIR,), (Kind.HARDLINK, Kind.SYMLINK), tuple(Kind)):
        assert index.positions(*wanted) == [i for i, kind in enumerate(kinds) if kind in wanted]
