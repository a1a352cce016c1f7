"""Reruns that repair: a push compares DEST with the source and sends only what differs; --delete, --dry-run."""
from __future__ import annotations

import json
import os
import sys

import pytest

from tests.conftest import assert_same_tree, make_files, run_pallet, snapshot

FILES = 300


def _tree(root) -> str:
    return make_files(root, FILES, 3, lambda n: f"file {n}\n".encode() * (1 + n % 5))


def _push(where: str, sshd, src: str, dest, *args: str) -> dict:
    target = str(dest) if where == "local" else sshd.url(str(dest))
    ssh = [] if where == "local" else ["--remote-python", sys.executable,
                                       *(f"--ssh-option={o}" for o in sshd.ssh_options)]
    done = run_pallet("push", "--json", "--quiet", *ssh, *args, src, target)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.strip().splitlines()[-1])


def _damage(dest) -> None:
    """Delete one file, rewrite one in place with the same size, one with another size; plant an extra."""
    os.unlink(dest / "d0" / "f00000")
    (dest / "d1" / "f00001").write_text("FILE 1\n" * 2)
    os.utime(dest / "d1" / "f00001", ns=(1, 1))
    (dest / "d2" / "f00002").write_text("shorter\n")
    (dest / "d2" / "extra.txt").write_text("not in the source\n")


@pytest.mark.parametrize("where,strategy", [("local", "bundle"), ("local", "individual"), ("ssh", "bundle"),
                                            ("ssh", "individual")])
def test_a_rerun_sends_only_the_damaged_files_and_delete_converges(sshd, tmp_path, where, strategy):
    src, dest = _tree(tmp_path / "src"), tmp_path / "dest"
    first = _push(where, sshd, src, dest, "--strategy", strategy)
    assert first["files"] == FILES and first["in_place"] == 0
    _damage(dest)
    repaired = _push(where, sshd, src, dest, "--strategy", strategy)
    assert (repaired["files"], repaired["in_place"]) == (3, FILES - 3), repaired
    if (where, strategy) == ("ssh", "bundle"):
        assert repaired["route"] == "stream" and repaired["transfers"] == 1, repaired     # what differs, streamed
    assert (dest / "d2" / "extra.txt").exists(), "without --delete an extra entry is kept"
    os.unlink(dest / "d2" / "extra.txt")
    os.utime(dest / "d2", ns=(os.stat(os.path.join(src, "d2")).st_mtime_ns,) * 2)
    assert_same_tree(src, dest)
    (dest / "d2" / "extra.txt").write_text("again\n")
    os.makedirs(dest / "gone" / "deep")
    deleted = _push(where, sshd, src, dest, "--strategy", strategy, "--delete")
    assert deleted["deleted"] == 2 and deleted["files"] == 0 and deleted["transfers"] == 0, deleted
    assert_same_tree(src, dest)
    again = _push(where, sshd, src, dest, "--strategy", strategy, "--delete")
    assert (again["files"], again["in_place"], again["deleted"], again["transfers"]) == (0, FILES, 0, 0)


@pytest.mark.parametrize("where", ["local", "ssh"])
def test_dry_run_lists_what_would_change_and_changes_nothing(sshd, tmp_path, where):
    src, dest = _tree(tmp_path / "src"), tmp_path / "dest"
    _push(where, sshd, src, dest)
    _damage(dest)
    before = snapshot(dest)
    planned = _push(where, sshd, src, dest, "--dry-run", "--delete")
    assert snapshot(dest) == before
    assert {"d0/f00000", "d1/f00001", "d2/f00002"} <= set(planned["would_send"])
    assert planned["would_delete"] == ["d2/extra.txt"] and planned["in_place"] == FILES - 3
    fresh = _push(where, sshd, src, tmp_path / "nowhere", "--dry-run")
    assert len(fresh["would_send"]) == FILES + 3 and not (tmp_path / "nowhere").exists()


def test_the_summary_line_says_what_moved(tmp_path):
    src, dest = _tree(tmp_path / "src"), tmp_path / "dest"
    run_pallet("push", "--quiet", src, str(dest), check=True)
    os.unlink(dest / "d0" / "f00000")
    line = run_pallet("push", "--quiet", src, str(dest), check=True).stdout
    assert "pushed 1 files" in line and f"{FILES - 1} files already in place" in line
    line = run_pallet("push", "--quiet", src, str(dest), check=True).stdout
    assert f"pushed nothing: all {FILES} files already in place" in line


