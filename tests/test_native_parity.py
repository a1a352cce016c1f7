"""The native engine and the pure-Python one give the same tar bytes, index columns, files and errors."""
from __future__ import annotations

import dataclasses
import os
import subprocess

import pytest
from hypothesis import given, settings, strategies as st

from bundles import Bundle, native, verify_bundle
from bundles.codecs import get_codec
from bundles.errors import CorruptBundleError, DestinationError, SourceError
from bundles.extract import extract_shard_data, make_directories
from bundles.index import Index, Shard
from bundles.safety import index_problems
from bundles.scan import scan
from bundles.shards import ShardPlan, build_small_shard
from bundles.tarformat import Kind, member_header
from tests.conftest import assert_same_tree, make_files, run_pallet

ENGINE = native.module()
needs_native = pytest.mark.skipif(ENGINE is None, reason="the native engine is not built")


def test_the_install_built_the_native_engine():
    """bootstrap.sh builds the extension; `pallet --version` names the engine in use and why."""
    assert native.engine_info().name == "native", native.engine_info().reason
    assert "engine: native" in run_pallet("--version", check=True).stdout
    forced = run_pallet("--version", check=True, env={"PALLET_ENGINE": "python"}).stdout
    assert "engine: python (PALLET_ENGINE=python)" in forced


def test_an_unknown_engine_name_is_a_usage_error(tmp_path):
    (tmp_path / "src").mkdir()
    (tmp_path / "src" / "f").write_bytes(b"x")
    done = run_pallet("pack", str(tmp_path / "src"), str(tmp_path / "b.tar.zst"), env={"PALLET_ENGINE": "rust"})
    assert done.returncode == 2 and "PALLET_ENGINE='rust' is not an engine" in done.stderr
    assert "Traceback" not in done.stderr and not (tmp_path / "b.tar.zst").exists()


_names = st.binary(min_size=1, max_size=300).filter(lambda b: b"\0" not in b)


@needs_native
@settings(max_examples=300, deadline=None)
@given(entries=st.lists(st.tuples(_names, st.sampled_from([0, 1, 700, 5_000, 70_000, 300 << 20, 400 << 20, 600 << 20]),
                                  st.binary(max_size=150).filter(lambda b: b"\0" not in b)), max_size=60),
       shard_size=st.sampled_from([1, 4096, 65_536, 4 << 20, 2 << 30]))
def test_shard_plans_are_identical(entries, shard_size):
    """plan_shards cuts the same entries in both engines: content-defined cuts, big files alone, and cuts before
    a held shard's bytes could pass HELD_RAW_LIMIT (sizes are only numbers here; nothing is read)."""
    from bundles.shards import plan_shards
    index = Index("zstd", 3, shard_size)
    for path, size, link in entries:
        index.paths.append(path)
        index.sizes.append(size)
        index.links.append(link)
    before = os.environ.get("PALLET_ENGINE")
    try:
        os.environ["PALLET_ENGINE"] = "native"
        natively = plan_shards(index, shard_size)
        os.environ["PALLET_ENGINE"] = "python"
        assert plan_shards(index, shard_size) == natively
    finally:
        os.environ.pop("PALLET_ENGINE")
        if before is not None:
            os.environ["PALLET_ENGINE"] = before


@needs_native
@settings(max_examples=400, deadline=None)
@given(path=_names, kind=st.sampled_from(list(Kind)), mode=st.integers(0, 0o177777),
       mtime_ns=st.integers(-2**62, 2**62), size=st.integers(0, 2**40), link=st.binary(max_size=300))
def test_member_headers_are_byte_identical(path, kind, mode, mtime_ns, size, link):
    link = link.replace(b"\0", b"x")
    assert ENGINE.member_header(path, kind, mode, mtime_ns, size, link) == \
        member_header(path, kind, mode, mtime_ns, size, link)


def _whole_tree_plan(tree) -> ShardPlan:
    return ShardPlan(0, 0, len(tree.index), False, True)


