"""Extraction safety with real files: crafted plain archives and bundles whose index was tampered with.

Every test unpacks into DEST inside a sandbox that also holds an "outside"
directory (the target of every escape attempt) and checks that nothing but
DEST changed.
"""
from __future__ import annotations

import dataclasses
import gzip
import io
import os
import shutil
import tarfile
from pathlib import Path

import pytest
import zstandard

from bundles import Bundle, Kind, PackOptions, PalletError, UnsafeMemberError, container, pack, unpack
from bundles.errors import CorruptBundleError
from tests.conftest import run_pallet, snapshot

# the shared tests of both engines (see tests/test_native_parity.py)
pytestmark = pytest.mark.usefixtures("each_engine")

VICTIM = b"outside content that must never change\n"
COMPRESS = {".tar": bytes, ".tar.gz": gzip.compress, ".tar.zst": zstandard.ZstdCompressor().compress}


# ---------------------------------------------------------------- helpers

@pytest.fixture
def sandbox(tmp_path):
    """tmp/sandbox/{dest/, outside/victim.txt, outside/sub/}; returns (dest, outside, snapshot before)."""
    box = tmp_path / "sandbox"
    (box / "outside" / "sub").mkdir(parents=True)
    (box / "outside" / "victim.txt").write_bytes(VICTIM)
    (box / "dest").mkdir()
    return box / "dest", box / "outside", _outside_dest(box)


def _outside_dest(box) -> dict:
    return {rel: value for rel, value in snapshot(box).items() if not (rel + b"/").startswith(b"dest/")}


def assert_outside_unchanged(dest, before: dict) -> None:
    assert _outside_dest(dest.parent) == before
    assert (dest.parent / "outside" / "victim.txt").read_bytes() == VICTIM


def unpack_refused(archive, dest) -> dict[str, str]:
    """Unpack, expect UnsafeMemberError; return {member name: reason} and check the message names each."""
    with pytest.raises(UnsafeMemberError) as caught:
        unpack(archive, dest)
    refused = dict(caught.value.members)
    assert len(refused) == len(caught.value.members), "a member is named twice"
    for name in refused:
        assert repr(name) in str(caught.value)
    return refused


def assert_cli_refuses(archive, dest, names) -> None:
    done = run_pallet("unpack", str(archive), str(dest))
    assert done.returncode == 1, done.stderr
    assert "refusing to extract" in done.stderr
    for name in names:
        assert repr(name) in done.stderr, name


def tar_member(name: str, kind: bytes = tarfile.REGTYPE, data: bytes = b"data", link: str = "",
               mode: int = 0o644) -> tuple[tarfile.TarInfo, bytes]:
    info = tarfile.TarInfo(name)
    info.type, info.linkname, info.mode, info.mtime = kind, link, mode, 1_700_000_000
    info.size = len(data) if kind == tarfile.REGTYPE else 0
    return info, data


def write_tar(path, members) -> None:
    """Write ``members`` as a pax tar, compressed according to the suffix of ``path``."""
    raw = io.BytesIO()
    with tarfile.open(fileobj=raw, mode="w", format=tarfile.PAX_FORMAT) as archive:
        for info, data in members:
            archive.addfile(info, io.BytesIO(data) if info.isreg() else None)
    suffix = next(s for s in (".tar.gz", ".tar.zst", ".tar") if str(path).endswith(s))
    path.write_bytes(COMPRESS[suffix](raw.getvalue()))


# ---------------------------------------------------------------- plain archives

