"""Fuzzing the index and stream parsers: any input gives pallet's own error (a one-line message), never another
exception. The inputs are valid encodings with their checksums recomputed after the damage, so the parsers'
structure checks are reached, not only the hash checks in front of them."""
from __future__ import annotations

import io
import json
import os
import struct
import tarfile
from pathlib import Path

import pytest
import zstandard
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from bundles import PackOptions, container, pack, unpack
from bundles.errors import PalletError
from bundles.index import HASH_SIZE, Index, content_hash
from bundles.reader import Bundle
from bundles.shards import plan_shards
from bundles.stream import decode_skeleton, encode_skeleton
from bundles.verify import verify_bundle

FUZZ = settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
_HEAD = struct.Struct("<8sII")


@pytest.fixture(scope="module")
def index(tmp_path_factory) -> Index:
    src = tmp_path_factory.mktemp("fuzz") / "src"
    (src / "d").mkdir(parents=True)
    for n in range(12):
        (src / "d" / f"f{n}.txt").write_bytes(b"x" * n)
    (src / "link").symlink_to("d/f1.txt")
    with Bundle.open(pack(src, src.parent / "b.tar.zst", PackOptions(shard_size=64)).bundle) as bundle:
        return bundle.index


def _inner(index: Index) -> bytes:
    return zstandard.ZstdDecompressor().decompress(index.to_bytes())


def _reseal(blob: bytes) -> bytes:
    """An index payload whose self-hash matches ``blob`` (its last HASH_SIZE bytes replaced)."""
    body = blob[:-HASH_SIZE] if len(blob) > HASH_SIZE else blob
    return zstandard.ZstdCompressor().compress(body + content_hash(body))


def _edits():
    return st.lists(st.tuples(st.integers(0, 1 << 16), st.integers(0, 255)), min_size=1, max_size=8)


def _apply(blob: bytes, edits, cut: int | None) -> bytes:
    data = bytearray(blob)
    for at, value in edits:
        data[at % len(data)] = value
    return bytes(data[:cut] if cut is not None else data)


def _only_pallet_errors(parse, payload: bytes) -> None:
    try:
        parse(payload)
    except PalletError as exc:
        assert str(exc).strip(), "an error without a message"
    # any other exception fails the test with its traceback


@given(edits=_edits(), cut=st.one_of(st.none(), st.integers(0, 4096)))
@FUZZ
def test_damaged_indexes_with_matching_hashes_give_pallet_errors(index, edits, cut):
    _only_pallet_errors(Index.from_bytes, _reseal(_apply(_inner(index), edits, cut)))


HEADER_VALUES = st.one_of(st.none(), st.booleans(), st.integers(-2**70, 2**70), st.text(max_size=5),
                          st.lists(st.integers(), max_size=3), st.dictionaries(st.text(max_size=3), st.integers(),
                                                                                 max_size=2))


@given(key=st.sampled_from(["codec", "level", "shard_size", "entries", "columns", "shards", "format"]),
       value=HEADER_VALUES)
@FUZZ
def test_index_headers_with_wrong_types_give_pallet_errors(index, key, value):
    blob = _inner(index)
    _, version, length = _HEAD.unpack_from(blob)
    header = json.loads(blob[_HEAD.size:_HEAD.size + length])
    header[key] = value
    encoded = json.dumps(header).encode()
    rebuilt = _HEAD.pack(b"PALLETIX" if blob[:8] == b"PALLETIX" else blob[:8], version, len(encoded)) + encoded \
        + blob[_HEAD.size + length:]
    _only_pallet_errors(Index.from_bytes, _reseal(rebuilt))


@given(edits=_edits(), cut=st.one_of(st.none(), st.integers(0, 4096)))
@FUZZ
def test_damaged_stream_skeletons_give_pallet_errors(index, edits, cut):
    payload, _ = encode_skeleton(index, plan_shards(index, index.shard_size))
    blob = zstandard.ZstdDecompressor().decompress(payload)
    damaged = zstandard.ZstdCompressor(write_checksum=True).compress(_apply(blob, edits, cut))
    _only_pallet_errors(lambda data: decode_skeleton(data, "fuzz"), damaged)