def _build(monkeypatch, engine: str, tree, md5: bool = True):
    monkeypatch.setenv("PALLET_ENGINE", engine)
    return build_small_shard(tree, get_codec("zstd", 3), _whole_tree_plan(tree), md5)


@needs_native
def test_a_shard_of_the_nasty_tree_is_the_same_from_both_engines(monkeypatch, nasty_tree):
    tree = scan(nasty_tree, "zstd", 3)
    python, compiled = _build(monkeypatch, "python", tree), _build(monkeypatch, "native", tree)
    assert dataclasses.asdict(python) == dataclasses.asdict(compiled)
    assert len(python.md5s) == 16 * sum(1 for k in tree.index.kinds if k == Kind.FILE)


def _extract_with(monkeypatch, engine: str, tree, built, dest: str, verify: bool = True, data: bytes | None = None):
    monkeypatch.setenv("PALLET_ENGINE", engine)
    index = tree.index
    index.hashes, index.offsets, index.data_offsets = bytearray(built.hashes), built.offsets, built.data_offsets
    raw = get_codec("zstd", 3).decompress(built.compressed, built.raw_size) if data is None else data
    shard = Shard(0, 0, len(built.compressed), built.raw_size, 0, len(index), built.file_bytes, b"")
    os.makedirs(dest, exist_ok=True)
    make_directories(index, dest)
    return extract_shard_data(raw, index, shard, dest, verify, "test.tar.zst")


@needs_native
def test_both_engines_extract_the_same_files(monkeypatch, nasty_tree, tmp_path):
    tree = scan(nasty_tree, "zstd", 3)
    built = _build(monkeypatch, "python", tree)
    outcomes = [_extract_with(monkeypatch, engine, tree, built, str(tmp_path / engine))
                for engine in ("python", "native")]
    assert outcomes[0] == outcomes[1]
    files = [os.path.join(tmp_path / "python", os.fsdecode(p))
             for p, k in zip(tree.index.paths, tree.index.kinds, strict=True) if k == Kind.FILE]
    for path in files:
        twin = path.replace(str(tmp_path / "python"), str(tmp_path / "native"), 1)
        with open(path, "rb") as mine, open(twin, "rb") as theirs:
            assert mine.read() == theirs.read()
        a, b = os.lstat(path), os.lstat(twin)
        assert (a.st_mode, a.st_mtime_ns) == (b.st_mode, b.st_mtime_ns)


def _flip_first_file_byte(tree, built, raw: bytes) -> tuple[bytes, str]:
    i = next(i for i, (k, s) in enumerate(zip(tree.index.kinds, tree.index.sizes, strict=True)) if k == Kind.FILE and s)
    at = built.data_offsets[i]
    return raw[:at] + bytes([raw[at] ^ 1]) + raw[at + 1:], os.fsdecode(tree.index.paths[i])


@needs_native
@pytest.mark.parametrize("damage", ["content", "extra member", "header"])
def test_both_engines_refuse_the_same_damage_with_the_same_error(monkeypatch, nasty_tree, tmp_path, damage):
    tree = scan(nasty_tree, "zstd", 3)
    built = _build(monkeypatch, "python", tree)
    raw = get_codec("zstd", 3).decompress(built.compressed, built.raw_size)
    if damage == "content":
        raw, _ = _flip_first_file_byte(tree, built, raw)
    elif damage == "extra member":
        raw = raw[:-1024] + member_header(b"planted", Kind.FILE, 0o644, 0, 0, b"") + bytes(1024)
    else:
        raw = raw[:100] + b"7" + raw[101:]          # inside the first header's mode field
    errors = []
    for engine in ("python", "native"):
        with pytest.raises(CorruptBundleError) as caught:
            _extract_with(monkeypatch, engine, tree, built, str(tmp_path / engine), data=raw)
        errors.append(str(caught.value))
    assert errors[0] == errors[1]