def unsafe_plain_members(outside) -> tuple[list, set[str]]:
    """A stream mixing safe members with one of each unsafe kind; returns (members, unsafe names)."""
    sym, lnk, dev = tarfile.SYMTYPE, tarfile.LNKTYPE, tarfile.CHRTYPE
    members = [
        tar_member("ok.txt", data=b"fine"),
        tar_member("sub", tarfile.DIRTYPE),
        tar_member(f"{outside}/abs_file"),
        tar_member("../outside/dotdot_file"),
        tar_member("sub/../../outside/dotdot_inner"),
        tar_member("abs_link", sym, link=str(outside)),
        tar_member("climb", sym, link="../outside"),
        tar_member("sub/climb2", sym, link="../../outside/victim.txt"),
        tar_member("x", sym, link="l/.."),               # checked before `l` is even seen
        tar_member("l", sym, link="."),                  # itself fine: resolves to DEST
        tar_member("y", sym, link="sub/../l/.."),
        tar_member("hard_abs", lnk, link=str(outside / "victim.txt")),
        tar_member("hard_up", lnk, link="../outside/victim.txt"),
        tar_member("hard_missing", lnk, link="not_in_archive.txt"),
        tar_member("a", sym, link=str(outside)),
        tar_member("a/f", data=b"through an absolute symlink"),
        tar_member("b", sym, link=".."),
        tar_member("b/outside/f", data=b"through a climbing symlink"),
        tar_member("s", sym, link="sub"),
        tar_member("s/f", data=b"through a symlink inside DEST"),
        tar_member("chr", dev), tar_member("blk", tarfile.BLKTYPE), tar_member("fifo", tarfile.FIFOTYPE),
        tar_member("last.txt", data=b"after the unsafe ones"),
    ]
    safe = {"ok.txt", "sub", "l", "s", "last.txt"}
    return members, {info.name for info, _ in members} - safe


@pytest.mark.parametrize("suffix", list(COMPRESS))
def test_plain_archive_refuses_every_unsafe_member_and_writes_nothing_outside(tmp_path, sandbox, suffix):
    dest, outside, before = sandbox
    members, unsafe = unsafe_plain_members(outside)
    archive = tmp_path / f"evil{suffix}"
    write_tar(archive, members)
    refused = unpack_refused(archive, dest)
    assert set(refused) == unsafe
    assert "absolute" in refused[f"{outside}/abs_file"] and "'..'" in refused["../outside/dotdot_file"]
    assert "through a symlink" in refused["a/f"] and "device" in refused["fifo"]
    assert_outside_unchanged(dest, before)
    for name in unsafe - {f"{outside}/abs_file"}:
        assert not os.path.lexists(dest / name), name
    assert (dest / "ok.txt").read_bytes() == b"fine" and (dest / "last.txt").is_file()
    assert os.readlink(dest / "l") == "." and os.readlink(dest / "s") == "sub"


def test_plain_symlink_check_does_not_depend_on_member_order(tmp_path, sandbox):
    dest, outside, before = sandbox
    for order, members in enumerate(([("x", "l/.."), ("l", ".")], [("l", "."), ("x", "l/..")])):
        write_tar(tmp_path / f"o{order}.tar", [tar_member(n, tarfile.SYMTYPE, link=t) for n, t in members])
        assert set(unpack_refused(tmp_path / f"o{order}.tar", dest / str(order))) == {"x"}
        assert not os.path.lexists(dest / str(order) / "x")
    assert_outside_unchanged(dest, before)


def test_plain_hard_link_to_a_name_that_became_a_symlink_is_refused(tmp_path, sandbox):
    """File a/b/u, then symlink a/b/u (safe from a/b), then hard link h -> a/b/u: h would be that symlink at DEST."""
    dest, outside, before = sandbox
    write_tar(tmp_path / "h.tar", [
        tar_member("a", tarfile.DIRTYPE), tar_member("a/b", tarfile.DIRTYPE), tar_member("a/b/u"),
        tar_member("a/b/u", tarfile.SYMTYPE, link="../outside/victim.txt"),    # DEST/a/outside/victim.txt
        tar_member("h", tarfile.LNKTYPE, link="a/b/u"),                       # from DEST: sandbox/outside
    ])
    assert set(unpack_refused(tmp_path / "h.tar", dest)) == {"h"}
    assert not os.path.lexists(dest / "h") and os.readlink(dest / "a/b/u") == "../outside/victim.txt"
    assert_outside_unchanged(dest, before)


@pytest.mark.parametrize("suffix", [".tar.gz", ".tar.zst"])
def test_plain_cli_exits_1_naming_each_unsafe_member(tmp_path, sandbox, suffix):
    dest, outside, before = sandbox
    members, unsafe = unsafe_plain_members(outside)
    write_tar(tmp_path / f"evil{suffix}", members)
    assert_cli_refuses(tmp_path / f"evil{suffix}", dest, unsafe)
    assert_outside_unchanged(dest, before)


