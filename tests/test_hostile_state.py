"""pallet's own names in hostile places: reserved names refused by name, links planted at DEST/.pallet never
followed."""
from __future__ import annotations

import io
import json
import os
import struct
import subprocess
import sys
import tarfile
from array import array
from pathlib import Path

import pytest

from bundles import Index
from bundles.progress import NoProgress
from bundles.shards import ShardPlan, plan_shards
from bundles.stream import FrameKind, FrameWriter, encode_skeleton
from bundles.tarformat import Kind
from mpi_stager.send import prepare_source, send_stream
from tests.conftest import assert_same_tree, run_pallet
from tests.programs import program, python_module, user_env


def small_tree(root: Path) -> str:
    for n in range(30):
        path = root / f"d{n % 3}" / f"f{n}.txt"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(f"{n}\n")
    return str(root)


def assert_refused(done: subprocess.CompletedProcess, *names: str) -> None:
    assert done.returncode == 1, (done.returncode, done.stderr)
    assert "Traceback" not in done.stderr and "reserved" in done.stderr, done.stderr
    for name in names:
        assert name in done.stderr, (name, done.stderr)


# ---------------------------------------------------------------- reserved names

@pytest.mark.parametrize("planted", [".pallet/lock", "d1/.pallet-partial/f1.txt"])
def test_a_source_holding_a_reserved_name_is_refused_by_name(tmp_path, planted):
    src = small_tree(tmp_path / "src")
    (Path(src) / planted).parent.mkdir(parents=True, exist_ok=True)
    (Path(src) / planted).write_text("not pallet's")
    assert_refused(run_pallet("pack", src, str(tmp_path / "b.tar.zst")), planted)
    assert not (tmp_path / "b.tar.zst").exists()
    assert_refused(run_pallet("push", src, str(tmp_path / "dest")), planted)
    assert not (tmp_path / "dest" / "d0").exists()


def test_a_plain_archive_with_reserved_members_never_writes_them(tmp_path):
    """A plain archive is read once, in order: safe members before a refused one may be written (DEST stays
    marked unfinished), the reserved ones never are."""
    archive = tmp_path / "evil.tar.gz"
    with tarfile.open(archive, "w:gz") as tar:
        for name in ("ok.txt", ".pallet/INCOMPLETE", "sub/.pallet-partial/x"):
            data = b"poison\n"
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    done = run_pallet("unpack", str(archive), str(tmp_path / "dest"))
    assert_refused(done, ".pallet/INCOMPLETE", "sub/.pallet-partial/x")
    assert not (tmp_path / "dest" / "sub" / ".pallet-partial").exists()
    assert "poison" not in (tmp_path / "dest" / ".pallet" / "INCOMPLETE").read_text()


def test_a_stream_with_a_reserved_member_is_refused_before_writing(tmp_path):
    names = [b"ok", b".pallet", b".pallet/journal-x"]
    index = Index("zstd", 3, 1 << 20, paths=names, kinds=array("B", [Kind.FILE, Kind.DIR, Kind.DIR]),
                  modes=array("I", [0o644, 0o755, 0o755]), mtimes=array("q", [0] * 3), sizes=array("Q", [0] * 3),
                  links=[b""] * 3, link_groups=array("q", [-1] * 3))
    out = io.BytesIO()
    wire = FrameWriter(out)
    wire.prelude()
    wire.frame(FrameKind.SKELETON, 0, encode_skeleton(index, plan_shards(index, 1 << 20))[0])
    done = subprocess.run([*python_module("mpi_stager"), "receive", "--json", str(tmp_path / "dest")],
                          input=out.getvalue(), env=user_env(), capture_output=True, cwd=tmp_path)
    assert done.returncode == 1 and b"reserved" in done.stderr and b"'.pallet'" in done.stderr, done.stderr
    assert not (tmp_path / "dest").exists()