@needs_native
def test_a_planted_link_is_replaced_not_written_through_by_the_native_engine(monkeypatch, tmp_path):
    src = tmp_path / "src"
    src.mkdir()
    (src / "f").write_bytes(b"new bytes")
    sentinel = tmp_path / "sentinel"
    sentinel.write_bytes(b"keep me")
    tree = scan(str(src), "zstd", 3)
    built = _build(monkeypatch, "native", tree)
    dest = tmp_path / "dest"
    dest.mkdir()
    os.symlink(sentinel, dest / "f")
    _extract_with(monkeypatch, "native", tree, built, str(dest))
    assert sentinel.read_bytes() == b"keep me"
    assert not os.path.islink(dest / "f") and (dest / "f").read_bytes() == b"new bytes"


@needs_native
def test_a_directory_in_place_of_a_file_is_named(monkeypatch, tmp_path):
    src = tmp_path / "src"
    src.mkdir()
    (src / "f").write_bytes(b"x")
    tree = scan(str(src), "zstd", 3)
    built = _build(monkeypatch, "native", tree)
    (tmp_path / "dest" / "f").mkdir(parents=True)
    with pytest.raises(DestinationError, match="is a directory in the destination"):
        _extract_with(monkeypatch, "native", tree, built, str(tmp_path / "dest"))


@needs_native
@pytest.mark.parametrize("engine", ["python", "native"])
def test_an_unreadable_source_file_is_named_by_both_engines(monkeypatch, tmp_path, engine):
    src = tmp_path / "src"
    src.mkdir()
    (src / "ok").write_bytes(b"fine")
    (src / "gone").write_bytes(b"soon removed")
    tree = scan(str(src), "zstd", 3)
    (src / "gone").unlink()
    with pytest.raises(SourceError, match="cannot read") as caught:
        _build(monkeypatch, engine, tree)
    assert caught.value.path.endswith("gone")


@needs_native
def test_a_bundle_packed_by_one_engine_unpacks_by_the_other(tmp_path, nasty_tree):
    for packer, unpacker in (("native", "python"), ("python", "native")):
        bundle = tmp_path / f"{packer}.tar.zst"
        run_pallet("pack", nasty_tree, str(bundle), check=True, env={"PALLET_ENGINE": packer})
        run_pallet("unpack", str(bundle), str(tmp_path / packer), check=True, env={"PALLET_ENGINE": unpacker})
        assert_same_tree(nasty_tree, tmp_path / packer)
    assert (tmp_path / "native.tar.zst").read_bytes() == (tmp_path / "python.tar.zst").read_bytes()
    listing = subprocess.run(["tar", "-tf", str(tmp_path / "native.tar.zst")], capture_output=True)
    assert listing.returncode == 0


def _index_of(entries) -> Index:
    """An index of ``entries`` (path, kind, mode, mtime_ns, size), laid out as one shard from offset 0."""
    index = Index("none", 0, 1 << 20)
    position = 0
    for path, kind, mode, mtime_ns, size in entries:
        for column, value in ((index.paths, path), (index.kinds, kind), (index.modes, mode),
                              (index.mtimes, mtime_ns), (index.sizes, size), (index.links, b""),
                              (index.link_groups, -1), (index.shard_of, 0), (index.offsets, position)):
            column.append(value)
        header = len(member_header(path, min(kind, Kind.HARDLINK), mode, mtime_ns, size, b""))
        index.data_offsets.append(position + header)
        position += header + (size + -size % 512 if kind == Kind.FILE and size < 1 << 40 else 0)
    index.hashes = bytearray(16 * len(index.paths))
    return index


def _tar_of(index: Index) -> bytes:
    parts = [member_header(p, min(k, Kind.HARDLINK), m, t, s, b"") for p, k, m, t, s in
             zip(index.paths, index.kinds, index.modes, index.mtimes, index.sizes, strict=True)]
    return b"".join(parts) + bytes(1024)