def test_plain_setuid_and_setgid_bits_are_stripped(tmp_path, sandbox):
    dest, _, before = sandbox
    write_tar(tmp_path / "modes.tar.zst", [
        tar_member("sgid_dir", tarfile.DIRTYPE, mode=0o2775),
        tar_member("sgid_dir/suid", mode=0o6755), tar_member("sticky", tarfile.DIRTYPE, mode=0o1777)])
    unpack(tmp_path / "modes.tar.zst", dest)
    assert os.stat(dest / "sgid_dir").st_mode & 0o7777 == 0o775
    assert os.stat(dest / "sgid_dir" / "suid").st_mode & 0o7777 == 0o755
    assert os.stat(dest / "sticky").st_mode & 0o7777 == 0o1777
    assert_outside_unchanged(dest, before)


# ---------------------------------------------------------------- pre-existing symlinks in DEST

def _source_tree(root) -> None:
    (root / "d").mkdir(parents=True)
    (root / "f.txt").write_bytes(b"from the archive")
    (root / "d" / "g.txt").write_bytes(b"in d")


def _archive(kind: str, tmp_path):
    src = tmp_path / "pre_src"
    _source_tree(src)
    if kind.startswith("indexed"):        # "indexed-streamed": each file is a shard written as a stream
        options = PackOptions(shard_size=8 if kind.endswith("streamed") else None)
        return pack(src, tmp_path / "pre.tar.zst", options).bundle
    members = [tar_member("f.txt", data=b"from the archive"), tar_member("d", tarfile.DIRTYPE),
               tar_member("d/g.txt", data=b"in d")]
    write_tar(tmp_path / "pre.tar.gz", members if kind == "plain" else members[:1] + members[2:])
    return tmp_path / "pre.tar.gz"


KINDS = ["indexed", "indexed-streamed", "plain", "plain-no-dir-member"]


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("link", [os.symlink, os.link])
def test_existing_link_at_a_file_path_is_replaced_not_written_through(tmp_path, sandbox, kind, link):
    dest, outside, before = sandbox
    link(outside / "victim.txt", dest / "f.txt")
    unpack(_archive(kind, tmp_path), dest)
    assert not os.path.islink(dest / "f.txt") and (dest / "f.txt").read_bytes() == b"from the archive"
    assert os.stat(dest / "f.txt").st_nlink == 1
    assert_outside_unchanged(dest, before)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("target", ["../outside/sub", "ABS"])
def test_existing_symlink_at_a_parent_directory_is_not_written_through(tmp_path, sandbox, kind, target):
    dest, outside, before = sandbox
    os.symlink(str(outside / "sub") if target == "ABS" else target, dest / "d")
    archive = _archive(kind, tmp_path)
    with pytest.raises(PalletError):
        unpack(archive, dest)
    assert os.path.islink(dest / "d") and os.listdir(outside / "sub") == []
    assert_outside_unchanged(dest, before)
    done = run_pallet("unpack", str(archive), str(dest))
    assert done.returncode == 1 and os.path.join("dest", "d") in done.stderr


def test_existing_symlink_at_the_marker_path_is_not_written_through(tmp_path, sandbox):
    dest, _, before = sandbox
    (dest / ".pallet").mkdir()
    os.symlink("../../outside/victim.txt", dest / ".pallet" / "INCOMPLETE")
    try:
        unpack(_archive("indexed", tmp_path), dest)
    finally:
        assert_outside_unchanged(dest, before)


# ---------------------------------------------------------------- bundles with a tampered index