def test_a_stream_whose_shard_sent_whole_would_exceed_the_hold_limit_is_refused_before_writing(tmp_path):
    """A crafted skeleton planning three 400 MiB files into one shard sent whole (pallet's planner would cut
    it in two): the receiver would have to hold 1.2 GiB of it, so it refuses the plan in one line, before
    DEST is made, whatever bytes might follow."""
    index = Index("zstd", 3, 4 << 30, paths=[b"a", b"b", b"c"], kinds=array("B", [Kind.FILE] * 3),
                  modes=array("I", [0o644] * 3), mtimes=array("q", [0] * 3), sizes=array("Q", [400 << 20] * 3),
                  links=[b""] * 3, link_groups=array("q", [-1] * 3))
    assert len(plan_shards(index, 4 << 30)) == 2
    plans = [ShardPlan(0, 0, 3, False, True)]
    out = io.BytesIO()
    wire = FrameWriter(out)
    wire.prelude()
    wire.frame(FrameKind.SKELETON, 0, encode_skeleton(index, plans)[0])
    done = subprocess.run([*python_module("mpi_stager"), "receive", "--json", str(tmp_path / "dest")],
                          input=out.getvalue(), env=user_env(), capture_output=True, cwd=tmp_path)
    assert done.returncode == 1 and b"more than a receiver holds" in done.stderr, done.stderr
    assert b"Traceback" not in done.stderr and len(done.stderr.strip().splitlines()) <= 2, done.stderr
    assert not (tmp_path / "dest").exists()


def test_a_small_shard_frame_may_not_grow_to_a_big_shard_s_size(tmp_path):
    """A skeleton with a 64 GiB file (a big shard, whose bytes come in DATA frames) and a 10-byte file: no
    SHARD or SKIP frame may be longer than the columns and bytes of the small shard, so one claiming 600 MB is
    refused from its header, before any of it is read (it was allowed up to the big file's size)."""
    index = Index("zstd", 3, 64 << 20, paths=[b"a", b"b"], kinds=array("B", [Kind.FILE] * 2),
                  modes=array("I", [0o644] * 2), mtimes=array("q", [0] * 2), sizes=array("Q", [64 << 30, 10]),
                  links=[b""] * 2, link_groups=array("q", [-1] * 2))
    plans = plan_shards(index, 64 << 20)
    assert [(p.count, p.big) for p in plans] == [(1, True), (1, False)]
    out = io.BytesIO()
    wire = FrameWriter(out)
    wire.prelude()
    wire.frame(FrameKind.SKELETON, 0, encode_skeleton(index, plans)[0])
    out.write(struct.pack("<B3xIQ", FrameKind.SKIP, 0, 600 << 20))
    done = subprocess.run([*python_module("mpi_stager"), "receive", "--json", str(tmp_path / "dest")],
                          input=out.getvalue(), env=user_env(), capture_output=True, cwd=tmp_path)
    assert done.returncode == 1 and b"longer than allowed" in done.stderr, done.stderr
    assert b"Traceback" not in done.stderr


def test_a_shard_size_above_what_a_stream_carries_is_stored_and_forwarded(sshd, tmp_path):
    """--shard-size beyond MAX_STREAMED_SHARD_SIZE: --stream on is a usage error naming the limit, and the
    default pushes the bundle stored and forwarded, with a strictly equal tree."""
    src = small_tree(tmp_path / "src")
    ssh = ["--remote-python", sys.executable, *[f"--ssh-option={o}" for o in sshd.ssh_options]]
    refused = run_pallet("push", "--strategy", "bundle", "--shard-size", "128M", "--stream", "on", *ssh,
                         src, sshd.url(str(tmp_path / "dest")))
    assert refused.returncode == 2 and "--shard-size above 64M" in refused.stderr, refused.stderr
    assert not (tmp_path / "dest").exists()             # refused before anything was opened
    pushed = run_pallet("push", "--json", "--strategy", "bundle", "--shard-size", "128M", *ssh,
                        src, sshd.url(str(tmp_path / "dest")))
    assert pushed.returncode == 0, pushed.stderr
    assert "stream" not in json.loads(pushed.stdout.strip().splitlines()[-1])["route"]
    assert_same_tree(src, str(tmp_path / "dest"))