@pytest.mark.parametrize("engine", ["python", "native"] if ENGINE else ["python"])
@pytest.mark.parametrize("case", ["size near 2**64", "unknown kind"])
def test_hostile_index_columns_are_refused_by_both_engines(monkeypatch, tmp_path, engine, case):
    monkeypatch.setenv("PALLET_ENGINE", engine)
    entry = (b"big", Kind.FILE, 0o644, 0, 2**64 - 1) if case == "size near 2**64" else (b"odd", 7, 0o644, 0, 0)
    index = _index_of([entry, (b"after", Kind.FILE, 0o644, 0, 0)])
    data = _tar_of(index)
    shard = Shard(0, 0, len(data), len(data), 0, 2, 0, b"")
    with pytest.raises(CorruptBundleError, match="do not match the index"):
        extract_shard_data(data, index, shard, str(tmp_path), True, "hostile.tar")
    assert os.listdir(tmp_path) == []


@pytest.mark.parametrize("engine", ["python", "native"] if ENGINE else ["python"])
def test_an_empty_file_is_written_wherever_its_offset_points(monkeypatch, tmp_path, engine):
    monkeypatch.setenv("PALLET_ENGINE", engine)
    index = _index_of([(b"empty", Kind.FILE, 0o644, 0, 0)])
    index.data_offsets[0] = 10**6
    outcome = extract_shard_data(bytes(1024), index, Shard(0, 0, 0, 1024, 0, 1, 0, b""), str(tmp_path), False, "b")
    assert outcome.files == 1 and (tmp_path / "empty").read_bytes() == b""


@pytest.mark.timeout(30)
@pytest.mark.parametrize("engine", ["python", "native"] if ENGINE else ["python"])
def test_a_fifo_put_in_a_files_place_is_named_not_waited_on(monkeypatch, tmp_path, engine):
    src = tmp_path / "src"
    src.mkdir()
    (src / "a").write_bytes(b"a" * 10)
    tree = scan(str(src) + "/", "zstd", 3)
    (src / "a").unlink()
    os.mkfifo(src / "a")
    with pytest.raises(SourceError, match="no longer a regular file") as caught:
        _build(monkeypatch, engine, tree)
    assert caught.value.path == str(src) + "//a"


_components = st.sampled_from([b"a", b"b", b".", b"..", b"", b".pallet", b".pallet-partial", b".palletx", b"c d"])


@needs_native
@settings(max_examples=400, deadline=None)
@given(entries=st.lists(st.tuples(st.lists(_components, min_size=1, max_size=3).map(b"/".join),
                                  st.sampled_from([0, 0, 1, 1, 2, 3, 9])), max_size=12))
def test_the_native_safety_precheck_never_passes_what_the_rules_refuse(entries):
    """trivially_safe may defer (False) for a safe index, but True must mean index_problems finds nothing."""
    paths, kinds = [p for p, _ in entries], bytes(k for _, k in entries)
    if ENGINE.trivially_safe(len(paths), native.blob(paths), kinds):
        index = _index_of([(p, k, 0o644, 0, 0) for p, k in entries])
        assert index_problems(index) == []


@needs_native
def test_the_native_safety_precheck_proves_a_plain_tree(nasty_tree, tmp_path):
    plain = scan(make_files(tmp_path / "plain", 50, 5, lambda n: b"x"), "zstd", 3).index
    assert ENGINE.trivially_safe(len(plain), native.blob(plain.paths), native.raw(plain.kinds))
    nasty = scan(nasty_tree, "zstd", 3).index      # links: the Python rules decide
    assert not ENGINE.trivially_safe(len(nasty), native.blob(nasty.paths), native.raw(nasty.kinds))


def _columns(tree) -> dict:
    index = tree.index
    return {name: list(getattr(index, name)) for name in ("paths", "kinds", "modes", "mtimes", "sizes", "links",
                                                          "link_groups")} | {"root": tree.root}