def write_tampered(good: str, out, mutate, where: str):
    """Copy ``good`` to ``out`` with its index changed by ``mutate``, embedded or as the only (sidecar) copy."""
    with Bundle.open(good) as bundle:
        index = bundle.index
        locator = container.read_locator(bundle.fd, bundle.size, bundle.codec.name)
    mutate(index, index.paths.index)
    data = Path(good).read_bytes()[:locator.data_end]          # the shards only
    if where == "embedded":
        data += container.index_section(index.codec, index.to_bytes(), locator.data_end)
    else:
        Path(f"{out}{container.SIDECAR_SUFFIX}").write_bytes(index.to_bytes())
    out.write_bytes(data)
    with Bundle.open(out) as check:          # really an indexed bundle, holding the tampered index
        assert check.index is not None and check.index.paths == index.paths
    return out


def _set(column: str, path: bytes, value):
    """Mutation setting one cell; ``value`` may be a function of (index, position finder)."""
    def mutate(index, at):
        getattr(index, column)[at(path)] = value(index, at) if callable(value) else value
    return mutate


def _all(*mutations):
    def mutate(index, at):
        for change in mutations:
            change(index, at)
    return mutate


OUTSIDE_ABS = "/OUTSIDE"   # in TAMPERINGS: stands for the sandbox's outside directory


TAMPERINGS = {
    "absolute path": (_set("paths", b"top.txt", b"/OUTSIDE/evil"), {"/OUTSIDE/evil"}),
    "dotdot": (_set("paths", b"top.txt", b"../outside/evil"), {"../outside/evil"}),
    "inner dotdot": (_set("paths", b"dir/file.txt", b"dir/../../outside/evil"), {"dir/../../outside/evil"}),
    "symlink absolute": (_set("links", b"sym", b"/OUTSIDE/victim.txt"), {"sym"}),
    "symlink climbing": (_set("links", b"sym", b"../outside"), {"sym"}),
    "symlink x -> l/.. with l -> . after x": (
        _all(_set("links", b"sym", b"sym2/.."), _set("links", b"sym2", b".")), {"sym"}),
    "symlink x -> l/.. with l -> . before x": (
        _all(_set("links", b"sym", b"."), _set("links", b"sym2", b"dir/../sym/..")), {"sym2"}),
    "hard link outside": (_set("links", b"hard_b", b"../outside/victim.txt"), {"hard_b"}),
    "hard link absolute": (_set("links", b"hard_b", b"/OUTSIDE/victim.txt"), {"hard_b"}),
    "hard link to a directory": (
        _all(_set("links", b"hard_b", b"dir"), _set("link_groups", b"hard_b", lambda ix, at: at(b"dir"))), {"hard_b"}),
    "hard link to nothing": (_set("link_groups", b"hard_b", -1), {"hard_b"}),
    "hard link to a later file": (_all(_set("links", b"hard_b", b"dir/file.txt"),
                                       _set("link_groups", b"hard_b", lambda ix, at: at(b"dir/file.txt"))), {"hard_b"}),
    "hard link to a refused member": (
        _all(_set("paths", b"hard_a", b"../outside/victim.txt"), _set("links", b"hard_b", b"../outside/victim.txt")),
        {"../outside/victim.txt", "hard_b"}),
    "written through an absolute symlink": (
        _all(_set("kinds", b"dir", Kind.SYMLINK), _set("links", b"dir", b"/OUTSIDE")), {"dir", "dir/file.txt"}),
    "written through a climbing symlink": (
        _all(_set("kinds", b"dir", Kind.SYMLINK), _set("links", b"dir", b"..")), {"dir", "dir/file.txt"}),
    "unknown entry type (no kind stands for devices or FIFOs)": (_set("kinds", b"top.txt", 4), {"top.txt"}),
    "duplicate name": (_set("paths", b"suid", b"top.txt"), {"top.txt"}),
}


def _resolve(mutate, outside):
    """Turn /OUTSIDE in the values a mutation writes into the sandbox's real outside directory."""
    def wrapped(index, at):
        mutate(index, at)
        placeholder, real = os.fsencode(OUTSIDE_ABS), os.fsencode(outside)
        index.paths = [p.replace(placeholder, real) for p in index.paths]
        index.links = [p.replace(placeholder, real) for p in index.links]
    return wrapped


