"""pallet push to local and ssh destinations, individually and as a bundle, with real sshd and mpi_stager."""
from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest

from staging_core.operations.push_pull import push
from staging_core.options import StagingOptions
from tests.conftest import assert_same_tree, make_nasty_tree, run_pallet


def tiny_tree(root, count: int = 2000) -> str:
    for n in range(count):
        path = root / f"d{n % 40:02d}" / f"f{n:05d}.csv"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(f"{n},{n * 7}\n" * 5)
    return str(root)


@pytest.mark.parametrize("strategy", ["individual", "bundle"])
def test_push_to_a_local_destination(tmp_path, strategy):
    # hard links survive bundles only (the local transport copies files, as its capabilities say)
    src = make_nasty_tree(str(tmp_path / "src")) if strategy == "bundle" else tiny_tree(tmp_path / "src")
    result = push(src, str(tmp_path / "dest"), StagingOptions(strategy=strategy, jobs=2))
    assert result.strategy == strategy and result.transfers == 1
    assert_same_tree(src, tmp_path / "dest")


@pytest.mark.parametrize("strategy", ["individual", "bundle"])
def test_push_over_ssh(sshd, tmp_path, strategy):
    src = tiny_tree(tmp_path / "src")
    options = StagingOptions(strategy=strategy, jobs=2, remote_python=sys.executable,
                             ssh_options=tuple(sshd.ssh_options))
    result = push(src, sshd.url(str(tmp_path / "dest")), options)
    assert result.files == 2000 and result.transfers == 1
    assert_same_tree(src, tmp_path / "dest")


def test_auto_bundles_many_tiny_files_and_a_rerun_converges(sshd, tmp_path):
    src = tiny_tree(tmp_path / "src")
    options = StagingOptions(jobs=2, remote_python=sys.executable, ssh_options=tuple(sshd.ssh_options))
    first = push(src, sshd.url(str(tmp_path / "dest")), options)
    assert first.plan.strategy == "bundle" and first.strategy == "bundle" and first.route == "stream"
    again = push(src, sshd.url(str(tmp_path / "dest")), options)     # DEST already equals the source
    assert again.route == "already in place" and again.files == 0 and again.in_place == first.files
    assert again.transfers == 0
    stored = push(src, sshd.url(str(tmp_path / "dest2")), StagingOptions(**{**options.__dict__, "stream": "off"}))
    assert stored.route != "stream"
    for dest in ("dest", "dest2"):
        assert_same_tree(src, tmp_path / dest)          # strict: no .pallet, lock or incoming bundle left


def test_cli_push_and_clear_errors(sshd, tmp_path):
    src = tiny_tree(tmp_path / "src", 50)
    ssh_opts = [f"--ssh-option={o}" for o in sshd.ssh_options]
    done = run_pallet("push", "--json", "--remote-python", sys.executable, *ssh_opts, src,
                      sshd.url(str(tmp_path / "dest")), check=True)
    assert json.loads(done.stdout)["files"] == 50
    missing = run_pallet("push", str(tmp_path / "nowhere"), str(tmp_path / "d2"))
    assert missing.returncode == 1 and "nowhere" in missing.stderr and "hint:" in missing.stderr
    unknown = run_pallet("push", src, "nope://host/x")
    assert unknown.returncode == 2 and "nope" in unknown.stderr
    no_route = run_pallet("push", "--strategy", "bundle", src, "gsiftp://127.0.0.1:9/x")
    assert no_route.returncode == 2 and "--unpack-via" in no_route.stderr
    assert sorted(p.name for p in (tmp_path / "src").iterdir()) == [f"d{n:02d}" for n in range(40)]


