"""PalletStaging(keep_packed=True): a batch kept as one bundle, each app copying its own inputs out onto scratch."""
from __future__ import annotations

import glob
import os
import stat
from pathlib import Path

import pytest
from parsl import python_app
from parsl.data_provider.files import File
from parsl.dataflow.errors import DependencyError

from bundles import CorruptBundleError
from pallet_parsl import BatchError, PalletStaging
from staging_core import DestinationError, SourceError, copy_out, missing_members
from tests.conftest import make_files, run_pallet
from tests.servers import count_transfers
from tests.test_parsl import htex, htex_programs, remote_files, ssh_options, threads, workflow  # noqa: F401
from tests.test_read_in_place import _flip_byte_in_shard

APP_SOURCE = """
import os


def read_with_stat(inputs=()):
    path = str(inputs[0])
    found = os.lstat(path)
    with open(path) as handle:
        return path, handle.read(), found.st_mode, found.st_mtime_ns
"""
APPS_NAMESPACE: dict = {"__name__": "__main__"}       # shipped by value to HTEX workers, as a user's script is
exec(compile(APP_SOURCE, "<workflow apps>", "exec"), APPS_NAMESPACE)
read_with_stat = APPS_NAMESPACE["read_with_stat"]
FILES = 300


def _run(tmp_path, staging, executor, paths, server, flush: bool = False) -> list:
    with workflow(tmp_path, executor):
        read = python_app(read_with_stat, executors=[executor.label])
        futures = [read(inputs=[File(server.url(path))]) for path in paths]
        if flush:
            staging.flush()
        results = [future.result(timeout=300) for future in futures]
        batches = [future.result(timeout=120) for future in staging.batches()]
    return results, batches


def _flushed(sshd, tmp_path, **kwargs) -> PalletStaging:
    """A keep-packed provider whose batches close only at ``max_files`` or on flush(), never on the clock."""
    return PalletStaging(options=ssh_options(sshd), window=None, idle=3600.0, keep_packed=True,
                         scratch=str(tmp_path / "s"), **kwargs)


@pytest.mark.parametrize("kind", ["threads", "htex"])
def test_a_kept_batch_is_one_bundle_and_each_app_reads_its_own_checked_copy(sshd, tmp_path, monkeypatch,
                                                                           htex_programs, kind):  # noqa: F811
    paths = remote_files(str(tmp_path / "remote"), FILES)
    os.chmod(paths[7], 0o600)
    os.utime(paths[7], ns=(1_600_000_000_123_456_789,) * 2)
    transfers = count_transfers(tmp_path / "shim", monkeypatch)
    scratch = tmp_path / "node-local"
    staging = PalletStaging(options=ssh_options(sshd), window=1.0, keep_packed=True, scratch=str(scratch))
    executor = threads(tmp_path, staging) if kind == "threads" else htex(tmp_path, staging)
    results, batches = _run(tmp_path, staging, executor, paths, sshd)
    for path, (copy, text, mode, mtime_ns) in zip(paths, results, strict=True):
        source = os.lstat(path)
        assert text == Path(path).read_text() and (mode, mtime_ns) == (source.st_mode, source.st_mtime_ns), path
        assert copy.startswith(str(scratch) + os.sep) and os.path.basename(copy) == os.path.basename(path)
    assert len({copy for copy, *_ in results}) == FILES                  # each app had a copy of its own
    assert os.listdir(scratch) == []                                     # every copy removed after its app
    assert {b.strategy for b in batches} == {"kept packed"} and sum(b.files for b in batches) == FILES
    assert len(transfers()) == len(batches)                              # one transfer per batch
    work = tmp_path / "work"
    assert sorted(os.listdir(work)) == [".pallet"]                      # nothing unpacked on the shared root
    kept = sorted(glob.glob(str(work / ".pallet" / "parsl" / "packed-*" / "*")))
    assert len(kept) == 2 * len(batches) and all(b.bundle in kept for b in batches)    # bundle + .pidx each


def test_a_rerun_reads_the_kept_bundles_again_without_a_transfer(sshd, tmp_path, monkeypatch):
    paths = remote_files(str(tmp_path / "remote"), 50)
    staging = _flushed(sshd, tmp_path)
    first, _ = _run(tmp_path, staging, threads(tmp_path, staging), paths, sshd, flush=True)
    transfers = count_transfers(tmp_path / "shim", monkeypatch)
    again = _flushed(sshd, tmp_path)
    second, batches = _run(tmp_path, again, threads(tmp_path, again), paths, sshd, flush=True)
    assert [r[1:] for r in second] == [r[1:] for r in first]
    assert {b.strategy for b in batches} == {"done before"} and transfers() == []