@pytest.mark.parametrize("where", ["embedded", "sidecar"])
@pytest.mark.parametrize("case", list(TAMPERINGS))
def test_tampered_index_is_refused_before_anything_is_written(tmp_path, sandbox, good_bundle, case, where):
    dest, outside, before = sandbox
    mutate, expected = TAMPERINGS[case]
    bundle = write_tampered(good_bundle, tmp_path / "evil.tar.zst", _resolve(mutate, outside), where)
    refused = unpack_refused(bundle, dest)
    assert set(refused) == {name.replace(OUTSIDE_ABS, str(outside)) for name in expected}
    assert os.listdir(dest) == []
    assert_outside_unchanged(dest, before)
    shutil.rmtree(dest)
    unpack_refused(bundle, dest)
    assert not dest.exists()


def test_tampered_index_cli_exits_1_naming_each_member_and_creates_nothing(tmp_path, sandbox, good_bundle):
    dest, outside, before = sandbox
    cases = ("absolute path", "symlink climbing", "hard link outside", "written through a climbing symlink")
    mutate = _resolve(_all(*(TAMPERINGS[c][0] for c in cases)), outside)
    bundle = write_tampered(good_bundle, tmp_path / "evil.tar.zst", mutate, "embedded")
    shutil.rmtree(dest)
    names = {f"{outside}/evil", "sym", "hard_b", "dir", "dir/file.txt"}
    assert_cli_refuses(bundle, dest, names)
    assert not dest.exists()
    assert_outside_unchanged(dest, before)


def test_setuid_and_setgid_modes_are_stripped(tmp_path, sandbox):
    dest, _, before = sandbox
    src = tmp_path / "modes"
    (src / "dir").mkdir(parents=True)
    (src / "suid").write_bytes(b"suid")
    (src / "top.txt").write_bytes(b"top")
    os.symlink("top.txt", src / "sym")
    os.chmod(src / "suid", 0o6755)
    os.chmod(src / "dir", 0o2775)
    bundle = pack(src, tmp_path / "modes.tar.zst").bundle
    unpack(bundle, dest)
    assert os.stat(dest / "suid").st_mode & 0o7777 == 0o755
    assert os.stat(dest / "dir").st_mode & 0o7777 == 0o775
    assert (dest / "suid").read_bytes() == b"suid" and os.readlink(dest / "sym") == "top.txt"
    assert_outside_unchanged(dest, before)


def test_an_index_that_disagrees_with_the_tar_headers_is_refused(tmp_path, sandbox, good_bundle):
    dest, _, before = sandbox
    bundle = write_tampered(good_bundle, tmp_path / "modes.tar.zst", _set("modes", b"suid", 0o6755), "sidecar")
    with pytest.raises(CorruptBundleError, match="do not match the index at 'suid'"):
        unpack(bundle, dest)
    assert not (dest / "suid").exists()
    assert_outside_unchanged(dest, before)


def test_a_member_the_index_omits_is_refused_by_unpack_and_verify(tmp_path, sandbox):
    dest, _, before = sandbox
    src = tmp_path / "omit"
    src.mkdir()
    (src / "a.txt").write_bytes(b"listed")
    (src / "zz-hidden").write_bytes(b"not in the index")
    good = pack(src, tmp_path / "omit.tar.zst").bundle

    def drop_last(index, at):
        assert index.paths[-1] == b"zz-hidden"
        for name in ("paths", "kinds", "modes", "mtimes", "sizes", "links", "link_groups", "shard_of", "offsets",
                     "data_offsets"):
            del getattr(index, name)[-1]
        del index.hashes[-16:]
        last = index.shards[-1]
        index.shards[-1] = dataclasses.replace(last, entry_count=last.entry_count - 1,
                                               file_bytes=last.file_bytes - len(b"not in the index"))
    bundle = write_tampered(good, tmp_path / "omitted.tar.zst", drop_last, "sidecar")
    with pytest.raises(CorruptBundleError, match="do not match the index at 'a.txt'"):
        unpack(bundle, dest)
    assert not (dest / "zz-hidden").exists()
    checked = run_pallet("verify", str(bundle))
    assert checked.returncode != 0 and "do not match the index at 'a.txt'" in checked.stdout + checked.stderr
    assert_outside_unchanged(dest, before)
