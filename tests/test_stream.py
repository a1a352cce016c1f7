"""Streaming bundle push over a real sshd: same trees, bounded memory, resume after kill -9, refused bad streams."""
from __future__ import annotations

import glob
import io
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from array import array
from pathlib import Path

import pytest
import zstandard

from bundles import Index, PackOptions, pack
from bundles.codecs import get_codec
from bundles.errors import StreamError
from bundles.progress import NoProgress
from bundles.shards import plan_shards
from bundles.stream import FrameKind, FrameReader, FrameWriter, encode_skeleton
from bundles.tarformat import Kind
from staging_core.operations.push_pull import push
from staging_core.options import StagingOptions
from mpi_stager.send import RelaySink, prepare_source, send_stream
from staging_core.far_side.far_process import FarStagerError
from staging_core.far_side.streaming import stream_push
from staging_core.transports.base import parse_url
from staging_core.transports.registry import open_transport
from tests.conftest import assert_same_tree, make_nasty_tree, run_pallet
from tests.programs import program, python_module, user_env

GATE = Path(__file__).with_name("stream_gate.py")


def tiny_tree(root: Path, count: int, size: int = 40, compressible: bool = True) -> str:
    for n in range(count):
        path = root / f"d{n % 30:02d}" / f"f{n:05d}.txt"
        path.parent.mkdir(parents=True, exist_ok=True)
        body = os.urandom(size // 2).hex().encode()[:size] if compressible else os.urandom(size)
        path.write_bytes(b"%d," % n + body)
    return str(root)


def options(sshd, **overrides) -> StagingOptions:
    settings = dict(strategy="bundle", codec="zstd", stream="on", jobs=2, remote_python=sys.executable,
                    ssh_options=tuple(sshd.ssh_options), retries=0)
    return StagingOptions(**{**settings, **overrides})


def streamed(sshd, src: str, dest: Path, **overrides):
    endpoint = parse_url(sshd.url(str(dest)))
    with open_transport(endpoint, ssh_options=list(sshd.ssh_options)) as transport:
        return stream_push(transport, src, endpoint, "zstd", options(sshd, **overrides), NoProgress())


def same_tree(src: str, dest: Path) -> None:
    assert_same_tree(src, dest)         # strict: nothing of pallet's is left in DEST


def receive_locally(stream: bytes, dest: Path) -> subprocess.CompletedProcess:
    return subprocess.run([*python_module("mpi_stager"), "receive", "--json", str(dest)], input=stream, env=user_env(),
                          capture_output=True)


def encoded(src: str, shard_size: int) -> bytes:
    out = io.BytesIO()
    send_stream(prepare_source(src, "zstd", 1, shard_size), out, lambda stream_id: {}, NoProgress())
    return out.getvalue()


def test_push_streams_a_nasty_tree_by_default_over_ssh(sshd, tmp_path):
    src = make_nasty_tree(str(tmp_path / "src"))
    result = push(src, sshd.url(str(tmp_path / "dest")), options(sshd, stream="auto"))
    assert result.route == "stream" and result.strategy == "bundle" and result.skipped_shards == 0
    same_tree(src, tmp_path / "dest")


def interrupted(src: str, dest: Path, shard_size: int) -> None:
    """A receive that got every shard but not the index frame: DEST keeps its journal for a rerun."""
    cut = receive_locally(encoded(src, shard_size)[:-1], dest)
    assert cut.returncode == 1 and (dest / ".pallet" / "INCOMPLETE").exists(), cut.stderr


def test_many_tiny_files_in_many_shards_and_a_rerun_skips_them_all(sshd, tmp_path):
    src = tiny_tree(tmp_path / "src", 3000)
    first = streamed(sshd, src, tmp_path / "dest", shard_size=64 << 10)
    far = first.receiver
    assert far.shards_total >= 10 and far.shards_received == far.shards_total and far.files == 3000
    assert first.skipped_shards == 0 and far.verified
    same_tree(src, tmp_path / "dest")               # a success leaves no journal behind
    interrupted(src, tmp_path / "resumed", 64 << 10)
    again = streamed(sshd, src, tmp_path / "resumed", shard_size=64 << 10, verify=False)
    assert again.skipped_shards == far.shards_total and again.receiver.data_bytes == 0
    assert again.bytes_sent < first.bytes_sent and not again.receiver.verified
    same_tree(src, tmp_path / "resumed")


def test_the_stream_carries_the_same_index_as_pack(tmp_path):
    src = make_nasty_tree(str(tmp_path / "src"))
    (Path(src) / "big.bin").write_bytes(os.urandom(300_000))
    reader = FrameReader(io.BytesIO(encoded(src, 64 << 10)), "test")
    reader.shard_limit = 1 << 30
    reader.prelude()
    frames = list(iter(reader.next, None))
    packed = pack(src, tmp_path / "b.tar.zst", PackOptions(shard_size=64 << 10, jobs=1))
    assert frames[-1].kind == FrameKind.INDEX
    assert bytes(frames[-1].payload) == Path(packed.sidecar).read_bytes()
    assert FrameKind.DATA in {f.kind for f in frames}


def test_a_file_larger_than_the_shard_size_streams_in_bounded_memory(sshd, tmp_path):
    small = tiny_tree(tmp_path / "small", 5)
    baseline = streamed(sshd, small, tmp_path / "d0", shard_size=1 << 20).receiver.max_rss_bytes
    src = tiny_tree(tmp_path / "src", 5)
    size = 64 << 20
    with open(Path(src) / "big.bin", "wb") as handle:
        for _ in range(size >> 20):
            handle.write(os.urandom(1 << 20))
    outcome = streamed(sshd, src, tmp_path / "dest", shard_size=1 << 20)
    assert outcome.receiver.file_bytes > size and outcome.receiver.data_bytes > size
    assert outcome.receiver.max_rss_bytes - baseline < size // 2
    same_tree(src, tmp_path / "dest")


def test_a_big_file_changed_behind_its_journal_record_is_sent_again(sshd, tmp_path):
    src = tiny_tree(tmp_path / "src", 20)
    big = Path(src) / "big.bin"
    big.write_bytes(os.urandom(300_000))
    interrupted(src, tmp_path / "dest", 64 << 10)
    stamp = big.stat().st_mtime_ns
    big.write_bytes(os.urandom(300_000))               # same size and mtime: same skeleton, same stream id
    os.utime(big, ns=(stamp, stamp))
    again = streamed(sshd, src, tmp_path / "dest", shard_size=64 << 10)
    total = len(plan_shards(prepare_source(src, "zstd", 1, 64 << 10).tree.index, 64 << 10))
    assert again.receiver.shards_received == 1 and again.skipped_shards == total - 1
    same_tree(src, tmp_path / "dest")


def test_far_side_errors_surface_with_their_message(sshd, tmp_path):
    src = tiny_tree(tmp_path / "src", 3)
    (tmp_path / "dest").write_text("a file where the tree should go")
    with pytest.raises(FarStagerError) as caught:
        streamed(sshd, src, tmp_path / "dest")
    assert "exists and is not a directory" in str(caught.value) and caught.value.hint


def test_receiver_refuses_an_unsafe_skeleton_before_writing_anything(tmp_path):
    index = Index("zstd", 3, 1 << 20, paths=[b"ok", b"../evil"], kinds=array("B", [Kind.FILE] * 2),
                  modes=array("I", [0o644] * 2), mtimes=array("q", [0] * 2), sizes=array("Q", [0] * 2),
                  links=[b"", b""], link_groups=array("q", [-1] * 2))
    out = io.BytesIO()
    wire = FrameWriter(out)
    wire.prelude()
    wire.frame(FrameKind.SKELETON, 0, encode_skeleton(index, plan_shards(index, 1 << 20))[0])
    (tmp_path / "in").mkdir()
    done = receive_locally(out.getvalue(), tmp_path / "in" / "dest")
    assert done.returncode == 1 and done.stdout == b""
    assert "unsafe" in done.stderr.decode() and "'..' component" in done.stderr.decode()
    assert os.listdir(tmp_path) == ["in"] and os.listdir(tmp_path / "in") == []


def test_a_corrupted_shard_frame_fails_naming_the_shard(tmp_path):
    src = tiny_tree(tmp_path / "src", 200, size=300)
    stream = bytearray(encoded(src, 16 << 10))
    reader = FrameReader(io.BytesIO(bytes(stream)), "test")
    reader.shard_limit = 1 << 30
    reader.prelude()
    frame = reader.next()
    while frame.kind != FrameKind.SHARD or frame.number < 2:
        frame = reader.next()
    stream[reader.bytes_read - 5] ^= 0x40          # inside shard 2's compressed bytes, the frame's tail
    done = receive_locally(bytes(stream), tmp_path / "dest")
    assert done.returncode == 1 and "shard 2 is damaged" in done.stderr.decode()
    assert (tmp_path / "dest" / ".pallet" / "INCOMPLETE").exists()
    cut = receive_locally(encoded(src, 16 << 10)[:-100], tmp_path / "dest2")
    assert cut.returncode == 1 and "stream ends inside" in cut.stderr.decode()
    assert (tmp_path / "dest2" / ".pallet" / "INCOMPLETE").exists()


def index_frame(stream: bytes) -> tuple[int, bytes]:
    """Where ``stream``'s INDEX frame starts, and its payload."""
    reader = FrameReader(io.BytesIO(stream), "test")
    reader.shard_limit = 1 << 30
    reader.prelude()
    start, frame = reader.bytes_read, reader.next()
    while frame.kind != FrameKind.INDEX:
        start, frame = reader.bytes_read, reader.next()
    return start, bytes(frame.payload)


def with_index_frame(stream: bytes, payload: bytes) -> bytes:
    """``stream`` with its INDEX frame (its last) carrying ``payload`` instead."""
    out = io.BytesIO()
    FrameWriter(out).frame(FrameKind.INDEX, 0, payload)
    return stream[:index_frame(stream)[0]] + out.getvalue()


def test_the_index_frame_is_compared_by_content_not_by_its_compressed_bytes(tmp_path):
    src = tiny_tree(tmp_path / "src", 200, size=300)
    stream = encoded(src, 16 << 10)
    index = Index.from_bytes(index_frame(stream)[1])
    other_level = zstandard.ZstdCompressor(level=19).compress(index.to_blob())
    assert other_level != index.to_bytes()                # as another zstd version may compress it
    done = receive_locally(with_index_frame(stream, other_level), tmp_path / "dest")
    assert done.returncode == 0, done.stderr.decode()
    assert_same_tree(src, tmp_path / "dest")
    index.mtimes[0] += 1
    altered = receive_locally(with_index_frame(stream, index.to_bytes()), tmp_path / "dest2")
    assert altered.returncode == 1 and "index differs from the one assembled" in altered.stderr.decode()


def test_kill_9_of_the_sender_mid_stream_then_a_rerun_resumes(sshd, tmp_path):
    # about 10 MiB that does not compress: three 4 MiB shards, more than ssh and the pipes buffer
    src = tiny_tree(tmp_path / "src", 2500, size=4000, compressible=False)
    dest = tmp_path / "dest"
    gate = f"{sys.executable} {GATE} hold {dest}"
    control = tempfile.mkdtemp(prefix="pst-", dir="/tmp")       # short: ssh control socket paths are limited
    try:
        sender = subprocess.Popen([program("pallet"), "push", "--stream", "on", "--quiet",
                                   "--strategy", "bundle", "--codec", "zstd", "--jobs", "2", "--remote-python", gate,
                                   *[f"--ssh-option={o}" for o in sshd.ssh_options], src, sshd.url(str(dest))],
                                  stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                  env=user_env(TMPDIR=control))
        try:
            wait_for(lambda: glob.glob(str(dest / ".pallet" / "stream-*" / ("shard-" + "[0-9]" * 6))), sender)
        finally:
            os.kill(sender.pid, signal.SIGKILL)
            sender.communicate()
            Path(f"{dest}.release").touch()
        wait_for(lambda: os.path.exists(f"{dest}.gate-exit"))       # the far side saw the stream end
    finally:
        stop_control_masters(control, sshd)
    result = push(src, sshd.url(str(dest)), options(sshd))
    assert result.route == "stream" and result.skipped_shards >= 1
    assert result.bytes_sent < len(encoded(src, 4 << 20))
    same_tree(src, dest)


def test_kill_9_of_the_receiver_fails_the_push_and_a_rerun_resumes(sshd, tmp_path):
    src = tiny_tree(tmp_path / "src", 40, size=2000)
    dest = tmp_path / "dest"
    endpoint = parse_url(sshd.url(str(dest)))
    gate = options(sshd, remote_python=f"{sys.executable} {GATE} kill {dest}", shard_size=16 << 10)
    with (open_transport(endpoint, ssh_options=list(sshd.ssh_options)) as transport,
          pytest.raises(FarStagerError) as caught):
        stream_push(transport, src, endpoint, "zstd", gate, NoProgress())
    assert "status 137" in str(caught.value) and (dest / ".pallet" / "INCOMPLETE").exists()
    again = streamed(sshd, src, dest, shard_size=16 << 10)
    assert again.skipped_shards >= 1 and again.receiver.shards_received + again.skipped_shards >= 4
    same_tree(src, dest)


def wait_for(condition, process: subprocess.Popen | None = None, timeout: float = 120) -> None:
    """Poll ``condition`` until it holds; fail early if ``process`` exits first."""
    deadline = time.monotonic() + timeout
    while not condition():
        if process is not None and process.poll() is not None:
            raise AssertionError(f"exited early ({process.returncode}): {process.stderr.read().decode()}")
        if time.monotonic() > deadline:
            raise AssertionError("timed out")
        time.sleep(0.05)


def stop_control_masters(control: str, sshd) -> None:
    """Stop the ssh ControlMasters a killed pallet left under ``control`` (through their sockets), then remove it."""
    for socket in glob.glob(os.path.join(control, "pallet-ssh-*", "cm")):
        subprocess.run(["ssh", "-p", str(sshd.port), "-o", f"ControlPath={socket}", *sshd.ssh_options, "-O", "exit",
                        f"{sshd.user}@127.0.0.1"], capture_output=True, stdin=subprocess.DEVNULL, timeout=30)
    shutil.rmtree(control, ignore_errors=True)


def test_a_rerun_after_the_source_changed_skips_the_shards_still_in_place(sshd, tmp_path):
    """A stream cut short, then files added and rewritten at the start of the source's order: the rerun is
    another stream (its skeleton differs), yet the shards the first one finished that hold the same entries
    are skipped, since the cuts stayed where they were."""
    src, dest = Path(tiny_tree(tmp_path / "src", 600, size=2000)), tmp_path / "dest"
    endpoint = parse_url(sshd.url(str(dest)))
    gate = options(sshd, remote_python=f"{sys.executable} {GATE} kill:30 {dest}", shard_size=16 << 10)
    with open_transport(endpoint, ssh_options=list(sshd.ssh_options)) as transport, pytest.raises(FarStagerError):
        stream_push(transport, str(src), endpoint, "zstd", gate, NoProgress())
    assert len(glob.glob(str(dest / ".pallet" / "stream-*" / "shard-*"))) >= 30
    for n in range(3):
        (src / "d00" / f"new{n}.txt").write_bytes(os.urandom(700))
    (src / "d00" / "f00030.txt").write_bytes(b"rewritten")
    again = streamed(sshd, str(src), dest, shard_size=16 << 10)
    assert again.skipped_shards >= 20, again
    assert again.bytes_sent < len(encoded(str(src), 16 << 10)) * 0.95
    assert glob.glob(str(dest / ".pallet")) == []
    same_tree(str(src), dest)


def interrupted_stream(sshd, src: Path, dest: Path, shards: int) -> None:
    """Push ``src`` as a stream whose receiver is killed once it has recorded ``shards`` shards."""
    endpoint = parse_url(sshd.url(str(dest)))
    gate = options(sshd, remote_python=f"{sys.executable} {GATE} kill:{shards} {dest}", shard_size=16 << 10)
    with open_transport(endpoint, ssh_options=list(sshd.ssh_options)) as transport, pytest.raises(FarStagerError):
        stream_push(transport, str(src), endpoint, "zstd", gate, NoProgress())
    assert len(glob.glob(str(dest / ".pallet" / "stream-*" / "shard-*"))) >= shards


def test_a_journal_another_operation_wrote_over_is_not_trusted(sshd, tmp_path):
    """A stream cut short, then `pallet unpack` of a bundle holding the same paths with other bytes into DEST,
    then the stream again after a change at the source: nothing is skipped on the cut-short stream's word, and
    DEST ends equal to the source."""
    src, dest = Path(tiny_tree(tmp_path / "src", 300, size=2000)), tmp_path / "dest"
    interrupted_stream(sshd, src, dest, 10)
    other = Path(tiny_tree(tmp_path / "other", 300, size=2000))
    run_pallet("pack", "--quiet", str(other), str(tmp_path / "other.tar.zst"), check=True)
    run_pallet("unpack", "--quiet", str(tmp_path / "other.tar.zst"), str(dest), check=True)
    assert not glob.glob(str(dest / ".pallet" / "stream-*"))         # the unpack dropped the journal
    with open(src / "d05" / "f00005.txt", "ab") as handle:
        handle.write(b"more")
    again = streamed(sshd, str(src), dest, shard_size=16 << 10)
    assert again.skipped_shards == 0, again
    same_tree(str(src), dest)


def test_a_journal_left_without_the_incomplete_marker_is_dropped(sshd, tmp_path):
    """A stream journal in a DEST with no INCOMPLETE marker: an operation finished there since (as an older
    pallet's unpack left it), so its word is stale. Here a file of a recorded shard was rewritten meanwhile;
    the rerun of the same stream drops the journal, skips nothing and restores the file."""
    src, dest = Path(tiny_tree(tmp_path / "src", 300, size=2000)), tmp_path / "dest"
    interrupted_stream(sshd, src, dest, 10)
    (dest / ".pallet" / "INCOMPLETE").unlink()
    landed = sorted(p for p in dest.rglob("f*.txt"))
    assert landed
    landed[0].write_bytes(b"written by another operation")
    again = streamed(sshd, str(src), dest, shard_size=16 << 10)
    assert again.skipped_shards == 0, again
    same_tree(str(src), dest)


@pytest.mark.parametrize("codec", ["gzip", "zstd"])
def test_a_failure_where_a_big_shard_s_bytes_go_reaches_the_caller(codec, monkeypatch):
    """pigz writes a big shard's bytes into a pipe that a relay thread reads and passes on; when passing them on
    fails (the far side went away), that error is what the caller gets, and no thread dies with a traceback."""
    died = []
    monkeypatch.setattr(threading, "excepthook", died.append)

    def gone(_):
        raise StreamError("the far side went away", "far")
    sink = RelaySink(gone)
    with pytest.raises(StreamError, match="went away"):
        get_codec(codec, 1).compress_stream(iter([os.urandom(1 << 20)] * 4), sink, 2)
        sink.finish()
    assert died == []
