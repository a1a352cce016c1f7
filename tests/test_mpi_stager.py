"""mpi_stager with real mpirun: identical trees for several rank counts, resume after SIGKILL, clean failure."""
from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import time

import pytest

from bundles import PackOptions, pack
from bundles.index import Index
from bundles.journal import Journal
from bundles.unpacking import assign_shards
from tests.conftest import assert_same_tree, make_nasty_tree
from tests.programs import program, python_module, user_env

MPIRUN = shutil.which("mpirun")
needs_mpi = pytest.mark.skipif(MPIRUN is None, reason="OpenMPI's mpirun is not installed (./bootstrap.sh installs it)")
MPI_ENV = user_env(OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1",
                   OMPI_MCA_rmaps_base_oversubscribe="1")


def stager(ranks: int, *args: str, timeout: float = 120, **kwargs):
    command = [*python_module("mpi_stager"), "unpack", *args]
    if ranks:
        command = [MPIRUN, "--oversubscribe", "-np", str(ranks), *command]
    return subprocess.run(command, capture_output=True, text=True, timeout=timeout, env=MPI_ENV,
                          stdin=subprocess.DEVNULL, **kwargs)


def make_tiny_files(root, count: int, per_dir: int = 100) -> str:
    for n in range(count):
        path = os.path.join(root, f"d{n // per_dir:04d}", f"f{n:06d}.csv")
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "w") as handle:
            handle.write(f"{n},{n * n}\n" * (1 + n % 7))
    return str(root)


@pytest.fixture(scope="module")
def bundles_by_shape(tmp_path_factory):
    """Bundles with more shards than ranks, fewer shards than ranks, one huge shard and many tiny ones."""
    base = tmp_path_factory.mktemp("shapes")
    many = make_tiny_files(base / "many_src", 3000, per_dir=50)
    nasty = make_nasty_tree(str(base / "nasty_src"))
    huge = base / "huge_src"
    huge.mkdir()
    (huge / "huge.bin").write_bytes(os.urandom(3 << 20))
    for n in range(40):
        (huge / f"tiny{n}").write_bytes(b"t" * n)
    shapes = {"many_shards": (many, 16 * 1024), "few_shards": (nasty, 1 << 30), "huge_and_tiny": (str(huge), 1 << 20)}
    result = {}
    for name, (src, shard_size) in shapes.items():
        bundle = str(base / f"{name}.tar.zst")
        pack(src, bundle, PackOptions(shard_size=shard_size, jobs=2))
        result[name] = (src, bundle)
    return result


@needs_mpi
@pytest.mark.parametrize("ranks", [1, 2, 3, 5])
@pytest.mark.parametrize("shape", ["many_shards", "few_shards", "huge_and_tiny"])
def test_every_rank_count_gives_the_identical_verified_tree(tmp_path, bundles_by_shape, shape, ranks):
    src, bundle = bundles_by_shape[shape]
    dest = tmp_path / "dest"
    done = stager(ranks, "--json", bundle, str(dest))
    assert done.returncode == 0, done.stderr
    assert done.stdout.count("{") == 1          # one summary, from rank 0 only
    assert_same_tree(src, dest)


def test_serial_fallback_without_mpi4py_gives_the_same_tree(tmp_path, bundles_by_shape):
    src, bundle = bundles_by_shape["many_shards"]
    blocker = "import sys; sys.modules['mpi4py'] = None; import runpy; sys.argv[0] = 'mpi_stager'; " \
              "runpy.run_module('mpi_stager', run_name='__main__')"
    for workers, dest in ((1, tmp_path / "one"), (3, tmp_path / "pool")):
        done = subprocess.run([program("python"), "-c", blocker, "unpack", "--workers", str(workers), bundle,
                               str(dest)],
                              capture_output=True, text=True, timeout=120, stdin=subprocess.DEVNULL, env=user_env(),
                              cwd=tmp_path)
        assert done.returncode == 0, done.stderr
        assert_same_tree(src, dest)