# ---------------------------------------------------------------- a link planted at DEST/.pallet

@pytest.fixture
def planted(tmp_path):
    """DEST holding a symlink .pallet -> a sentinel directory outside DEST; yields (dest, sentinel)."""
    dest, sentinel = tmp_path / "dest", tmp_path / "sentinel"
    dest.mkdir()
    sentinel.mkdir()
    (dest / ".pallet").symlink_to(sentinel)
    yield dest, sentinel
    assert os.listdir(sentinel) == [], "pallet wrote through a link it did not make"


def assert_link_refused(done: subprocess.CompletedProcess, dest: Path) -> None:
    assert done.returncode == 1, (done.returncode, done.stderr)
    assert "Traceback" not in done.stderr and "is a symbolic link" in done.stderr, done.stderr
    assert str(dest / ".pallet") in done.stderr


def test_unpack_does_not_follow_a_planted_state_link(tmp_path, planted):
    dest, _ = planted
    src = small_tree(tmp_path / "src")
    run_pallet("pack", src, str(tmp_path / "b.tar.zst"), check=True)
    assert_link_refused(run_pallet("unpack", str(tmp_path / "b.tar.zst"), str(dest)), dest)
    stager = subprocess.run([*python_module("mpi_stager"), "unpack", str(tmp_path / "b.tar.zst"), str(dest)],
                            env=user_env(), capture_output=True, text=True, cwd=tmp_path)
    assert_link_refused(stager, dest)


def test_local_push_and_pull_do_not_follow_a_planted_state_link(tmp_path, planted):
    dest, _ = planted
    src = small_tree(tmp_path / "src")
    assert_link_refused(run_pallet("push", "--strategy", "bundle", src, str(dest)), dest)
    assert_link_refused(run_pallet("pull", "--strategy", "bundle", src, str(dest)), dest)


def test_a_streamed_push_over_ssh_does_not_follow_a_planted_state_link(sshd, tmp_path, planted):
    dest, _ = planted
    src = small_tree(tmp_path / "src")
    done = run_pallet("push", "--strategy", "bundle", "--remote-python", sys.executable,
                      *[f"--ssh-option={o}" for o in sshd.ssh_options], src, sshd.url(str(dest)))
    assert done.returncode != 0 and "is a symbolic link" in done.stderr and "Traceback" not in done.stderr, \
        done.stderr


def test_an_individual_push_over_ssh_drops_no_journal_through_a_planted_state_link(sshd, tmp_path):
    """DEST/.pallet planted as a link to a directory that looks like an interrupted run's state (a marker and
    journals): the push's journal drop there does not follow it, and the files land."""
    dest, sentinel = tmp_path / "dest", tmp_path / "sentinel"
    dest.mkdir()
    sentinel.mkdir()
    for name in ("INCOMPLETE", "journal-1", "stream-2"):
        (sentinel / name).write_text("not pallet's\n")
    (dest / ".pallet").symlink_to(sentinel)
    src = small_tree(tmp_path / "src")
    done = run_pallet("push", "--strategy", "individual", *[f"--ssh-option={o}" for o in sshd.ssh_options],
                      src, sshd.url(str(dest)))
    assert done.returncode == 0 and "Traceback" not in done.stderr, done.stderr
    assert sorted(os.listdir(sentinel)) == ["INCOMPLETE", "journal-1", "stream-2"]
    assert_same_tree(src, str(dest))


# ---------------------------------------------------------------- the destination's lock

