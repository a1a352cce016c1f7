"""One resumable unpack driver behind every entry point: `pallet unpack`, `pallet pull`, `python -m mpi_stager
unpack` alone and under `mpirun -n 3`, with either engine. Each run is stopped for good right after a chosen journal
record (a gate the test loads into the program, see GATE), killed with -9 there, and run again: the rerun extracts
only the shards the journal does not list, its summary says how many it skipped, and DEST ends exactly the bundle's
tree, with nothing of pallet's left."""
from __future__ import annotations

import glob
import json
import os
import shutil
import signal
import subprocess
import time
from contextlib import suppress
from pathlib import Path

import pytest

from bundles import Bundle, PackOptions, pack
from bundles.journal import bundle_id
from bundles.tarformat import Kind
from staging_core.testing import assert_same_tree
from tests.conftest import make_files
from tests.programs import program, python_module, user_env

pytestmark = pytest.mark.usefixtures("each_engine", "sweep_mpi_segments")

MPIRUN = shutil.which("mpirun")
MPI_ENV = {"OMPI_ALLOW_RUN_AS_ROOT": "1", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1",
           "OMPI_MCA_rmaps_base_oversubscribe": "1"}
SHARD_SIZE = 32 * 1024
AFTER = 3               # journal records a process of the killed run writes before its gate stops it

# Loaded as sitecustomize (from PYTHONPATH) by every Python the gated run starts, ranks included: once the
# process has written its AFTER-th journal record it creates GATE/reached.PID and stops there for good, so the
# kill always lands mid-unpack, after exactly the records written so far. Pool workers start with -I -S and do not
# load it; they write no records (the driver journals each shard in the process that hands the work out).
GATE = """\
import os
import signal

if os.environ.get("PALLET_TEST_GATE"):
    from bundles.journal import Journal

    _record, _written = Journal.record_shard, []

    def _gated(self, *args, **kwargs):
        _record(self, *args, **kwargs)
        _written.append(args[1])
        if len(_written) == int(os.environ["PALLET_TEST_GATE_AFTER"]):
            open(os.path.join(os.environ["PALLET_TEST_GATE"], "reached.%d" % os.getpid()), "w").close()
            while True:
                signal.pause()

    Journal.record_shard = _gated
"""


@pytest.fixture(scope="module")
def source(tmp_path_factory) -> str:
    return make_files(tmp_path_factory.mktemp("driver") / "src", 1500, 15, lambda n: os.urandom(150).hex().encode())


@pytest.fixture(scope="module")
def bundle(tmp_path_factory, source) -> str:
    path = str(tmp_path_factory.mktemp("driver-bundle") / "b.tar.zst")
    pack(source, path, PackOptions(shard_size=SHARD_SIZE, jobs=2))
    return path


ENTRY_POINTS = ["pallet unpack", "pallet pull", "mpi_stager unpack", "mpirun -n 3 mpi_stager unpack"]


def _argv(entry: str, source: str, bundle: str, dest: Path) -> list[str]:
    stager = [*python_module("mpi_stager"), "unpack", "--json"]
    return {
        "pallet unpack": [program("pallet"), "unpack", "--json", "--quiet", "--jobs", "2", bundle, str(dest)],
        "pallet pull": [program("pallet"), "pull", "--json", "--quiet", "--strategy", "bundle", "--stream", "off",
                        "--shard-size", str(SHARD_SIZE), source, str(dest)],
        "mpi_stager unpack": [*stager, "--workers", "2", bundle, str(dest)],
        "mpirun -n 3 mpi_stager unpack": [MPIRUN or "mpirun", "--oversubscribe", "-np", "3", *stager, bundle,
                                          str(dest)],
    }[entry]


def _live_processes(group: int, dest: Path) -> list[int]:
    """Processes (zombies aside) of process group ``group``, or whose command line names ``dest``."""
    found, needle = [], os.fsencode(str(dest))
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat", "rb") as handle:
                fields = handle.read().rsplit(b")", 1)[1].split()
            with open(f"/proc/{entry}/cmdline", "rb") as handle:
                cmdline = handle.read()
        except OSError:
            continue
        if fields[0] != b"Z" and (int(fields[2]) == group or needle in cmdline):
            found.append(int(entry))
    return found


def _kill_at_gate(argv: list[str], dest: Path, gate: Path, log: Path) -> None:
    """Run ``argv`` with the gate loaded; once a process of it has stopped at the gate, SIGKILL its whole process
    group and return when nothing of it is left."""
    gate.mkdir()
    (gate / "sitecustomize.py").write_text(GATE)
    env = user_env(PYTHONPATH=str(gate), PALLET_TEST_GATE=str(gate), PALLET_TEST_GATE_AFTER=str(AFTER), **MPI_ENV)
    with open(log, "wb") as output:
        process = subprocess.Popen(argv, env=env, stdin=subprocess.DEVNULL, stdout=output, stderr=output,
                                   start_new_session=True)
    deadline = time.monotonic() + 120
    try:
        while not glob.glob(str(gate / "reached.*")):
            if process.poll() is not None:
                raise AssertionError(f"the run ended (status {process.returncode}) before any process reached the "
                                     f"gate:\n{log.read_text(errors='replace')}")
            assert time.monotonic() < deadline, "no process reached the gate"
            time.sleep(0.01)
    finally:
        with suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGKILL)
        process.wait()
        deadline = time.monotonic() + 30
        while (left := _live_processes(process.pid, dest)) and time.monotonic() < deadline:
            for pid in left:
                with suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
            time.sleep(0.05)
    assert not left, f"processes {left} of the killed run are still alive"