def _journal(dest, bundle) -> Journal:
    from bundles import Bundle
    with Bundle.open(bundle) as opened:
        return Journal.for_destination(str(dest), opened.index), opened.index


def _start_unpack(tmp_path, output=subprocess.PIPE):
    """12,000 tiny files packed in 32 KiB shards, and `mpirun -np 2 ... mpi_stager unpack` of them started:
    (src, bundle, dest, journal, index, job)."""
    src = make_tiny_files(tmp_path / "src", 12000, per_dir=200)
    bundle = str(tmp_path / "b.tar.zst")
    pack(src, bundle, PackOptions(shard_size=32 * 1024, jobs=2))
    dest = tmp_path / "dest"
    journal, index = _journal(dest, bundle)
    job = subprocess.Popen([MPIRUN, "--oversubscribe", "-np", "2", *python_module("mpi_stager"), "unpack",
                            bundle, str(dest)], env=MPI_ENV, stdin=subprocess.DEVNULL, stdout=output, stderr=output)
    return src, bundle, dest, journal, index, job


@needs_mpi
def test_sigkill_of_one_rank_then_rerun_redoes_only_unfinished_shards(tmp_path, sweep_mpi_segments):
    src, bundle, dest, journal, index, job = _start_unpack(tmp_path)
    killed = _kill_one_rank_after(job, journal, index, records=5)
    job.communicate(timeout=60)
    assert killed, "the unpack finished before a rank could be killed"
    assert job.returncode != 0
    assert (dest / ".pallet" / "INCOMPLETE").exists()
    first = set(journal.finished_shards(index))
    assert 0 < len(first) < len(index.shards)

    rerun = stager(2, "--json", bundle, str(dest))
    assert rerun.returncode == 0, rerun.stderr
    summary = json.loads(rerun.stdout.strip().splitlines()[-1])
    assert summary["shards_skipped"] == len(first), "a shard finished before the kill was extracted again"
    assert summary["shards_done"] == len(index.shards) - len(first)
    assert_same_tree(src, dest)         # journal and marker gone: nothing of pallet's left


@needs_mpi
def test_ranks_die_with_a_killed_mpirun_and_a_rerun_converges(tmp_path, sweep_mpi_segments):
    src, bundle, dest, journal, index, job = _start_unpack(tmp_path, subprocess.DEVNULL)
    ranks: list[int] = []
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and job.poll() is None and not ranks:
        if len(journal.finished_shards(index)) >= 3:
            ranks = _python_descendants(job.pid)
        time.sleep(0.005)
    assert len(ranks) == 2, "the unpack finished before mpirun could be killed"
    job.kill()
    job.wait()
    survivors = ranks
    deadline = time.monotonic() + 10
    while survivors and time.monotonic() < deadline:
        survivors = [pid for pid in ranks if _alive(pid)]
        time.sleep(0.05)
    for pid in survivors:
        os.kill(pid, signal.SIGKILL)            # clean up before failing
    assert not survivors, f"ranks {survivors} outlived their mpirun"
    finished = len(journal.finished_shards(index))
    assert finished < len(index.shards), "the ranks went on to finish the job after mpirun was killed"
    rerun = stager(2, bundle, str(dest))
    assert rerun.returncode == 0, rerun.stderr
    assert_same_tree(src, dest)


def _alive(pid: int) -> bool:
    """True while ``pid`` runs (a zombie waiting for its reaper counts as gone)."""
    try:
        with open(f"/proc/{pid}/stat") as handle:
            return handle.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def _kill_one_rank_after(job, journal: Journal, index: Index, records: int) -> bool:
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and job.poll() is None:
        if len(journal.finished_shards(index)) >= records:
            ranks = _python_descendants(job.pid)
            if ranks:
                os.kill(ranks[-1], signal.SIGKILL)
                return True
        time.sleep(0.005)
    return False