def test_unpack_mpi_stager_and_receive_stop_on_a_locked_destination(tmp_path):
    import fcntl
    src = small_tree(tmp_path / "src")
    bundle = str(tmp_path / "b.tar.zst")
    run_pallet("pack", src, bundle, check=True)
    dest = tmp_path / "dest"
    dest.mkdir()
    holder = os.open(dest, os.O_RDONLY | os.O_DIRECTORY)
    fcntl.flock(holder, fcntl.LOCK_EX)          # as a running push, pull or unpack holds it
    try:
        unpacked = run_pallet("unpack", bundle, str(dest))
        stager = subprocess.run([*python_module("mpi_stager"), "unpack", bundle, str(dest)], env=user_env(),
                                capture_output=True, text=True, cwd=tmp_path)
        stream = io.BytesIO()
        send_stream(prepare_source(src, "zstd", 1), stream, lambda stream_id: {}, NoProgress())
        received = subprocess.run([*python_module("mpi_stager"), "receive", str(dest)], input=stream.getvalue(),
                                  env=user_env(), capture_output=True, cwd=tmp_path)
    finally:
        os.close(holder)
    for done in (unpacked, stager):
        assert done.returncode == 4 and "another pallet operation" in done.stderr, done.stderr
        assert "Traceback" not in done.stderr
    assert received.returncode == 4 and b"another pallet operation" in received.stderr, received.stderr
    assert os.listdir(dest) == []
    run_pallet("unpack", bundle, str(dest), check=True)                     # free again


# ---------------------------------------------------------------- a damaged locator is never a plain archive

@pytest.mark.parametrize("codec, offset", [("zstd", -50), ("gzip", -60), ("none", -50)])
def test_a_damaged_locator_without_sidecar_is_an_error_not_a_plain_archive(tmp_path, codec, offset):
    src = small_tree(tmp_path / "src")
    bundle = tmp_path / "b.tar"
    run_pallet("pack", "--codec", codec, src, str(bundle), check=True)
    (tmp_path / "b.tar.pidx").unlink()
    data = bytearray(bundle.read_bytes())
    data[offset] ^= 0x01                        # inside the locator's magic
    bundle.write_bytes(data)
    for command in (["unpack", str(bundle), str(tmp_path / "out")], ["verify", str(bundle)]):
        done = run_pallet(*command)
        assert done.returncode == 1 and "locator" in done.stderr and "Traceback" not in done.stderr, done.stderr
    assert "--no-index" in run_pallet("unpack", str(bundle), str(tmp_path / "out")).stderr
    run_pallet("unpack", "--no-index", str(bundle), str(tmp_path / "plain"), check=True)
    assert_same_tree(src, tmp_path / "plain", whole_seconds=True)       # a plain archive's mtimes: its tar headers


# ---------------------------------------------------------------- bounded memory on ordinary plain archives

@pytest.mark.slow
def test_a_plain_tar_gz_of_one_1_gib_file_unpacks_within_1_gib_of_address_space(tmp_path):
    import shutil
    if not shutil.which("prlimit") or not shutil.which("pigz"):
        pytest.skip("needs prlimit (util-linux) and pigz")
    (tmp_path / "src").mkdir()
    with open(tmp_path / "src" / "zeros", "wb") as handle:
        handle.truncate(1 << 30)
    archive = tmp_path / "one.tar.gz"
    with open(archive, "wb") as out:
        tar = subprocess.Popen(["tar", "-cf", "-", "-C", str(tmp_path), "src"], stdout=subprocess.PIPE)
        subprocess.run(["pigz", "-1"], stdin=tar.stdout, stdout=out, check=True)
        assert tar.wait() == 0
    (tmp_path / "src" / "zeros").unlink()
    done = subprocess.run(["prlimit", f"--as={1 << 30}", program("pallet"), "unpack", str(archive),
                           str(tmp_path / "out")],
                          env=user_env(), capture_output=True, text=True, cwd=tmp_path, timeout=300)
    assert done.returncode == 0, done.stderr
    assert (tmp_path / "out" / "src" / "zeros").stat().st_size == 1 << 30


@pytest.mark.parametrize("read_size", [1, 7, 512, 10240, 1 << 20])
def test_the_gzip_reader_returns_at_most_what_is_asked_across_members(read_size):
    import gzip
    import random
    from bundles.codecs import get_codec
    rng = random.Random(read_size)
    parts = [rng.randbytes(rng.randint(0, 5000)) + bytes(rng.randint(0, 200_000)) for _ in range(5)]
    stream = get_codec("gzip").open_stream(io.BytesIO(b"".join(gzip.compress(p, 1) for p in parts)))
    got = bytearray()
    while chunk := stream.read(read_size):
        assert len(chunk) <= read_size
        got += chunk
    assert bytes(got) == b"".join(parts)


