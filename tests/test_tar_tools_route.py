"""A far side without pallet: the probe finds out, bundles go into its own tar, md5sum checks them, reruns repair."""
from __future__ import annotations

import json
import os
import random
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from mpi_stager.wire import STREAM_VERSION
from staging_core.routes.tar_tools import parse_md5_lines
from staging_core.testing import assert_same_tree, make_nasty_tree, snapshot
from tests.programs import program, user_env
from tests.servers import start_bare_sshd

SLOW_ZSTD = """#!/bin/sh
# the far side's zstd, its output slowed to about 2 MB/s so that a test can kill a push mid-transfer
/usr/bin/zstd "$@" | python3 -c '
import sys, time
while True:
    piece = sys.stdin.buffer.read(32768)
    if not piece:
        break
    sys.stdout.buffer.write(piece)
    sys.stdout.buffer.flush()
    time.sleep(0.015)
'
"""


@pytest.fixture(scope="module")
def bare(tmp_path_factory):
    """An sshd whose sessions run in a home of their own with a PATH that has no pallet (nor does python3)."""
    root = tmp_path_factory.mktemp("bare")
    server = start_bare_sshd(root)
    try:
        yield server
    finally:
        server.stop()


def push(server, src, dest, *flags: str, **kwargs) -> subprocess.CompletedProcess:
    ssh = [f"--ssh-option={o}" for o in server.ssh_options]
    return subprocess.run([program("pallet"), "push", "--json", *flags, *ssh,
                           str(src), server.url(str(dest))], capture_output=True, text=True, env=user_env(),
                          stdin=subprocess.DEVNULL, timeout=300, **kwargs)


def _pushed(src, dest) -> bool:
    """Whether ``dest``, pushed from ``src`` through the far side's tar, holds the source tree and nothing else:
    strictly, but for mtimes, which that tar restores at the whole seconds the bundle's tar headers carry."""
    assert_same_tree(src, dest, whole_seconds=True)
    return True


def summary(done: subprocess.CompletedProcess) -> dict:
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


def test_a_nasty_tree_goes_through_the_far_sides_own_tar(bare, tmp_path):
    src = make_nasty_tree(str(tmp_path / "src"))
    first = summary(push(bare, src, tmp_path / "dest", "--strategy", "bundle"))
    assert first["route"].startswith("tar tools (zstd -dc | tar -x") and "pallet remote install" in first["route"]
    assert _pushed(src, tmp_path / "dest")          # strict: nothing of pallet's is left
    again = summary(push(bare, src, tmp_path / "dest", "--strategy", "bundle"))
    assert again["bytes_sent"] == 0 and again["transfers"] == 0


def test_a_flipped_byte_and_a_changed_directory_are_repaired_by_the_next_run(bare, tmp_path):
    src = make_nasty_tree(str(tmp_path / "src"))
    dest = tmp_path / "dest"
    summary(push(bare, src, dest, "--strategy", "bundle"))
    victim = dest / "sub" / "dir" / "hard_c"
    before = os.stat(victim)
    data = bytearray(victim.read_bytes())
    data[0] ^= 0x01
    victim.write_bytes(bytes(data))
    os.utime(victim, ns=(before.st_atime_ns, before.st_mtime_ns))       # same size, same mtime: only md5 sees it
    os.chmod(dest / "links", 0o700)
    (dest / "empty.txt").unlink()
    repaired = summary(push(bare, src, dest, "--strategy", "bundle"))
    assert repaired["bytes_sent"] > 0
    assert _pushed(src, dest)


def test_a_directory_that_only_changed_its_times_or_mode_is_not_sent_again(bare, tmp_path):
    """A file added to d/ moves d's mtime: only the new file and d's header go, not all of d, and a hard link
    in d whose group starts elsewhere stays a link. Then a mode changed on d alone sends d's header only."""
    src, dest = tmp_path / "src", tmp_path / "dest"
    (src / "a").mkdir(parents=True)
    (src / "d").mkdir()
    (src / "a" / "x").write_bytes(b"shared")
    os.link(src / "a" / "x", src / "d" / "h")
    for n in range(50):
        (src / "d" / f"f{n}").write_bytes(os.urandom(20_000))
    first = summary(push(bare, src, dest, "--strategy", "bundle"))
    (src / "d" / "new").write_bytes(b"new")
    second = summary(push(bare, src, dest, "--strategy", "bundle"))
    assert second["bytes_sent"] < first["bytes_sent"] // 20, (first["bytes_sent"], second["bytes_sent"])
    assert _pushed(src, dest)
    os.chmod(src / "d", 0o750)
    third = summary(push(bare, src, dest, "--strategy", "bundle"))
    assert 0 < third["bytes_sent"] < 2048 and _pushed(src, dest), third


