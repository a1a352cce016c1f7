"""Any single flipped byte in a bundle, its index or its sidecar is found and named; damaged DESTs too."""
from __future__ import annotations

import dataclasses
import os
import random
import shutil
import subprocess
import zlib
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import zstandard

import bundles.extract
from bundles import Bundle, PackOptions, PalletError, UnpackOptions, container, pack, unpack, verify_bundle, verify_tree
from bundles.index import content_hash
from bundles.tarformat import END_OF_ARCHIVE, Kind, member_header
from tests.conftest import run_pallet

# the shared tests of both engines (see tests/test_native_parity.py)
pytestmark = pytest.mark.usefixtures("each_engine")

CODECS = ("zstd", "gzip", "none")
SHARD_SIZE = 1024
FULL_SWEEP_LIMIT = 5000     # flip every byte of a bundle smaller than this, else a sample
SAMPLE_SIZE = 300
TAIL = 80                   # covers the locator and its wrapper for every codec
TIME_NS = 1_650_000_000_000_000_000


def make_small_tree(root: Path) -> Path:
    """Ten text files in two directories, a symlink, and one file big enough for a streamed shard."""
    rng = random.Random(42)
    words = [b"alpha", b"beta", b"gamma", b"delta", b"omega", b"\n"]
    files = {f"{'sub/' if n % 3 else ''}f{n}.txt": b" ".join(rng.choices(words, k=rng.randint(10, 90)))
             for n in range(10)}
    files["sub/deeper/big.bin"] = rng.randbytes(1500)
    for rel, content in files.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_bytes(content)
    os.symlink("f0.txt", root / "link")
    for path in [*root.rglob("*"), root]:
        os.utime(path, ns=(TIME_NS, TIME_NS), follow_symlinks=False)
    return root


def pack_small(tmp_path: Path, codec: str) -> tuple[Path, object]:
    src = make_small_tree(tmp_path / "src")
    bundle = tmp_path / f"small.{codec}"
    index = pack(src, bundle, PackOptions(codec=codec, shard_size=SHARD_SIZE, jobs=1)).index
    assert len(index.shards) >= 4 and any(s.file_bytes >= SHARD_SIZE for s in index.shards)
    return bundle, index


def data_end(index) -> int:
    return index.shards[-1].offset + index.shards[-1].length


def flip_offsets(size: int, index) -> list[int]:
    """Every offset of a small file; otherwise ~300 covering every shard, the index section and the locator."""
    if size < FULL_SWEEP_LIMIT:
        return list(range(size))
    chosen = set(range(size - TAIL, size))
    for start in [s.offset for s in index.shards] + [data_end(index)]:
        chosen.update(range(start, min(size, start + 4)))
    for shard in index.shards:
        chosen.update(range(shard.offset + shard.length - 4, shard.offset + shard.length))
        for entry in index.shard_entries(shard):       # exact places when the codec is none
            chosen.update({shard.offset + entry.offset, shard.offset + entry.data_offset,
                           shard.offset + entry.data_offset + max(entry.size, 1) - 1})
    rest = sorted(set(range(size)) - chosen)
    chosen.update(random.Random(size).sample(rest, max(0, SAMPLE_SIZE - len(chosen))))
    return sorted(chosen)


def outcome(path: Path) -> tuple[bool, list[str]]:
    """(opened, problems): what verify_bundle reports, or the one error Bundle.open or verify raised."""
    try:
        with Bundle.open(path) as bundle:
            return True, verify_bundle(bundle, jobs=1).problems
    except PalletError as exc:
        assert str(path) in str(exc) and "hint:" in str(exc), str(exc)
        return False, [str(exc)]


def decompress(codec: str, data: bytes) -> bytes | None:
    """The decompressed bytes of one shard, or None if the codec library rejects them."""
    try:
        if codec == "zstd":
            return zstandard.ZstdDecompressor().decompressobj().decompress(data)
        return zlib.decompress(data, wbits=31) if codec == "gzip" else data
    except (zstandard.ZstdError, zlib.error):
        return None