@given(data=st.binary(max_size=512))
@FUZZ
def test_arbitrary_bytes_give_pallet_errors(data):
    _only_pallet_errors(Index.from_bytes, data)
    _only_pallet_errors(lambda payload: decode_skeleton(payload, "fuzz"), data)


@pytest.fixture(scope="module")
def bundle_parts(tmp_path_factory, index) -> tuple[bytes, bytes]:
    """The shards of the fixture's bundle (its embedded index cut off) and its index's inner bytes."""
    path = next(tmp_path_factory.getbasetemp().glob("fuzz*/b.tar.zst"))
    with Bundle.open(path) as bundle:
        end = container.read_locator(bundle.fd, bundle.size, bundle.codec.name).data_end
    return path.read_bytes()[:end], _inner(index)


@given(edits=_edits())
@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
def test_unpack_and_verify_with_a_damaged_resealed_index_give_pallet_errors(tmp_path_factory, bundle_parts, edits):
    shards, inner = bundle_parts
    work = tmp_path_factory.mktemp("damaged")
    bundle = work / "b.tar.zst"
    bundle.write_bytes(shards)
    Path(f"{bundle}{container.SIDECAR_SUFFIX}").write_bytes(_reseal(_apply(inner, edits, None)))
    _only_pallet_errors(lambda path: unpack(path, work / "dest"), bundle)
    _only_pallet_errors(lambda path: _verify(path), bundle)
    assert sorted(p.name for p in work.iterdir()) in (["b.tar.zst", "b.tar.zst.pidx"],
                                                       ["b.tar.zst", "b.tar.zst.pidx", "dest"])


def _verify(path) -> None:
    with Bundle.open(path) as bundle:
        verify_bundle(bundle)


@pytest.fixture(scope="module")
def plain_tar(tmp_path_factory) -> bytes:
    """A plain pax tar of files, directories, links and a long name, as the plain-archive reader takes it."""
    raw = io.BytesIO()
    with tarfile.open(fileobj=raw, mode="w", format=tarfile.PAX_FORMAT) as archive:
        for name, kind, payload in [("d", tarfile.DIRTYPE, b""), ("d/a", tarfile.REGTYPE, b"alpha"),
                                    ("d/" + "n" * 120, tarfile.REGTYPE, b"long"), ("s", tarfile.SYMTYPE, b"d/a"),
                                    ("h", tarfile.LNKTYPE, b"d/a"), ("d/b", tarfile.REGTYPE, b"b" * 700)]:
            info = tarfile.TarInfo(name)
            info.type, info.mtime = kind, 1_700_000_000
            if kind == tarfile.REGTYPE:
                info.size = len(payload)
            else:
                info.linkname = payload.decode()
            archive.addfile(info, io.BytesIO(payload) if kind == tarfile.REGTYPE else None)
    return raw.getvalue()


def _resealed_tar(data: bytes) -> bytes:
    """``data`` with the checksum of every block that looks like a ustar header recomputed."""
    out = bytearray(data)
    for start in range(0, len(out) - 511, 512):
        block = out[start:start + 512]
        if block[257:262] == b"ustar":
            block[148:156] = b" " * 8
            out[start + 148:start + 156] = b"%06o\0 " % sum(block)
    return bytes(out)


@given(edits=_edits(), cut=st.one_of(st.none(), st.integers(0, 6000)), engine=st.sampled_from(["native", "python"]))
@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
def test_damaged_plain_tars_give_pallet_errors_and_stay_inside_dest(tmp_path_factory, plain_tar, edits, cut, engine):
    work = tmp_path_factory.mktemp("plain")
    archive = work / "a.tar"
    archive.write_bytes(_resealed_tar(_apply(plain_tar, edits, cut)))
    before = os.environ.get("PALLET_ENGINE")
    os.environ["PALLET_ENGINE"] = engine
    try:
        _only_pallet_errors(lambda path: unpack(path, work / "dest"), archive)
    finally:
        if before is None:
            del os.environ["PALLET_ENGINE"]
        else:
            os.environ["PALLET_ENGINE"] = before
    assert sorted(p.name for p in work.iterdir()) in (["a.tar"], ["a.tar", "dest"])