# ---------------------------------------------------------------- state reached through directory descriptors

def _journal(tmp_path):
    from bundles import Bundle
    from bundles.journal import Journal
    src = small_tree(tmp_path / "src")
    run_pallet("pack", "--quiet", src, str(tmp_path / "b.tar.zst"), check=True)
    with Bundle.open(str(tmp_path / "b.tar.zst")) as bundle:
        index = bundle.index
    dest = tmp_path / "dest"
    dest.mkdir()
    journal = Journal.for_destination(str(dest), index)
    journal.create(str(dest))
    journal.record_shard(index, 0, "run1", 0)
    return dest, journal, index


def test_a_state_directory_swapped_for_a_link_midway_is_never_written_through(tmp_path):
    from bundles.errors import DestinationError
    dest, journal, index = _journal(tmp_path)
    victim = tmp_path / "victim"
    victim.mkdir(mode=0o700)
    (victim / os.path.basename(journal.root) / "runs").mkdir(parents=True)      # the same layout, elsewhere
    os.rename(dest / ".pallet", dest / ".pallet-moved")         # what someone who can write DEST could do
    os.symlink(victim, dest / ".pallet")
    with pytest.raises(DestinationError, match="symbolic link"):
        journal.record_shard(index, 0, "run2", 0)
    with pytest.raises(DestinationError, match="symbolic link"):
        journal.recorded_shards()
    assert [p for p in victim.rglob("*") if not p.is_dir()] == []


def test_a_link_planted_in_the_journal_is_refused_not_followed(tmp_path):
    from bundles.errors import DestinationError
    dest, journal, index = _journal(tmp_path)
    target = tmp_path / "target.txt"
    target.write_text("untouched\n")
    runs = Path(journal.root) / "runs"
    os.symlink(target, runs / "run3.rank0")
    with pytest.raises(DestinationError):
        journal.record_shard(index, 0, "run3", 0)
    os.symlink(target, Path(journal.root) / "shard-000001.tmp0")     # a stale temporary name: replaced, not written
    journal.record_shard(index, 1 % len(index.shards), "run4", 0)
    assert target.read_text() == "untouched\n"
    assert journal.recorded_shards()[0] == index.shards[0].hash


def test_a_journal_directory_given_as_a_link_is_refused(tmp_path):
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir(mode=0o700)
    os.symlink(elsewhere, tmp_path / "journal-link")
    bundle = tmp_path / "b.tar.zst"
    run_pallet("pack", "--quiet", small_tree(tmp_path / "src"), str(bundle), check=True)
    done = subprocess.run([*python_module("mpi_stager"), "unpack", "--journal", str(tmp_path / "journal-link"),
                           str(bundle), str(tmp_path / "dest")], capture_output=True, text=True, env=user_env(),
                          stdin=subprocess.DEVNULL, timeout=120)
    assert done.returncode != 0 and "journal-link" in done.stderr and "symbolic link" in done.stderr, done.stderr
    assert "Traceback" not in done.stderr and os.listdir(elsewhere) == []


# ---------------------------------------------------------------- a FIFO planted among the state files

def _planted_fifo(tmp_path: Path, where: str) -> tuple[Path, Path, Path]:
    """A bundle, and a DEST left as an interrupted unpack leaves it (marked, with its journal) but for a FIFO at
    ``where`` (under DEST/.pallet; JOURNAL stands for the bundle's journal); returns bundle, dest, FIFO."""
    from bundles import Bundle
    from bundles.journal import bundle_id
    bundle = tmp_path / "b.tar.zst"
    run_pallet("pack", "--quiet", small_tree(tmp_path / "src"), str(bundle), check=True)
    with Bundle.open(str(bundle)) as opened:
        journal = f"journal-{bundle_id(opened.index)}"
    dest = tmp_path / "dest"
    for name in (journal, "journal-0123456789abcdef01234567"):
        (dest / ".pallet" / name / "runs").mkdir(parents=True, mode=0o700)
    fifo = dest / ".pallet" / where.replace("JOURNAL", journal)
    if fifo.name != "INCOMPLETE":
        (dest / ".pallet" / "INCOMPLETE").write_text("pallet is unpacking here; rerun to finish\n")
    os.mkfifo(fifo)
    return bundle, dest, fifo