def expected_entry_problems(index, shard, raw: bytes, contents: dict) -> set[str]:
    """What verify must say per entry about a shard that decompresses to ``raw`` (``contents``: name -> bytes)."""
    expected = set()
    for e in index.shard_entries(shard):
        header = member_header(e.path, e.kind, e.mode, e.mtime_ns, e.size, e.link)
        if raw[e.offset:e.offset + len(header)] != header:
            expected.add(f"{e.name}: tar header does not match the index")
        if e.kind == 0 and e.size and raw[e.data_offset:e.data_offset + e.size] != contents[e.name]:
            expected.add(f"{e.name}: content does not match its hash")
    return expected


def check_shard_flip(codec, index, shard, flipped: bytes, problems: list[str], contents: dict) -> str:
    """Assert the problems name the shard, all its entries, and exactly the entries whose bytes changed.

    Returns what the flip did: "undecodable", "content" (a file's content changed) or "framing".
    """
    names = [e.name for e in index.shard_entries(shard)]
    hash_line = [p for p in problems if p.startswith(f"shard {shard.number}: its bytes do not match")]
    assert hash_line and all(name in hash_line[0] for name in names), problems
    raw = decompress(codec, flipped[shard.offset:shard.offset + shard.length])
    failed = [p for p in problems if p.startswith(f"shard {shard.number}: ") and p not in hash_line
              and "end-of-archive" not in p]
    if raw is None or len(raw) != shard.raw_size or failed:
        assert failed or raw is not None, problems
        return "undecodable"
    entry_problems = {p for p in problems if not p.startswith("shard ")}
    expected = expected_entry_problems(index, shard, raw, contents)
    assert entry_problems == expected
    if shard.number == len(index.shards) - 1 and not raw.endswith(END_OF_ARCHIVE):
        assert any("end-of-archive" in p for p in problems), problems
    return "content" if any("content does not match" in p for p in expected) else "framing"


@pytest.mark.parametrize("codec", CODECS)
def test_every_flipped_byte_is_found_and_named(tmp_path, codec):
    bundle, index = pack_small(tmp_path, codec)
    contents = {e.name: (tmp_path / "src" / e.name).read_bytes() for e in index if e.kind == 0}
    original = bundle.read_bytes()
    offsets = flip_offsets(len(original), index)
    assert len(offsets) >= min(len(original), SAMPLE_SIZE)
    effects = Counter()
    with open(bundle, "r+b", buffering=0) as handle:
        for offset in offsets:
            flipped = bytearray(original)
            flipped[offset] ^= 1 << (offset % 8)
            os.pwrite(handle.fileno(), flipped[offset:offset + 1], offset)
            opened, problems = outcome(bundle)
            os.pwrite(handle.fileno(), original[offset:offset + 1], offset)
            assert problems, f"flip at {offset} of {len(original)} went unnoticed"
            shard = next((s for s in index.shards if s.offset <= offset < s.offset + s.length), None)
            if shard is None:
                assert any("index" in p or "locator" in p for p in problems), (offset, problems)
            else:
                assert opened, (offset, problems)
                effects[check_shard_flip(codec, index, shard, bytes(flipped), problems, contents)] += 1
    assert outcome(bundle) == (True, [])
    # gzip's CRC turns every content change into a decoding error; zstd frames carry no checksum here
    assert effects["content"] >= {"none": 10, "zstd": 1, "gzip": 0}[codec], effects
    assert effects["undecodable"] >= {"none": 0, "zstd": 1, "gzip": 100}[codec], effects


@pytest.mark.parametrize("codec", CODECS)
def test_flips_after_the_shards_are_found_without_the_sidecar(tmp_path, codec):
    bundle, index = pack_small(tmp_path, codec)
    os.unlink(f"{bundle}.pidx")
    original = bundle.read_bytes()
    for offset in [*range(data_end(index), data_end(index) + 16), *range(len(original) - TAIL, len(original))]:
        flipped = bytearray(original)
        flipped[offset] ^= 0xFF
        bundle.write_bytes(flipped)
        opened, problems = outcome(bundle)
        assert not opened and problems, offset