@pytest.mark.parametrize("strategy", ["individual", "bundle"])
def test_pull_over_ssh(sshd, tmp_path, strategy):
    from staging_core.operations.push_pull import pull
    src = tiny_tree(tmp_path / "remote_src", 1500)
    options = StagingOptions(strategy=strategy, jobs=2, remote_python=sys.executable,
                             ssh_options=tuple(sshd.ssh_options))
    result = pull(sshd.url(src), str(tmp_path / "here"), options)
    assert result.strategy == strategy and result.files == 1500
    assert_same_tree(src, tmp_path / "here")
    assert sorted(p.name for p in (tmp_path / "remote_src").iterdir()) == [f"d{n:02d}" for n in range(40)]


def test_cli_pull_of_a_local_source(tmp_path):
    src = make_nasty_tree(str(tmp_path / "src"))
    done = run_pallet("pull", "--json", "--strategy", "bundle", src, str(tmp_path / "copy"), check=True)
    assert json.loads(done.stdout)["strategy"] == "bundle"
    assert_same_tree(src, tmp_path / "copy")


def test_demo_runs_the_whole_job_and_reports_no_problem(tmp_path):
    done = run_pallet("demo", "--files", "600", "--json", "--workdir", str(tmp_path / "demo"), check=True)
    summary = json.loads(done.stdout)
    assert summary["problems"] == [] and summary["files"] == 600
    assert summary["push"]["strategy"] in ("bundle", "individual") and summary["push"]["reason"]


def test_relative_paths_are_local_as_with_rsync_and_cp(tmp_path):
    src = tiny_tree(tmp_path / "data", 30)
    run_pallet("push", "data", "backup", cwd=tmp_path, check=True)
    assert_same_tree(src, tmp_path / "backup")
    run_pallet("pull", "backup/", "copy", cwd=tmp_path, check=True)
    assert_same_tree(src, tmp_path / "copy")
    done = run_pallet("push", "data", "host:relative", cwd=tmp_path)
    assert done.returncode == 2 and "must be absolute" in done.stderr and "Traceback" not in done.stderr


@pytest.mark.parametrize("where", ["local", "ssh"])
def test_a_symlink_to_a_directory_survives_individual_reruns(sshd, tmp_path, where):
    src = tmp_path / "src"
    (src / "dir").mkdir(parents=True)
    (src / "dir" / "f.txt").write_text("x\n")
    (src / "link").symlink_to("dir")
    dest = str(tmp_path / "dest")
    url = dest if where == "local" else sshd.url(dest)
    options = StagingOptions(strategy="individual", remote_python=sys.executable, ssh_options=tuple(sshd.ssh_options))
    for _ in range(3):
        push(str(src), url, options)
        assert_same_tree(str(src), dest)


def test_a_stored_pull_leaves_no_bundle_at_the_source_and_sweeps_what_killed_pulls_left(tmp_path):
    import fcntl
    import glob
    import tempfile
    from staging_core.operations.push_pull import pull
    from tests.servers import start_sshd
    far_tmp = tmp_path / "far-tmp"             # the far side's $TMPDIR, this test's alone (no other test's pulls)
    far_tmp.mkdir()
    sshd = start_sshd(tmp_path / "sshd", (f"SetEnv TMPDIR={far_tmp}",))
    src = tiny_tree(tmp_path / "remote_src", 200)
    stale = tempfile.mkdtemp(prefix="pallet-outgoing-", dir=far_tmp)           # a killed pull's bundle
    held = tempfile.mkdtemp(prefix="pallet-outgoing-", dir=far_tmp)            # a running pull's bundle
    for old in (stale, held):
        (Path(old) / "bundle.tar.zst").write_bytes(b"x" * 1000)
        os.utime(old, (1_600_000_000, 1_600_000_000))
    lock = os.open(held, os.O_RDONLY)
    fcntl.flock(lock, fcntl.LOCK_EX)
    try:
        options = StagingOptions(strategy="bundle", remote_python=sys.executable, stream="off",
                                 ssh_options=tuple(sshd.ssh_options))
        pull(sshd.url(src), str(tmp_path / "here"), options)
        assert_same_tree(src, tmp_path / "here")
        assert set(glob.glob(f"{far_tmp}/*")) == {held}          # the stale one swept; nothing of this pull left
    finally:
        os.close(lock)
        sshd.stop()