def _unpack_within(argv: list[str]) -> subprocess.CompletedProcess:
    try:
        return subprocess.run(argv, capture_output=True, text=True, env=user_env(), stdin=subprocess.DEVNULL,
                              timeout=60)
    except subprocess.TimeoutExpired:
        pytest.fail(f"{' '.join(argv)} blocked on a FIFO planted in its state directory")


@pytest.mark.usefixtures("each_engine")
@pytest.mark.parametrize("where", ["JOURNAL/shard-000000", "journal-0123456789abcdef01234567/shard-000000"],
                         ids=["its own journal's record", "an interrupted run's journal record"])
def test_a_fifo_planted_in_a_journal_is_refused_by_name_not_waited_on(tmp_path, where):
    bundle, dest, fifo = _planted_fifo(tmp_path, where)
    done = _unpack_within([*python_module("mpi_stager"), "unpack", str(bundle), str(dest)])
    assert done.returncode == 1 and "Traceback" not in done.stderr, done.stderr
    assert str(fifo) in done.stderr and "is a FIFO, not a regular file" in done.stderr, done.stderr
    refused = _unpack_within([program("pallet"), "unpack", "--quiet", str(bundle), str(dest)])
    assert refused.returncode == 1 and "Traceback" not in refused.stderr, refused.stderr   # the same journal
    assert str(fifo) in refused.stderr and "is a FIFO, not a regular file" in refused.stderr, refused.stderr
    fifo.unlink()
    unpacked = _unpack_within([program("pallet"), "unpack", "--quiet", str(bundle), str(dest)])
    assert unpacked.returncode == 0, unpacked.stderr
    assert_same_tree(str(tmp_path / "src"), str(dest))


@pytest.mark.usefixtures("each_engine")
def test_a_fifo_planted_as_the_marker_is_not_waited_on_with_a_journal_elsewhere(tmp_path):
    bundle, dest, fifo = _planted_fifo(tmp_path, "INCOMPLETE")
    done = _unpack_within([*python_module("mpi_stager"), "unpack", "--journal", str(tmp_path / "journal"),
                           str(bundle), str(dest)])
    assert done.returncode == 1 and "Traceback" not in done.stderr, done.stderr
    assert str(fifo) in done.stderr and "is a FIFO" in done.stderr, done.stderr


def test_state_files_are_never_opened_unless_regular(tmp_path):
    """The state-file helpers themselves: a FIFO with a reader waiting, a FIFO without, and a link are refused by
    name for reading and appending; a missing file reads as empty and is made by an append."""
    from bundles.errors import DestinationError
    from bundles.state_fd import append_text, read_text
    state = tmp_path / "state"
    state.mkdir(mode=0o700)
    os.mkfifo(state / "fifo")
    os.symlink(tmp_path / "elsewhere", state / "link")
    fd = os.open(state, os.O_RDONLY | os.O_DIRECTORY)
    reader = os.open(state / "fifo", os.O_RDONLY | os.O_NONBLOCK)      # a writer's open would now succeed
    try:
        for name in ("fifo", "link"):
            with pytest.raises(DestinationError, match=f"state/{name}: is a"):
                read_text(fd, name, str(state / name))
            with pytest.raises(DestinationError, match=f"state/{name}: is a"):
                append_text(fd, name, "1\n", str(state / name))
        assert read_text(fd, "missing", str(state / "missing")) == ""
        append_text(fd, "missing", "1\n", str(state / "missing"))
        assert read_text(fd, "missing", str(state / "missing")) == "1"
    finally:
        os.close(reader)
        os.close(fd)
    assert not (tmp_path / "elsewhere").exists()
