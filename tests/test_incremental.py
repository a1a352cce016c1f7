"""Incremental reruns over ssh: after 10 changes, 100 additions and 50 deletions at the source, a push or pull
moves a few per cent of the first run's bytes, and a rerun without changes moves none."""
from __future__ import annotations

import json
import os
import shutil
import sys
from pathlib import Path

import pytest

from tests.conftest import assert_same_tree, run_pallet

FILES, SIZE = 4000, 1024
CHANGED, ADDED, DELETED = 10, 100, 50
MAX_SHARE = 0.05          # the bound: bytes moved by the rerun / bytes moved by the first run


def source_tree(root: Path) -> str:
    """``FILES`` incompressible files of ``SIZE`` bytes in 40 directories."""
    for n in range(FILES):
        path = root / f"d{n % 40:02d}" / f"f{n:05d}.bin"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(os.urandom(SIZE))
    return str(root)


def change(root: Path) -> None:
    """Rewrite 10 files (same size, new mtime), add 100 in a new directory, delete 50."""
    for n in range(CHANGED):
        path = root / f"d{n % 40:02d}" / f"f{n:05d}.bin"
        path.write_bytes(os.urandom(SIZE))
        os.utime(path, ns=(2_000_000_000_000_000_000,) * 2)
    for n in range(ADDED):
        path = root / "new" / f"g{n:03d}.bin"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(os.urandom(SIZE))
    for n in range(FILES - DELETED, FILES):
        os.unlink(root / f"d{n % 40:02d}" / f"f{n:05d}.bin")


def staged(command: str, sshd, source: str, dest: str, *args: str) -> dict:
    done = run_pallet(command, "--json", "--quiet", "--remote-python", sys.executable,
                      *(f"--ssh-option={o}" for o in sshd.ssh_options), *args, source, dest)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("command", ["push", "pull"])
def test_a_rerun_after_changes_moves_only_what_changed(sshd, tmp_path, command):
    src, dest = Path(source_tree(tmp_path / "src")), tmp_path / "dest"
    ends = ((str(src), sshd.url(str(dest))) if command == "push" else (sshd.url(str(src)), str(dest)))
    first = staged(command, sshd, *ends, "--strategy", "bundle")
    assert first["files"] == FILES and first["bytes_sent"] >= FILES * SIZE, first
    change(src)
    rerun = staged(command, sshd, *ends, "--delete")
    assert rerun["files"] == CHANGED + ADDED and rerun["deleted"] == DELETED, rerun
    assert rerun["in_place"] == FILES - CHANGED - DELETED, rerun
    assert 0 < rerun["bytes_sent"] <= MAX_SHARE * first["bytes_sent"], (rerun["bytes_sent"], first["bytes_sent"])
    assert_same_tree(str(src), dest)
    again = staged(command, sshd, *ends)
    assert (again["files"], again["transfers"], again["bytes_sent"]) == (0, 0, 0), again
    assert_same_tree(str(src), dest)
    shutil.rmtree(dest)
