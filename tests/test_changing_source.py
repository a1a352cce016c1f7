"""A source file rewritten while pallet reads it: never shipped as a mix of two versions with exit 0."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import run_pallet

# the shared tests of both engines (see tests/test_native_parity.py)
pytestmark = pytest.mark.usefixtures("each_engine")

TRIES = 3            # at least this many packs or pushes per test
MAX_TRIES = 20       # and more, until one of them saw the file change (how soon depends on timing)
A, B = b"A", b"B"

# Rewrites FILE in place, whole, alternating all-A and all-B, until killed.
WRITER = r"""
import os, sys

path, size = sys.argv[1], int(sys.argv[2])
patterns = [b"A" * (1 << 20), b"B" * (1 << 20)]
fd = os.open(path, os.O_WRONLY)
turn = 0
while True:
    for offset in range(0, size, 1 << 20):
        os.pwrite(fd, patterns[turn % 2][:size - offset], offset)
    turn += 1
"""


@pytest.fixture
def rewritten(tmp_path, request):
    """A source tree whose file ``big`` (request.param bytes) a writer process keeps rewriting."""
    size = request.param
    src = tmp_path / "src"
    src.mkdir()
    (src / "small.txt").write_bytes(b"steady\n")
    (src / "big").write_bytes(A * size)
    writer = subprocess.Popen([sys.executable, "-c", WRITER, str(src / "big"), str(size)])
    yield src
    writer.kill()
    writer.wait()


def _uniform(path: Path) -> bool:
    data = path.read_bytes()
    return data in (A * len(data), B * len(data))


def _changed(done: subprocess.CompletedProcess) -> bool:
    return done.returncode != 0 and "changed while being read" in done.stderr and "Traceback" not in done.stderr


@pytest.mark.parametrize("rewritten", [1 << 20, 64 << 20], indirect=True, ids=["small-shard", "64MiB-streamed"])
def test_pack_never_records_a_mix(rewritten, tmp_path):
    refused = 0
    for number in range(MAX_TRIES):
        if refused and number >= TRIES:
            break
        bundle = tmp_path / f"try{number}.tar.zst"
        done = run_pallet("pack", "--quiet", str(rewritten), str(bundle))
        if done.returncode != 0:
            assert _changed(done), done.stderr
            assert not bundle.exists() and not list(tmp_path.glob(f"try{number}*")), "a failed pack left a bundle"
            refused += 1
            continue
        run_pallet("verify", str(bundle), check=True)
        out = tmp_path / f"out{number}"
        run_pallet("unpack", "--quiet", str(bundle), str(out), check=True)
        assert _uniform(out / "big"), "pack exited 0 with a file mixing two versions"
    assert refused, "the writer never stops, so some read must have seen the file change"


@pytest.mark.parametrize("rewritten", [64 << 20], indirect=True, ids=["64MiB-streamed"])
def test_local_push_never_lands_a_mix(rewritten, tmp_path):
    refused = 0
    for number in range(MAX_TRIES):
        if refused and number >= TRIES:
            break
        dest = tmp_path / f"dest{number}"
        done = run_pallet("push", "--quiet", "--strategy", "bundle", str(rewritten), str(dest))
        if done.returncode != 0:
            assert _changed(done), done.stderr
            refused += 1
            continue
        assert _uniform(dest / "big"), "push exited 0 with a file mixing two versions"
        assert not os.path.exists(dest / ".pallet")
    assert refused, "the writer never stops, so some read must have seen the file change"


def _individual_runs(command: list[str], dest_of, tries: int = TRIES, named=str) -> int:
    """Run ``command + [named(dest)]`` (an individual push or pull; ``named`` gives DEST's URL) until some run
    saw the file change; every run either refuses by name or lands a file of one version only, with nothing of
    pallet's left. The count of refusals. (A change is seen by the file's times, which move by the file system's
    clock tick: the file is big enough that reading it spans many.)"""
    refused = 0
    for number in range(MAX_TRIES):
        if refused and number >= tries:
            break
        dest = dest_of(number)
        done = run_pallet(*command, named(dest))
        if done.returncode != 0:
            assert _changed(done) and "big" in done.stderr, done.stderr
            refused += 1
            continue
        assert _uniform(dest / "big"), "an individual run exited 0 with a file mixing two versions"
        assert not os.path.exists(dest / ".pallet")
    return refused


@pytest.mark.parametrize("rewritten", [64 << 20], indirect=True, ids=["64MiB"])
def test_an_individual_local_push_never_lands_a_mix(rewritten, tmp_path):
    refused = _individual_runs(["push", "--quiet", "--strategy", "individual", str(rewritten)],
                               lambda number: tmp_path / f"dest{number}")
    assert refused, "the writer never stops, so some read must have seen the file change"


@pytest.mark.parametrize("rewritten", [64 << 20], indirect=True, ids=["64MiB"])
def test_an_individual_local_pull_never_lands_a_mix(rewritten, tmp_path):
    refused = _individual_runs(["pull", "--quiet", "--strategy", "individual", str(rewritten)],
                               lambda number: tmp_path / f"dest{number}")
    assert refused, "the writer never stops, so some read must have seen the file change"


@pytest.mark.parametrize("rewritten", [64 << 20], indirect=True, ids=["64MiB"])
def test_an_individual_push_over_ssh_never_lands_a_mix(rewritten, tmp_path, sshd):
    flags = [f"--ssh-option={option}" for option in sshd.ssh_options]
    refused = _individual_runs(["push", "--quiet", "--strategy", "individual", *flags, str(rewritten)],
                               lambda number: tmp_path / f"dest{number}", named=lambda dest: sshd.url(str(dest)))
    assert refused, "the writer never stops, so some read must have seen the file change"