def test_links_planted_in_dest_are_replaced_never_written_through(bare, tmp_path):
    src = make_nasty_tree(str(tmp_path / "src"))
    dest, outside = tmp_path / "dest", tmp_path / "outside"
    outside.mkdir()
    dest.mkdir()
    (dest / "sub").symlink_to(outside)                        # where the source has a directory
    (dest / "script.sh").symlink_to(outside / "written")      # where the source has a file
    summary(push(bare, src, dest, "--strategy", "bundle"))
    assert list(outside.iterdir()) == []
    assert _pushed(src, dest)
    here = tmp_path / "here"                                  # and the same planted here, for a pull
    here.mkdir()
    (here / "sub").symlink_to(outside)
    (here / "script.sh").symlink_to(outside / "written")
    summary(pull(bare, src, here, "--strategy", "bundle"))
    assert list(outside.iterdir()) == []
    assert snapshot(here) == snapshot(src)


def test_without_pallet_there_auto_still_bundles_many_small_files(bare, tmp_path):
    src = tmp_path / "src"
    for n in range(2000):
        (src / f"d{n // 200:02d}").mkdir(parents=True, exist_ok=True)
        (src / f"d{n // 200:02d}" / f"f{n:04d}.csv").write_text(f"{n},{n * n}\n")
    done = summary(push(bare, src, tmp_path / "dest"))
    assert done["strategy"] == "bundle" and done["route"].startswith("tar tools"), done
    assert _pushed(src, tmp_path / "dest")


RANDOM_BYTES = 600 * 16384


def random_tree(src: Path) -> Path:
    """600 incompressible 16 KiB files in 6 directories."""
    rng = random.Random(7)
    for n in range(600):
        (src / f"d{n // 100}").mkdir(parents=True, exist_ok=True)
        (src / f"d{n // 100}" / f"r{n:03d}.bin").write_bytes(rng.randbytes(16384))
    return src


def _kill_when_landed(process: subprocess.Popen, dest: Path) -> None:
    """kill -9 the whole pallet process group once 360 of the 600 files have landed, before the last one."""
    deadline = time.monotonic() + 120
    while _landed(dest) < 360 and process.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)
    os.killpg(process.pid, signal.SIGKILL)
    process.wait()
    assert 360 <= _landed(dest) < 600, "the transfer must be killed midway"