def _records(dest: Path, index) -> list[str]:
    """The shard records of DEST's one journal, which must be the bundle's."""
    journals = os.listdir(dest / ".pallet")
    assert [n for n in journals if n.startswith("journal-")] == [f"journal-{bundle_id(index)}"], journals
    return sorted(n for n in os.listdir(dest / ".pallet" / f"journal-{bundle_id(index)}")
                  if n.startswith("shard-") and n[6:].isdigit())


def _index(entry: str, bundle: str, dest: Path):
    """The index of the bundle the killed run was unpacking (a pull packs its own into DEST/.pallet/incoming)."""
    if entry == "pallet pull":
        pulled = glob.glob(str(dest / ".pallet" / "incoming" / "*.tar.zst"))
        assert len(pulled) == 1, pulled
        bundle = pulled[0]
    with Bundle.open(bundle) as opened:
        assert opened.index is not None
        return opened.index


def _written(dest: Path, index, records: list[str]) -> dict[bytes, int]:
    """The files of the shards ``records`` lists, each with its inode's change time: a file written again (a new
    inode, new bytes, a new mode or mtime) gets a new one, a file left alone keeps it."""
    shards = [index.shards[int(name[6:])] for name in records]
    return {e.path: os.lstat(os.path.join(os.fsencode(dest), e.path)).st_ctime_ns
            for shard in shards for e in index.shard_entries(shard) if e.kind == Kind.FILE}


def _rerun(argv: list[str]) -> dict:
    done = subprocess.run(argv, capture_output=True, text=True, timeout=180, stdin=subprocess.DEVNULL,
                          env=user_env(**MPI_ENV))
    assert done.returncode == 0, done.stderr
    summaries = [line for line in done.stdout.splitlines() if line.startswith("{")]
    assert len(summaries) == 1, done.stdout                 # one summary (from rank 0 only)
    return json.loads(summaries[0])


@pytest.mark.parametrize("entry", ENTRY_POINTS)
def test_a_run_killed_midway_resumes_from_the_journal_and_leaves_the_exact_tree(tmp_path, source, bundle, entry):
    if entry.startswith("mpirun") and MPIRUN is None:
        pytest.skip("OpenMPI's mpirun is not installed (./bootstrap.sh installs it)")
    dest = tmp_path / "dest"
    argv = _argv(entry, source, bundle, dest)
    _kill_at_gate(argv, dest, tmp_path / "gate", tmp_path / "killed.log")

    index = _index(entry, bundle, dest)
    records = _records(dest, index)
    assert (dest / ".pallet" / "INCOMPLETE").is_file()        # the killed run left DEST marked
    if entry.startswith("mpirun"):      # the other ranks went on until they met the stopped one at a collective
        assert AFTER <= len(records) < len(index.shards), (len(records), len(index.shards))
    else:                               # one process journals: it stopped right after its AFTER-th record
        assert len(records) == AFTER, records
    assert len(index.shards) > 4 * AFTER
    journaled = _written(dest, index, records)
    assert len(journaled) >= AFTER

    summary = _rerun(argv)
    assert _written(dest, index, records) == journaled      # the shards the journal listed were not written again
    if entry == "pallet pull":
        assert summary["skipped_shards"] == len(records), summary
    else:
        assert summary["shards_skipped"] == len(records), summary
        assert summary["shards_done"] == len(index.shards) - len(records), summary
        assert summary["shards" if entry == "pallet unpack" else "shards_total"] == len(index.shards), summary
    assert_same_tree(source, dest)
    assert not (dest / ".pallet").exists()                    # journal, marker and incoming bundle are gone


def test_the_journal_of_one_entry_point_serves_another(tmp_path, source, bundle):
    """`python -m mpi_stager unpack` killed midway, then `pallet unpack` of the same bundle: the one journal they
    share lets it skip what the first run finished."""
    dest = tmp_path / "dest"
    _kill_at_gate(_argv("mpi_stager unpack", source, bundle, dest), dest, tmp_path / "gate", tmp_path / "killed.log")
    index = _index("mpi_stager unpack", bundle, dest)
    records = _records(dest, index)
    assert len(records) == AFTER
    journaled = _written(dest, index, records)
    summary = _rerun(_argv("pallet unpack", source, bundle, dest))
    assert _written(dest, index, records) == journaled
    assert (summary["shards_skipped"], summary["shards_done"]) == (AFTER, len(index.shards) - AFTER), summary
    assert summary["files"] < 1500, summary
    assert_same_tree(source, dest)
    assert not (dest / ".pallet").exists()