def _python_descendants(pid: int) -> list[int]:
    found, stack = [], [pid]
    while stack:
        current = stack.pop()
        try:
            with open(f"/proc/{current}/task/{current}/children") as handle:
                children = [int(c) for c in handle.read().split()]
        except OSError:
            continue
        for child in children:
            try:
                with open(f"/proc/{child}/cmdline", "rb") as handle:
                    if b"mpi_stager" in handle.read():
                        found.append(child)
            except OSError:
                pass
            stack.append(child)
    return found


@needs_mpi
def test_a_corrupted_shard_fails_every_rank_cleanly_with_one_summary(tmp_path):
    src = make_tiny_files(tmp_path / "src", 2000, per_dir=100)
    bundle = tmp_path / "b.tar.zst"
    result = pack(src, bundle, PackOptions(shard_size=16 * 1024, jobs=2))
    victim = result.index.shards[len(result.index.shards) // 2]
    data = bytearray(bundle.read_bytes())
    data[victim.offset + victim.length // 2] ^= 0xFF
    bundle.write_bytes(bytes(data))
    done = stager(3, str(bundle), str(tmp_path / "dest"), timeout=90)
    assert done.returncode == 1
    assert done.stderr.count("mpi_stager unpack: error") == 1
    assert f"shard {victim.number}" in done.stderr
    assert "Traceback" not in done.stderr
    assert (tmp_path / "dest" / ".pallet" / "INCOMPLETE").exists()


def test_assignment_balances_cost_and_covers_every_shard(bundles_by_shape):
    from bundles import Bundle
    with Bundle.open(bundles_by_shape["many_shards"][1]) as opened:
        shards = opened.index.shards
    for ranks in (1, 2, 3, 5, 64):
        plan = assign_shards(shards, ranks)
        numbers = [n for part in plan.static for n in part] + plan.dynamic
        assert sorted(numbers) == [s.number for s in shards]
        assert len(plan.static) == ranks


def _mpi_pack(ranks: int, *args: str):
    command = [*python_module("mpi_stager"), "pack", *args]
    if ranks:
        command = [MPIRUN, "--oversubscribe", "-np", str(ranks), *command]
    return subprocess.run(command, capture_output=True, text=True, timeout=120, env=MPI_ENV, stdin=subprocess.DEVNULL)


@needs_mpi
@pytest.mark.parametrize("ranks", [1, 2, 3])
@pytest.mark.parametrize("codec", ["zstd", "gzip"])
def test_parallel_pack_is_byte_identical_to_serial_pack(tmp_path, bundles_by_shape, ranks, codec):
    src = make_nasty_tree(str(tmp_path / "src"))
    serial = tmp_path / "serial.tar"
    pack(src, serial, PackOptions(codec=codec, shard_size=64 * 1024, jobs=2))
    parallel = tmp_path / "parallel.tar"
    done = _mpi_pack(ranks, "--codec", codec, "--shard-size", str(64 * 1024), src, str(parallel))
    assert done.returncode == 0, done.stderr
    assert parallel.read_bytes() == serial.read_bytes()
    assert (tmp_path / "parallel.tar.pidx").read_bytes() == (tmp_path / "serial.tar.pidx").read_bytes()
    assert sorted(os.listdir(tmp_path)) == ["parallel.tar", "parallel.tar.pidx", "serial.tar", "serial.tar.pidx", "src"]


@needs_mpi
def test_parallel_pack_of_a_missing_source_fails_once_and_cleanly(tmp_path):
    done = _mpi_pack(2, str(tmp_path / "missing"), str(tmp_path / "b.tar.zst"))
    assert done.returncode == 1
    assert done.stderr.count("does not exist") == 1 and "Traceback" not in done.stderr
    assert os.listdir(tmp_path) == []


@needs_mpi
def test_an_unpack_of_a_changed_bundle_skips_the_shards_an_earlier_one_finished(tmp_path, sweep_mpi_segments):
    """A bundle unpacked with --keep-journal (as a cut-short unpack leaves it), then files added and rewritten
    at the start of the source's order and the source packed again: the new bundle's unpack takes over the
    records of the shards with the same bytes (content-defined cuts keep them) and extracts only the rest."""
    src = make_tiny_files(tmp_path / "src", 3000, per_dir=50)
    first, second, dest = tmp_path / "first.tar.zst", tmp_path / "second.tar.zst", tmp_path / "dest"
    pack(src, first, PackOptions(shard_size=16 * 1024, jobs=2))
    kept = stager(0, "--keep-journal", str(first), str(dest))
    assert kept.returncode == 0 and (dest / ".pallet" / "INCOMPLETE").exists(), kept.stderr
    for n in range(3):
        (tmp_path / "src" / "d0000" / f"g{n}.csv").write_text(f"new {n}\n")
    (tmp_path / "src" / "d0000" / "f000001.csv").write_text("rewritten, longer than before\n")
    shards = len(pack(src, second, PackOptions(shard_size=16 * 1024, jobs=2)).index.shards)
    again = stager(2, "--json", str(second), str(dest))
    assert again.returncode == 0, again.stderr
    summary = json.loads(again.stdout.strip().splitlines()[-1])
    assert shards > 20 and summary["shards_skipped"] >= shards - 4, (summary, shards)
    assert summary["shards_skipped"] + summary["shards_done"] == shards
    assert_same_tree(src, dest)


@needs_mpi
@pytest.mark.parametrize("where", ["local", "ssh"])
def test_an_individual_push_drops_the_journal_of_an_unpack_it_writes_over(tmp_path, sweep_mpi_segments, where,
                                                                           request):
    """An unpack of A left unfinished (its journal kept), then an individual push of B into the same DEST (as a
    local path, or over ssh) that writes B's bytes under A's names and fails on one file: the push dropped
    A's journal first, so a rerun of A's unpack trusts no record, and DEST ends as A's tree."""
    src_a = make_tiny_files(tmp_path / "a", 600, per_dir=50)
    src_b = make_tiny_files(tmp_path / "b", 600, per_dir=50)
    for path in (tmp_path / "b").rglob("*.csv"):
        path.write_text("other bytes, of another length\n")
    (tmp_path / "b" / "zz").write_text("a file where DEST has a directory\n")
    bundle, dest = tmp_path / "a.tar.zst", tmp_path / "dest"
    pack(src_a, bundle, PackOptions(shard_size=16 * 1024, jobs=2))
    assert stager(0, "--keep-journal", str(bundle), str(dest)).returncode == 0
    assert list((dest / ".pallet").glob("journal-*"))
    (dest / "zz" / "x").mkdir(parents=True)
    target, ssh = str(dest), []
    if where == "ssh":
        sshd = request.getfixturevalue("sshd")
        target, ssh = sshd.url(str(dest)), [f"--ssh-option={o}" for o in sshd.ssh_options]
    pushed = subprocess.run([program("pallet"), "push", "--quiet", "--retries", "0", "--strategy", "individual",
                             *ssh, src_b, target], env=user_env(), capture_output=True, text=True,
                            stdin=subprocess.DEVNULL)
    assert pushed.returncode != 0 and (dest / "d0000" / "f000000.csv").read_text().startswith("other")
    assert "Traceback" not in pushed.stderr and (dest / ".pallet" / "INCOMPLETE").exists()
    assert not list((dest / ".pallet").glob("journal-*"))
    shutil.rmtree(dest / "zz")
    again = stager(0, "--json", str(bundle), str(dest))
    assert again.returncode == 0, again.stderr
    assert json.loads(again.stdout.strip().splitlines()[-1])["shards_skipped"] == 0
    assert_same_tree(src_a, dest)


@needs_mpi
@pytest.mark.parametrize("where", ["local", "ssh"])
def test_a_hybrid_push_drops_the_journal_of_an_unpack_its_large_files_write_over(tmp_path, sweep_mpi_segments,
                                                                                   where, request):
    """An unpack of A left unfinished, then a hybrid push of B whose large files (B's bytes under A's names) go
    one by one while its bundle part fails before any unpack: the push dropped A's journal first, so A's
    rerun trusts no record and restores A's large files."""
    src_a = make_tiny_files(tmp_path / "a", 200, per_dir=50)
    src_b = make_tiny_files(tmp_path / "b", 200, per_dir=50)
    for root, fill in ((tmp_path / "a", b"A"), (tmp_path / "b", b"B")):
        for n in range(3):
            (root / f"big{n}.bin").write_bytes(fill * 300_000)
    bundle, dest = tmp_path / "a.tar.zst", tmp_path / "dest"
    pack(src_a, bundle, PackOptions(shard_size=16 * 1024, jobs=1))
    assert stager(0, "--keep-journal", str(bundle), str(dest)).returncode == 0
    assert list((dest / ".pallet").glob("journal-*"))
    target, extra = str(dest), []
    if where == "ssh":      # the far side's unpack dies before it starts
        sshd = request.getfixturevalue("sshd")
        wrapper = tmp_path / "py"
        wrapper.write_text(f'#!/bin/sh\ncase " $* " in *" unpack "*) echo killed >&2; exit 1;; esac\n'
                           f'exec {program("python")} "$@"\n')
        wrapper.chmod(0o755)
        target = sshd.url(str(dest))
        extra = [f"--ssh-option={o}" for o in sshd.ssh_options] + ["--remote-python", str(wrapper)]
    else:                   # the bundle's incoming directory cannot be made
        (dest / ".pallet" / "incoming").write_text("x\n")
    pushed = subprocess.run([program("pallet"), "push", "--quiet", "--retries", "0", "--strategy", "hybrid",
                             "--large-file", "100K", *extra, src_b, target], env=user_env(), capture_output=True,
                            text=True, stdin=subprocess.DEVNULL)
    assert pushed.returncode != 0 and "Traceback" not in pushed.stderr, pushed.stderr
    assert (dest / "big0.bin").read_bytes()[:1] == b"B"
    assert not list((dest / ".pallet").glob("journal-*"))
    shutil.rmtree(dest / ".pallet" / "incoming", ignore_errors=True)     # the failed push's, which its rerun clears
    (dest / ".pallet" / "incoming").unlink(missing_ok=True)
    again = stager(0, "--json", str(bundle), str(dest))
    assert again.returncode == 0, again.stderr
    assert json.loads(again.stdout.strip().splitlines()[-1])["shards_skipped"] == 0
    assert_same_tree(src_a, dest)


@needs_mpi
def test_a_journal_kept_elsewhere_is_not_trusted_after_another_unpack(tmp_path, sweep_mpi_segments):
    """`--journal DIR` keeps the journal outside DEST, where other writers cannot drop it. An unpack of A left
    unfinished with it, then `pallet unpack` of B (other bytes under A's names) finishes in DEST: the rerun of
    A with that journal sees that DEST's marker is not its run's, trusts no record, and leaves A's tree."""
    src_a = make_tiny_files(tmp_path / "a", 600, per_dir=50)
    src_b = make_tiny_files(tmp_path / "b", 600, per_dir=50)
    for path in (tmp_path / "b").rglob("*.csv"):
        path.write_text("other bytes, of another length\n")
    a, b, dest, journal = tmp_path / "a.tar.zst", tmp_path / "b.tar.zst", tmp_path / "dest", tmp_path / "journal"
    pack(src_a, a, PackOptions(shard_size=16 * 1024, jobs=2))
    pack(src_b, b, PackOptions(shard_size=16 * 1024, jobs=2))
    assert stager(0, "--keep-journal", "--journal", str(journal), str(a), str(dest)).returncode == 0
    assert list(journal.glob("shard-*"))
    unpacked = subprocess.run([program("pallet"), "unpack", "--quiet", str(b), str(dest)], env=user_env(),
                              capture_output=True, text=True, stdin=subprocess.DEVNULL)
    assert unpacked.returncode == 0, unpacked.stderr
    again = stager(0, "--json", "--journal", str(journal), str(a), str(dest))
    assert again.returncode == 0, again.stderr
    assert json.loads(again.stdout.strip().splitlines()[-1])["shards_skipped"] == 0
    assert_same_tree(src_a, dest)