def _pull(where: str, sshd, src: str, dest, *args: str) -> dict:
    source = src if where == "local" else sshd.url(src)
    ssh = [] if where == "local" else ["--remote-python", sys.executable,
                                       *(f"--ssh-option={o}" for o in sshd.ssh_options)]
    done = run_pallet("pull", "--json", "--quiet", *ssh, *args, source, str(dest))
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("where,strategy", [("local", "bundle"), ("ssh", "bundle"), ("ssh", "individual")])
def test_a_pull_rerun_fetches_only_the_damaged_files_and_delete_converges(sshd, tmp_path, where, strategy):
    src, dest = _tree(tmp_path / "src"), tmp_path / "dest"
    first = _pull(where, sshd, src, dest, "--strategy", strategy)
    assert first["files"] == FILES and first["in_place"] == 0
    _damage(dest)
    os.makedirs(dest / "gone" / "deep")
    repaired = _pull(where, sshd, src, dest, "--strategy", strategy)
    assert (repaired["files"], repaired["in_place"]) == (3, FILES - 3), repaired
    assert (dest / "d2" / "extra.txt").exists() and (dest / "gone").exists()
    deleted = _pull(where, sshd, src, dest, "--strategy", strategy, "--delete")
    assert (deleted["files"], deleted["deleted"], deleted["transfers"]) == (0, 2, 0), deleted
    assert_same_tree(src, dest)
    again = _pull(where, sshd, src, dest, "--strategy", strategy)
    assert (again["files"], again["in_place"], again["transfers"]) == (0, FILES, 0), again


@pytest.mark.parametrize("where", ["local", "ssh"])
def test_pull_dry_run_lists_what_would_change_and_changes_nothing(sshd, tmp_path, where):
    src, dest = _tree(tmp_path / "src"), tmp_path / "dest"
    _pull(where, sshd, src, dest)
    _damage(dest)
    _sneaky_edit(dest / "d1" / "f00004")
    source_before, before = snapshot(src), snapshot(dest)
    planned = _pull(where, sshd, src, dest, "--dry-run", "--delete", "--checksum")
    assert snapshot(dest) == before and snapshot(src) == source_before, "a dry run changed a tree"
    assert {"d0/f00000", "d1/f00001", "d2/f00002", "d1/f00004"} <= set(planned["would_send"]), planned
    assert planned["would_delete"] == ["d2/extra.txt"] and planned["in_place"] == FILES - 4, planned
    fresh = _pull(where, sshd, src, tmp_path / "nowhere", "--dry-run")
    assert len(fresh["would_send"]) == FILES + 3 and not (tmp_path / "nowhere").exists()
    line = run_pallet("pull", "--dry-run", "--quiet", src, str(dest)).stdout
    assert line.startswith("would fetch ") and "  fetch d0/f00000" in line, line


def test_pull_dry_run_is_refused_where_listings_cannot_be_compared(tmp_path):
    done = run_pallet("pull", "--dry-run", "gsiftp://127.0.0.1:1/data", str(tmp_path / "dest"))
    assert done.returncode == 2 and "pull --dry-run compares listings of ssh and local sources" in done.stderr
    assert not (tmp_path / "dest").exists()


def _sneaky_edit(path) -> None:
    """Change a file's bytes but keep its size and mtime: only a content comparison can see it."""
    before = os.stat(path)
    data = path.read_bytes()
    path.write_bytes(data[::-1] if data[::-1] != data else data.upper())
    os.utime(path, ns=(before.st_atime_ns, before.st_mtime_ns))


@pytest.mark.parametrize("where", ["local", "ssh"])
def test_checksum_finds_a_change_that_kept_size_and_mtime(sshd, tmp_path, where):
    src, dest = _tree(tmp_path / "src"), tmp_path / "dest"
    _push(where, sshd, src, dest)
    _sneaky_edit(dest / "d1" / "f00004")
    quick = _push(where, sshd, src, dest)
    assert (quick["files"], quick["in_place"]) == (0, FILES), "size+mtime cannot see it"
    checked = _push(where, sshd, src, dest, "--checksum")
    assert (checked["files"], checked["in_place"]) == (1, FILES - 1), checked
    assert_same_tree(src, dest)
    pulled = tmp_path / "pulled"
    _pull(where, sshd, src, pulled)
    _sneaky_edit(pulled / "d2" / "f00005")
    again = _pull(where, sshd, src, pulled, "--checksum")
    assert (again["files"], again["in_place"]) == (1, FILES - 1), again
    assert_same_tree(src, pulled)


def test_a_local_listing_skips_a_link_swapped_away_between_its_lstat_and_readlink(tmp_path, monkeypatch):
    """Shared scratch: an entry that is a link at its lstat and gone (or a directory) at its readlink is left out
    of DEST's listing, as an entry gone at its lstat is, rather than ending the run with an internal error."""
    from staging_core.operations import repair
    (tmp_path / "kept.txt").write_bytes(b"x")
    os.symlink("kept.txt", tmp_path / "swapped")
    real = os.readlink

    def swapped_away(path, *args):
        if os.fsdecode(path).endswith("swapped"):
            raise FileNotFoundError(2, "No such file or directory", path)
        return real(path, *args)

    monkeypatch.setattr(repair.os, "readlink", swapped_away)
    assert sorted(repair._local_entries(os.fsencode(tmp_path))) == [b"kept.txt"]