def test_a_push_killed_mid_transfer_resumes_and_resends_less_than_half(bare, tmp_path):
    src = random_tree(tmp_path / "src")
    total = RANDOM_BYTES
    slow = bare.shims / "zstd"
    slow.write_text(SLOW_ZSTD)
    slow.chmod(0o755)
    dest = tmp_path / "dest"
    try:
        process = subprocess.Popen([program("pallet"), "push", "--strategy", "bundle", "--reprobe", "--quiet",
                                    *[f"--ssh-option={o}" for o in bare.ssh_options], str(src),
                                    bare.url(str(dest))], env=user_env(), start_new_session=True,
                                   stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        _kill_when_landed(process, dest)
        assert (dest / ".pallet" / "INCOMPLETE").exists()
    finally:
        slow.unlink()
    rerun = _rerun_when_unlocked(bare, src, dest)
    assert 0 < rerun["bytes_sent"] < total / 2, rerun
    assert _pushed(src, dest)


def test_pull_from_a_far_side_without_pallet_uses_its_tar_and_repairs(bare, tmp_path):
    src, dest = make_nasty_tree(str(tmp_path / "src")), tmp_path / "dest"
    first = summary(pull(bare, src, dest, "--strategy", "bundle"))
    assert first["route"].startswith("tar tools (tar -c | zstd -q -c"), first
    assert snapshot(dest) == snapshot(src)
    assert summary(pull(bare, src, dest, "--strategy", "bundle"))["bytes_sent"] == 0
    victim = dest / "links" / "hard_a"
    before = os.stat(victim)
    victim.write_bytes(b"shared inodX")                              # same size; its group shares the damage
    os.utime(victim, ns=(before.st_atime_ns, before.st_mtime_ns))
    (dest / "script.sh").chmod(0o600)
    (dest / "links" / "rel_link").unlink()
    repaired = summary(pull(bare, src, dest, "--strategy", "bundle"))
    assert repaired["bytes_sent"] > 0
    assert snapshot(dest) == snapshot(src)


def pull(server, src, dest, *flags: str) -> subprocess.CompletedProcess:
    ssh = [f"--ssh-option={o}" for o in server.ssh_options]
    return subprocess.run([program("pallet"), "pull", "--json", *flags, *ssh,
                           server.url(str(src)), str(dest)], capture_output=True, text=True, env=user_env(),
                          stdin=subprocess.DEVNULL, timeout=300)


def test_a_pull_killed_mid_transfer_resumes_and_refetches_less_than_half(bare, tmp_path):
    src, dest = random_tree(tmp_path / "src"), tmp_path / "dest"
    slow = bare.shims / "zstd"
    slow.write_text(SLOW_ZSTD)
    slow.chmod(0o755)
    try:
        process = subprocess.Popen([program("pallet"), "pull", "--strategy", "bundle", "--reprobe", "--quiet",
                                    *[f"--ssh-option={o}" for o in bare.ssh_options], bare.url(str(src)), str(dest)],
                                   env=user_env(), start_new_session=True, stdin=subprocess.DEVNULL,
                                   stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        _kill_when_landed(process, dest)
        assert (dest / ".pallet" / "INCOMPLETE").exists()
    finally:
        slow.unlink()
    rerun = summary(pull(bare, src, dest, "--strategy", "bundle"))
    assert 0 < rerun["bytes_sent"] < RANDOM_BYTES / 2, rerun
    assert snapshot(dest) == snapshot(src)


def test_a_far_pallet_of_another_stream_protocol_is_named_with_the_fix(bare, tmp_path):
    fake, recorded = bare.home / "old-pallet-python", bare.home / ".config" / "pallet" / "python"
    fake.write_text('#!/bin/sh\nprintf "/opt/old/bin/python\\t0.0.1\\t99\\n"\n')
    fake.chmod(0o755)
    recorded.parent.mkdir(parents=True)
    recorded.write_text(f"{fake}\n")             # as `pallet remote install` records its Python
    src = make_nasty_tree(str(tmp_path / "src"))
    try:
        done = push(bare, src, tmp_path / "dest", "--reprobe")
    finally:
        recorded.unlink()
    assert done.returncode == 1, done.stderr
    message = done.stderr.strip()
    assert "stream protocol v99" in message and f"v{STREAM_VERSION}" in message and "pallet remote install" in message
    assert "Traceback" not in done.stderr and len(message.splitlines()) <= 2


def test_pallet_behind_a_script_in_local_bin_is_found_without_remote_python(bare, tmp_path):
    script = bare.home / ".local" / "bin" / "pallet"            # as `pip install --user` leaves it, off PATH
    script.parent.mkdir(parents=True, exist_ok=True)
    script.write_text(f"#!{sys.executable}\nfrom staging_core.cli.main import main\nmain()\n")
    script.chmod(0o755)
    src = make_nasty_tree(str(tmp_path / "src"))
    try:
        done = summary(push(bare, src, tmp_path / "dest", "--strategy", "bundle", "--reprobe"))
    finally:
        script.unlink()
    assert done["route"] == "stream", done
    assert _pushed(src, tmp_path / "dest")


def test_plan_shows_what_the_probe_found_and_the_routes_it_allows(bare, tmp_path):
    src = make_nasty_tree(str(tmp_path / "src"))
    done = subprocess.run([program("pallet"), "plan", *[f"--ssh-option={o}" for o in bare.ssh_options], src,
                           bare.url(str(tmp_path / "dest"))], capture_output=True, text=True, env=user_env(),
                          stdin=subprocess.DEVNULL, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "no pallet" in done.stdout and "bundle routes: tar tools" in done.stdout
    assert "GNU tar" in done.stdout and "md5sum" in done.stdout


def _landed(dest: Path) -> int:
    return sum(1 for path in dest.glob("d*/r*.bin")) if dest.exists() else 0


def _rerun_when_unlocked(server, src, dest) -> dict:
    """Rerun the push; the killed one's far-side lock holder may take a moment to see its pipe close."""
    for _ in range(50):
        done = push(server, src, dest, "--strategy", "bundle")
        if done.returncode != 4:
            return summary(done)
        time.sleep(0.2)
    raise AssertionError(f"DEST stayed locked: {done.stderr}")


@pytest.mark.slow
def test_snakemake_reads_2000_inputs_from_a_far_side_without_pallet(bare, tmp_path):
    from tests.test_snakemake_plugin import make_inputs, snakemake
    data = make_inputs(tmp_path / "remote" / "data", 2000)
    done = snakemake(tmp_path / "wf", "--storage-pallet-ssh-options", shlex.join(bare.ssh_options),
                     "--config", f"data={bare.url(str(data))}", "samples=2000", "parts=4")
    assert done.returncode == 0, done.stderr[-3000:]
    assert (tmp_path / "wf" / "results" / "summary.txt").read_text() == f"2000 {3 * 2000 * 1999 // 2}\n"
    fetched = [line for line in done.stderr.splitlines() if "pallet: fetched" in line]
    assert sum(int(line.split("fetched ")[1].split()[0]) for line in fetched) == 2000
    assert all(": bundle, " in line for line in fetched), fetched
    assert not (data / ".pallet").exists()


@pytest.mark.slow
def test_parsl_apps_read_2000_files_from_a_far_side_without_pallet(bare, tmp_path):
    from parsl import python_app
    from parsl.data_provider.files import File

    from pallet_parsl import PalletStaging
    from staging_core.options import StagingOptions
    from tests.test_parsl import finished, read_text, remote_files, threads, workflow
    paths = remote_files(str(tmp_path / "remote"), 2000)
    staging = PalletStaging(options=StagingOptions(ssh_options=tuple(bare.ssh_options)), window=2.0, max_files=2000)
    executor = threads(tmp_path, staging)
    with workflow(tmp_path, executor):
        read = python_app(read_text, executors=[executor.label])
        futures = [read(inputs=[File(bare.url(path))]) for path in paths]
        assert [f.result(timeout=300) for f in futures] == [f"file {n}\n" for n in range(2000)]
        batches = finished(staging)
    assert sum(b.files for b in batches) == 2000 and "bundle" in {b.strategy for b in batches}


def test_parsl_keep_packed_from_a_far_side_without_pallet_says_what_it_needs(bare, tmp_path):
    from parsl import python_app
    from parsl.data_provider.files import File
    from parsl.dataflow.errors import DependencyError

    from pallet_parsl import BatchError, PalletStaging
    from staging_core.options import StagingOptions
    from tests.test_parsl import read_text, remote_files, threads, workflow
    paths = remote_files(str(tmp_path / "remote"), 3)
    staging = PalletStaging(options=StagingOptions(ssh_options=tuple(bare.ssh_options)), window=0.5,
                            keep_packed=True, scratch=str(tmp_path / "scratch"))
    executor = threads(tmp_path, staging)
    with workflow(tmp_path, executor):
        read = python_app(read_text, executors=[executor.label])
        future = read(inputs=[File(bare.url(paths[0]))])
        with pytest.raises(DependencyError) as failed:
            future.result(timeout=120)
    cause = failed.value
    while isinstance(cause, DependencyError):
        cause = cause.dependent_exceptions_tids[0][0]
    assert isinstance(cause, BatchError) and "keep_packed needs a source that packs bundles" in str(cause)
    assert "pallet remote install" in str(cause)


def test_snakemake_keep_packed_from_a_far_side_without_pallet_says_what_it_needs(bare, tmp_path):
    pytest.importorskip("snakemake")
    from snakemake_interface_common.exceptions import WorkflowError

    from snakemake_storage_plugin_pallet import StorageProviderSettings
    from tests.test_snakemake_plugin import make_inputs, provider
    data = make_inputs(tmp_path / "remote" / "data", 3)
    settings = StorageProviderSettings(ssh_options=shlex.join(bare.ssh_options), keep_packed=True,
                                       packed_dir=str(tmp_path / "packed"))
    obj = provider(tmp_path, settings).object(bare.url(str(data / "s00000.csv")))
    with pytest.raises(WorkflowError, match="(?s)keep-packed needs a source that packs bundles.*pallet remote install"):
        obj.retrieve_object()
    assert not obj.local_path().exists()


def test_md5sum_lines_end_only_at_newlines():
    """md5sum before coreutils 9 leaves a carriage return in a name unescaped: it stays in the name, and a
    crafted name cannot forge another file's digest."""
    good, bad = "0" * 32, "f" * 32
    parsed = parse_md5_lines(f"{bad}  ./a\rb\n{bad}  ./z\r{good}  ./y\n{good}  ./y\n".encode())
    assert parsed == {b"a\rb": bytes.fromhex(bad), b"z\r" + good.encode() + b"  ./y": bytes.fromhex(bad),
                      b"y": bytes.fromhex(good)}