def test_kept_bundles_are_found_per_file_whatever_the_batching(sshd, tmp_path, monkeypatch):
    """A first run in batches of 7, a rerun in one batch: each file is read from the kept bundle holding it, with
    no transfer; a rerun with 10 more files brings just those 10, in one transfer."""
    paths = remote_files(str(tmp_path / "remote"), 60)
    staging = _flushed(sshd, tmp_path, max_files=7)
    first, batches = _run(tmp_path, staging, threads(tmp_path, staging), paths, sshd, flush=True)
    assert [b.files for b in batches] == [7] * 8 + [4]
    transfers = count_transfers(tmp_path / "shim", monkeypatch)
    again = _flushed(sshd, tmp_path)
    second, (done,) = _run(tmp_path, again, threads(tmp_path, again), paths, sshd, flush=True)
    assert [r[1:] for r in second] == [r[1:] for r in first]
    assert (done.files, done.strategy, done.transfers) == (60, "done before", 0) and transfers() == []
    assert sorted(kept.bundle for kept in done.bundles) == sorted(b.bundle for b in batches)
    more = paths + remote_files(str(tmp_path / "remote" / "more"), 10)
    third = _flushed(sshd, tmp_path)
    results, (done,) = _run(tmp_path, third, threads(tmp_path, third), more, sshd, flush=True)
    assert [text for _, text, *_ in results] == [Path(path).read_text() for path in more]
    assert (done.files, done.strategy, done.transfers) == (70, "kept packed", 1) and len(transfers()) == 1
    assert missing_members(done.bundle, [f"more/d000/f{n:05d}.txt" for n in range(10)]) == []
    assert len(done.bundles) == 10 and missing_members(done.bundle, ["d000/f00000.txt"]) == ["d000/f00000.txt"]


def test_a_link_planted_as_the_scratch_directory_is_refused(sshd, tmp_path):
    paths = remote_files(str(tmp_path / "remote"), 3)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (tmp_path / "scratch").symlink_to(elsewhere)
    staging = PalletStaging(options=ssh_options(sshd), window=0.5, keep_packed=True, scratch=str(tmp_path / "scratch"))
    executor = threads(tmp_path, staging)
    with workflow(tmp_path, executor):
        read = python_app(read_with_stat, executors=[executor.label])
        future = read(inputs=[File(sshd.url(paths[0]))])
        with pytest.raises(DestinationError, match="only this user can write into"):
            future.result(timeout=120)
    assert os.listdir(elsewhere) == []


def test_a_missing_remote_file_fails_its_batch_naming_it(sshd, tmp_path):
    present = remote_files(str(tmp_path / "remote"), 2)
    staging = PalletStaging(options=ssh_options(sshd), window=0.5, keep_packed=True, scratch=str(tmp_path / "s"))
    executor = threads(tmp_path, staging)
    with workflow(tmp_path, executor):
        read = python_app(read_with_stat, executors=[executor.label])
        futures = [read(inputs=[File(sshd.url(path))])
                   for path in (present[0], os.path.join(os.path.dirname(present[0]), "absent.txt"))]
        for future in futures:
            with pytest.raises(DependencyError) as failed:
                future.result(timeout=120)
            cause = failed.value
            while isinstance(cause, DependencyError):          # the app <- the batch's check <- its move
                cause = cause.dependent_exceptions_tids[0][0]
            assert isinstance(cause, BatchError) and "cannot select 1 item(s): absent.txt: No such file" in str(cause)
            assert "path does not exist" not in str(cause)


# ------------------------------------------------------------------ copy_out, the library call the apps use

def _packed(tmp_path) -> tuple[str, str]:
    src = make_files(tmp_path / "src", 40, 4, lambda n: os.urandom(3000 + n))
    os.symlink("f00001", os.path.join(src, "d1", "link"))
    os.chmod(os.path.join(src, "d2", "f00002"), 0o751)
    bundle = str(tmp_path / "b.tar.zst")
    run_pallet("pack", "--quiet", "--shard-size", "16K", src, bundle, check=True)
    return src, bundle


def test_copy_out_copies_a_file_a_link_and_a_directory_as_stored(tmp_path):
    src, bundle = _packed(tmp_path)
    out = tmp_path / "out"
    out.mkdir()
    done = copy_out(bundle, "d1", str(out / "d1"))
    assert (done.files, done.links, done.directories) == (10, 1, 1)
    for name in os.listdir(os.path.join(src, "d1")):
        mine, theirs = os.lstat(out / "d1" / name), os.lstat(os.path.join(src, "d1", name))
        assert (stat.S_IFMT(mine.st_mode), mine.st_mode, mine.st_mtime_ns) == \
               (stat.S_IFMT(theirs.st_mode), theirs.st_mode, theirs.st_mtime_ns), name
    assert os.readlink(out / "d1" / "link") == "f00001"
    copy_out(bundle, "d2/f00002", str(out / "f"))
    assert (out / "f").read_bytes() == Path(src, "d2", "f00002").read_bytes()
    assert stat.S_IMODE(os.lstat(out / "f").st_mode) == 0o751


def test_copy_out_never_writes_through_an_existing_name_and_names_what_is_missing(tmp_path):
    _, bundle = _packed(tmp_path)
    (tmp_path / "target").symlink_to(tmp_path / "victim")
    with pytest.raises(DestinationError, match="already exists"):
        copy_out(bundle, "d0/f00000", str(tmp_path / "target"))
    assert not (tmp_path / "victim").exists()
    with pytest.raises(SourceError, match="no 'd0/absent'"):
        copy_out(bundle, "d0/absent", str(tmp_path / "new"))


def test_copy_out_refuses_bytes_from_a_damaged_shard(tmp_path):
    _, bundle = _packed(tmp_path)
    damaged = _flip_byte_in_shard(bundle, 1)
    assert damaged
    with pytest.raises(CorruptBundleError):
        copy_out(bundle, damaged[0], str(tmp_path / "copy"))