@needs_native
def test_both_engines_scan_the_same_columns(monkeypatch, nasty_tree, tmp_path):
    big = make_files(tmp_path / "many", 3000, 40, lambda n: b"y" * (n % 7))
    os.link(os.path.join(big, "d0", "f00000"), os.path.join(big, "d1", "hard"))
    for tree in (nasty_tree, big):
        scanned = []
        for engine in ("python", "native"):
            monkeypatch.setenv("PALLET_ENGINE", engine)
            scanned.append(_columns(scan(tree, "zstd", 3)))
        assert scanned[0] == scanned[1]


@needs_native
@pytest.mark.parametrize("engine", ["python", "native"])
def test_both_engines_refuse_the_same_entries_when_scanning(monkeypatch, tmp_path, engine):
    monkeypatch.setenv("PALLET_ENGINE", engine)
    src = tmp_path / "src"
    (src / "sub").mkdir(parents=True)
    (src / "sub" / "ok").write_bytes(b"fine")
    os.symlink("/etc/passwd", src / "sub" / "escape")
    os.mkfifo(src / "fifo")
    (src / ".pallet").mkdir()
    with pytest.raises(SourceError) as caught:
        scan(str(src), "zstd", 3)
    text = str(caught.value)
    assert "'.pallet': the name .pallet is reserved" in text
    assert "'fifo': special file" in text and "'sub/escape': symlink to '/etc/passwd'" in text


@needs_native
def test_both_engines_verify_a_damaged_bundle_with_the_same_report(monkeypatch, tmp_path):
    src = make_files(tmp_path / "src", 400, 4, lambda n: b"row %d\n" % n * 20)
    bundle = tmp_path / "b.tar"
    run_pallet("pack", "--codec", "none", src, str(bundle), check=True)
    data = bytearray(bundle.read_bytes())
    at = data.index(b"row 123\n")
    data[at] ^= 1                                   # one file's content, inside an uncompressed shard
    bundle.write_bytes(bytes(data))
    reports = []
    for engine in ("python", "native"):
        monkeypatch.setenv("PALLET_ENGINE", engine)
        with Bundle.open(bundle) as opened:
            reports.append(verify_bundle(opened).problems)
    assert reports[0] == reports[1] and any("content does not match its hash" in p for p in reports[0])


@needs_native
def test_the_native_engine_writes_runs_of_plain_members_and_stops_where_python_must_read(tmp_path):
    """A GNU tar stream of a directory, 40 files, then a symlink: one run writes the directory and the files
    and stops at the symlink (unwritten) for the Python reader; nothing is written under a symlink member."""
    (tmp_path / "src" / "d").mkdir(parents=True)
    files = [f"d/f{n:02d}" for n in range(40)]
    for name in files:
        (tmp_path / "src" / name).write_bytes(b"x" * 100)
    os.symlink("f00", tmp_path / "src" / "d" / "zz_link")
    data = subprocess.run(["tar", "--format=gnu", "--no-recursion", "-cf", "-", "-C", str(tmp_path / "src"), "d",
                           *files, "d/zz_link"], check=True, capture_output=True).stdout
    root = os.fsencode(tmp_path / "out") + b"/"
    os.mkdir(root)
    run = ENGINE.PlainExtraction(root, None)
    consumed, needed, entries, written, size, made = run.run(data, 0)
    assert (entries, written, size, needed) == (41, 40, 4000, 0)
    assert [name for name, _, _ in made] == [b"d"] and data[consumed + 156:consumed + 157] == b"2"
    assert run.has_file(b"d/f00") and not run.has_file(b"d/zz_link")
    assert not os.path.lexists(tmp_path / "out" / "d" / "zz_link")
    under = ENGINE.PlainExtraction(os.fsencode(tmp_path / "again") + b"/", None)
    os.mkdir(tmp_path / "again")
    under.add_symlink(b"d")
    assert under.run(data, 0)[2:4] == (1, 0)          # the directory d itself, then a stop at d/f00
