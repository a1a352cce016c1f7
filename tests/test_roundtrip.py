"""Round trips of nasty trees through pallet pack/unpack and through GNU tar."""
from __future__ import annotations

import os
import subprocess

import pytest

import bundles.extract
from bundles import Bundle, CorruptBundleError, PackOptions, UnpackOptions, pack, unpack, verify_bundle, verify_tree
from tests.conftest import assert_same_tree, run_pallet, snapshot

CODECS = [("zstd", ".tar.zst", ["tar", "-xf"]), ("gzip", ".tar.gz", ["tar", "-xzf"]), ("none", ".tar", ["tar", "-xf"])]


@pytest.mark.parametrize("codec,suffix,tar_cmd", CODECS)
@pytest.mark.parametrize("jobs", [1, 3])
def test_pack_unpack_and_gnu_tar_give_identical_trees(tmp_path, nasty_tree, codec, suffix, tar_cmd, jobs):
    bundle = tmp_path / f"b{suffix}"
    result = pack(nasty_tree, bundle, PackOptions(codec=codec, shard_size=64 * 1024, jobs=jobs))
    assert len(result.index.shards) > 1
    assert os.path.exists(str(bundle) + ".pidx")

    unpacked = unpack(bundle, tmp_path / "pallet_out", UnpackOptions(jobs=jobs))
    assert unpacked.verified and unpacked.indexed
    assert_same_tree(nasty_tree, tmp_path / "pallet_out")
    assert not (tmp_path / "pallet_out" / ".pallet" / "INCOMPLETE").exists()

    (tmp_path / "tar_out").mkdir()
    subprocess.run([*tar_cmd, str(bundle), "-C", str(tmp_path / "tar_out")], check=True)
    assert_same_tree(nasty_tree, tmp_path / "tar_out", whole_seconds=True)


@pytest.mark.parametrize("codec", ["zstd", "gzip", "none"])
def test_output_is_deterministic_and_independent_of_jobs(tmp_path, nasty_tree, codec):
    outputs = []
    for jobs in (1, 2, 4):
        bundle = tmp_path / f"b{jobs}"
        pack(nasty_tree, bundle, PackOptions(codec=codec, shard_size=32 * 1024, jobs=jobs))
        outputs.append((bundle.read_bytes(), (tmp_path / f"b{jobs}.pidx").read_bytes()))
    assert outputs[0] == outputs[1] == outputs[2]


def test_big_file_gets_its_own_streamed_shard(tmp_path):
    src = tmp_path / "src"
    src.mkdir()
    (src / "a_small").write_bytes(b"a" * 10)
    (src / "big").write_bytes(os.urandom(3 << 20) + b"tail")
    (src / "z_small").write_bytes(b"z" * 10)
    bundle = tmp_path / "b.tar.zst"
    result = pack(src, bundle, PackOptions(shard_size=1 << 20, jobs=2))
    big = [s for s in result.index.shards if s.file_bytes > (3 << 20)]
    assert len(big) == 1 and big[0].entry_count == 1
    unpack(bundle, tmp_path / "out")
    assert_same_tree(src, tmp_path / "out")
    with Bundle.open(bundle) as opened:
        assert verify_bundle(opened).ok
        assert verify_tree(opened.index, tmp_path / "out").ok


def test_shards_read_as_streams_unpack_and_verify_as_held_ones_do(tmp_path, nasty_tree, monkeypatch):
    """Every shard read as a stream, as one beyond HOLD_LIMIT is (a large --shard-size): every kind of entry
    lands as it does from a shard held whole, verify passes, and a damaged shard is refused by name."""
    monkeypatch.setattr(bundles.extract, "HOLD_LIMIT", 0)
    bundle = tmp_path / "b.tar.zst"
    pack(nasty_tree, bundle, PackOptions(shard_size=4096, jobs=1))
    unpack(bundle, tmp_path / "out", UnpackOptions(jobs=1))
    assert_same_tree(nasty_tree, tmp_path / "out")
    with Bundle.open(bundle) as opened:
        assert len(opened.index.shards) > 2 and verify_bundle(opened, jobs=1).ok
        assert verify_tree(opened.index, tmp_path / "out").ok
        shard = opened.index.shards[1]
    data = bytearray(bundle.read_bytes())
    data[shard.offset + shard.length // 2] ^= 0x20
    bundle.write_bytes(bytes(data))
    with Bundle.open(bundle) as opened:
        problems = verify_bundle(opened, jobs=1).problems
    assert any(p.startswith("shard 1: its bytes do not match the index hash") for p in problems), problems
    with pytest.raises(CorruptBundleError, match="shard 1"):
        unpack(bundle, tmp_path / "out2", UnpackOptions(jobs=1))


def test_single_file_source(tmp_path):
    src = tmp_path / "one.txt"
    src.write_bytes(b"alone")
    pack(src, tmp_path / "b.tar.zst")
    unpack(tmp_path / "b.tar.zst", tmp_path / "out")
    assert (tmp_path / "out" / "one.txt").read_bytes() == b"alone"


def test_empty_directory_source(tmp_path):
    (tmp_path / "src").mkdir()
    result = pack(tmp_path / "src", tmp_path / "b.tar.zst")
    assert len(result.index) == 0 and len(result.index.shards) == 1
    unpack(tmp_path / "b.tar.zst", tmp_path / "out")
    assert os.listdir(tmp_path / "out") == []
    (tmp_path / "tar_out").mkdir()
    subprocess.run(["tar", "-xf", str(tmp_path / "b.tar.zst"), "-C", str(tmp_path / "tar_out")], check=True)


def test_setuid_and_setgid_bits_are_stripped(tmp_path):
    src = tmp_path / "src"
    src.mkdir()
    (src / "suid").write_bytes(b"x")
    os.chmod(src / "suid", 0o6755)
    pack(src, tmp_path / "b.tar.zst")
    unpack(tmp_path / "b.tar.zst", tmp_path / "out")
    assert os.stat(tmp_path / "out" / "suid").st_mode & 0o7777 == 0o755


def test_plain_archives_without_index_are_extracted(tmp_path, nasty_tree):
    archive = tmp_path / "plain.tar.gz"
    subprocess.run(["tar", "-czf", str(archive), "-C", nasty_tree, "."], check=True)
    result = unpack(archive, tmp_path / "out")
    assert not result.indexed
    before, after = snapshot(nasty_tree), snapshot(tmp_path / "out")
    assert sorted(before) == sorted(after)
    for rel, value in before.items():
        assert after[rel][:2] == value[:2] and after[rel][3] == value[3], rel


def test_cli_round_trip_with_json_summaries(tmp_path, nasty_tree):
    bundle = str(tmp_path / "cli.tar.zst")
    packed = run_pallet("pack", "--json", "--shard-size", "64K", "--jobs", "2", nasty_tree, bundle, check=True)
    assert '"shards"' in packed.stdout
    listed = run_pallet("ls", "--json", bundle, check=True)
    assert len(listed.stdout.splitlines()) == len(snapshot(nasty_tree))
    run_pallet("unpack", bundle, str(tmp_path / "out"), check=True)
    assert_same_tree(nasty_tree, tmp_path / "out")
    verified = run_pallet("verify", bundle, str(tmp_path / "out"), check=True)
    assert "OK" in verified.stdout