@pytest.mark.parametrize("codec", CODECS)
def test_cli_verify_fails_on_a_sample_of_flips(tmp_path, codec):
    bundle, index = pack_small(tmp_path, codec)
    original = bundle.read_bytes()
    middle = [(s.offset + s.length // 2, f"shard {s.number}") for s in index.shards[:3]]
    cases = [(0, "shard 0"), *middle, (data_end(index) + 3, "index"), (len(original) - 1, "locator")]
    copies = []
    for n, (offset, _) in enumerate(cases):
        copy = tmp_path / f"copy{n}.{codec}"
        flipped = bytearray(original)
        flipped[offset] ^= 0x55
        copy.write_bytes(flipped)
        shutil.copy(f"{bundle}.pidx", f"{copy}.pidx")
        copies.append(copy)
    with ThreadPoolExecutor(4) as pool:
        runs = list(pool.map(lambda c: run_pallet("verify", "--jobs", "1", str(c)), [bundle, *copies]))
    assert runs[0].returncode == 0 and "OK" in runs[0].stdout
    for (offset, named), copy, done in zip(cases, copies, runs[1:], strict=True):
        assert done.returncode == 1, (offset, done.stdout, done.stderr)
        assert str(copy.name) in done.stderr and named in done.stderr, done.stderr
        assert "Traceback" not in done.stderr


def test_every_flipped_byte_of_the_sidecar_is_reported(tmp_path):
    bundle, _ = pack_small(tmp_path, "zstd")
    sidecar = Path(f"{bundle}.pidx")
    original = sidecar.read_bytes()
    for offset in range(len(original)):
        flipped = bytearray(original)
        flipped[offset] ^= 1 << (offset % 8)
        sidecar.write_bytes(flipped)
        opened, problems = outcome(bundle)
        assert opened and problems == [f"sidecar index {sidecar} is damaged (it differs from the index "
                                       "embedded in the bundle)"], offset
    done = run_pallet("verify", str(bundle))
    assert done.returncode == 1 and f"{sidecar} is damaged" in done.stderr


@pytest.mark.parametrize("codec,jobs", [("none", "1"), ("zstd", "2")])
def test_unpack_refuses_a_corrupted_shard_and_leaves_dest_marked(tmp_path, codec, jobs):
    bundle, index = pack_small(tmp_path, codec)
    shard = index.shards[1]
    victims = [e.name for e in index.shard_entries(shard) if e.kind == 0]
    flipped = bytearray(bundle.read_bytes())
    flipped[shard.offset + shard.length // 2] ^= 0x01
    bundle.write_bytes(flipped)
    dest = tmp_path / "out"
    done = run_pallet("unpack", "--jobs", jobs, str(bundle), str(dest))
    assert done.returncode == 1, done.stderr
    assert str(bundle) in done.stderr and f"shard {shard.number}" in done.stderr and "hint:" in done.stderr
    assert victims and all(name in done.stderr for name in victims), done.stderr
    assert "Traceback" not in done.stderr
    assert (dest / ".pallet" / "INCOMPLETE").is_file()
    assert not any((dest / name).exists() for name in victims)


def test_unpack_refuses_a_corrupted_streamed_shard(tmp_path):
    bundle, index = pack_small(tmp_path, "none")
    shard = next(s for s in index.shards if s.file_bytes >= SHARD_SIZE)
    entry = next(index.shard_entries(shard))
    flipped = bytearray(bundle.read_bytes())
    flipped[shard.offset + entry.data_offset + 100] ^= 0x80
    bundle.write_bytes(flipped)
    done = run_pallet("unpack", str(bundle), str(tmp_path / "out"))
    assert done.returncode == 1 and entry.name in done.stderr and f"shard {shard.number}" in done.stderr
    assert (tmp_path / "out" / ".pallet" / "INCOMPLETE").is_file()
    _, problems = outcome(bundle)
    assert f"{entry.name}: content does not match its hash" in problems


def _modify(dest: Path) -> None:
    """Flip one bit of sub/f1.txt, keeping its size and mtime (and so its directory's mtime)."""
    path = dest / "sub" / "f1.txt"
    st = path.stat()
    content = path.read_bytes()
    path.write_bytes(bytes([content[0] ^ 1]) + content[1:])
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))


def _retarget(dest: Path) -> None:
    os.unlink(dest / "link")
    os.symlink("f3.txt", dest / "link")


# Damage at the top level or keeping directory mtimes, so each causes exactly one problem.
DAMAGE = {
    "modified": (_modify, "sub/f1.txt: content differs"),
    "missing": (lambda d: os.unlink(d / "f0.txt"), "f0.txt: missing in the destination"),
    "mode": (lambda d: os.chmod(d / "sub" / "f2.txt", 0o600), "sub/f2.txt: mode 0600, expected 0644"),
    "extra": (lambda d: (d / "stray.tmp").write_bytes(b"?"), "stray.tmp: extra in the destination"),
    "extra dir": (lambda d: (d / "new" / "inner").mkdir(parents=True), "new: extra in the destination"),
    "symlink": (_retarget, "link: symlink target differs"),
    "unfinished": (lambda d: (d / ".pallet").mkdir(), ".pallet: pallet's state of an operation that did not finish"),
}


@pytest.fixture
def unpacked(tmp_path):
    bundle, index = pack_small(tmp_path, "zstd")
    unpack(bundle, tmp_path / "out")
    assert verify_tree(index, tmp_path / "out").ok
    return bundle, index, tmp_path / "out"


@pytest.mark.parametrize("kind", DAMAGE)
def test_verify_tree_names_each_kind_of_damage(unpacked, kind):
    _, index, dest = unpacked
    damage, message = DAMAGE[kind]
    damage(dest)
    problems = verify_tree(index, dest).problems
    assert len(problems) == 1 and problems[0].startswith(message), problems


def test_cli_verify_bundle_dest_reports_modified_missing_mode_and_extra(unpacked):
    bundle, _, dest = unpacked
    clean = run_pallet("verify", str(bundle), str(dest))
    assert clean.returncode == 0 and "matches" in clean.stdout
    for kind in ("modified", "missing", "mode", "extra"):
        DAMAGE[kind][0](dest)
    done = run_pallet("verify", str(bundle), str(dest))
    assert done.returncode == 1 and "4 problem(s)" in done.stderr
    assert all(DAMAGE[kind][1] in done.stderr for kind in ("modified", "missing", "mode", "extra"))


def test_a_tree_check_names_an_entry_type_the_index_cannot_hold(tmp_path):
    src = tmp_path / "src"
    src.mkdir()
    (src / "a").write_bytes(b"a")
    pack(src, tmp_path / "b.tar.zst", PackOptions())
    unpack(tmp_path / "b.tar.zst", tmp_path / "dest")
    with Bundle.open(tmp_path / "b.tar.zst") as bundle:
        index = bundle.index
    index.kinds[index.paths.index(b"a")] = 7
    report = verify_tree(index, str(tmp_path / "dest"))
    assert report.problems == ["a: unknown entry type 7 in the index"]


def crafted_from_good(tmp_path: Path, rework) -> Path:
    """A bundle of ten random files in 4 KiB shards whose shards pass through ``rework(number, raw)``, which
    returns the shard's new compressed bytes and raw size; offsets, hashes and the index are rewritten to match."""
    src = tmp_path / "src"
    src.mkdir()
    for n in range(10):
        (src / f"f{n:02}").write_bytes(os.urandom(3000))
    pack(src, tmp_path / "good.tar.zst", PackOptions(jobs=1, shard_size=4096))
    with Bundle.open(tmp_path / "good.tar.zst") as good:
        index = good.index
        raws = [good.codec.decompress(good.read_shard(s), s.raw_size) for s in index.shards]
    data, shards = b"", []
    for shard, raw in zip(index.shards, raws, strict=True):
        frames, raw_size = rework(shard.number, raw)
        shards.append(dataclasses.replace(shard, offset=len(data), length=len(frames), raw_size=raw_size,
                                          hash=content_hash(frames)))
        data += frames
    index.shards = shards
    bad = tmp_path / "bad.tar.zst"
    bad.write_bytes(data + container.index_section(index.codec, index.to_bytes(), len(data)))
    return bad


@pytest.mark.parametrize("streamed", [False, True], ids=["held", "streamed"])
def test_a_member_smuggled_in_a_second_frame_of_a_shard_is_refused(tmp_path, monkeypatch, streamed):
    """`zstd -dc | tar -x` reads every frame of a shard: a second frame holding a member the index omits
    (shard hash and index rewritten to match) fails verify and unpack, whether the shard is held or streamed."""
    if streamed:
        monkeypatch.setattr(bundles.extract, "HOLD_LIMIT", 0)
    smuggled = member_header(b"SMUGGLED", Kind.FILE, 0o644, 0, 5, b"") + b"evil!" + bytes(507)
    compress = zstandard.ZstdCompressor().compress
    bad = crafted_from_good(tmp_path, lambda number, raw: (
        compress(raw) + (compress(smuggled) if number == 0 else b""), len(raw)))
    with Bundle.open(bad) as opened:
        assert any(p.startswith("shard 0: ") for p in verify_bundle(opened, jobs=1).problems)
    with pytest.raises(PalletError, match="shard 0|zstd shard"):
        unpack(bad, tmp_path / "dest", UnpackOptions(jobs=1))
    assert not (tmp_path / "dest" / "SMUGGLED").exists()


@pytest.mark.parametrize("streamed", [False, True], ids=["held", "streamed"])
def test_end_of_archive_blocks_before_the_last_shard_are_refused(tmp_path, monkeypatch, streamed):
    """Zero blocks appended to shard 0 (its raw size, hash and the index rewritten to match) would make plain
    `tar -x` stop there with exit 0 and half the tree: verify and unpack refuse the shard, with either engine,
    held or streamed."""
    if streamed:
        monkeypatch.setattr(bundles.extract, "HOLD_LIMIT", 0)

    def with_zeros(number: int, raw: bytes) -> tuple[bytes, int]:
        raw += bytes(1024) if number == 0 else b""
        return zstandard.ZstdCompressor().compress(raw), len(raw)
    bad = crafted_from_good(tmp_path, with_zeros)
    tar = subprocess.run(["tar", "-tf", str(bad)], capture_output=True, text=True)
    assert tar.returncode == 0 and len(tar.stdout.split()) < 10      # what plain tar makes of it
    with Bundle.open(bad) as opened:
        assert any(p.startswith("shard 0: ") for p in verify_bundle(opened, jobs=1).problems)
    with pytest.raises(PalletError, match="shard 0"):
        unpack(bad, tmp_path / "dest", UnpackOptions(jobs=1))


def test_a_streamed_file_whose_hash_does_not_match_leaves_the_users_file_alone(tmp_path, monkeypatch):
    """A shard read as a stream (HOLD_LIMIT 0) whose file bytes were altered (shard hash rewritten to match):
    unpack refuses the file and the user's own file of that name keeps its bytes; nothing of pallet's stays
    beside it."""
    monkeypatch.setattr(bundles.extract, "HOLD_LIMIT", 0)
    src = tmp_path / "src"
    src.mkdir()
    for n in range(4):
        (src / f"f{n}").write_bytes(b"%d" % n * 3000)
    pack(src, tmp_path / "good.tar.zst", PackOptions(jobs=1, shard_size=1 << 20))
    with Bundle.open(tmp_path / "good.tar.zst") as good:
        index = good.index
        raw = bytearray(good.codec.decompress(good.read_shard(index.shards[0]), index.shards[0].raw_size))
    altered = next(i for i in range(len(index)) if index.paths[i] == b"f2")
    raw[index.data_offsets[altered] + 10] ^= 1
    frame = zstandard.ZstdCompressor().compress(bytes(raw))
    index.shards = [dataclasses.replace(index.shards[0], length=len(frame), hash=content_hash(frame))]
    bad = tmp_path / "bad.tar.zst"
    bad.write_bytes(frame + container.index_section(index.codec, index.to_bytes(), len(frame)))
    dest = tmp_path / "dest"
    dest.mkdir()
    (dest / "f2").write_bytes(b"the user's own bytes")
    with pytest.raises(PalletError, match="content hash mismatch"):
        unpack(bad, dest, UnpackOptions(jobs=1))
    assert (dest / "f2").read_bytes() == b"the user's own bytes"
    assert sorted(os.listdir(dest / ".pallet")) == ["INCOMPLETE", "writing"]
    assert os.listdir(dest / ".pallet" / "writing") == []
