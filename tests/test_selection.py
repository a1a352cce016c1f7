"""staging_core.operations.selection: a chosen set of files fetched or sent as one planned operation, over local
and ssh."""
from __future__ import annotations

import os
import sys

import pytest

from bundles.errors import SourceError, UsageError
from staging_core.options import StagingOptions
from staging_core.operations.selection import fetch, send
from tests.servers import count_invocations


def tree(root, count: int = 300) -> str:
    for n in range(count):
        path = root / f"s{n % 7}" / "deep" / f"f{n:04d}.csv"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(f"{n},{n * 3}\n")
        os.utime(path, ns=(1_600_000_000_000_000_000 + n, 1_600_000_000_000_000_000 + n * 1000))
    return str(root)


def ssh_opts(sshd, **kw) -> StagingOptions:
    return StagingOptions(jobs=2, remote_python=sys.executable, ssh_options=tuple(sshd.ssh_options), **kw)


def chosen(count: int) -> list[str]:
    return [f"s{n % 7}/deep/f{n:04d}.csv" for n in range(0, count, 3)]


def check_fetched(src, dest, items) -> None:
    found = sorted(os.path.relpath(os.path.join(d, f), dest) for d, dirs, files in os.walk(dest) for f in files)
    assert found == sorted(items)                   # strict: nothing of pallet's is left either
    assert not os.path.lexists(os.path.join(dest, ".pallet"))
    for item in items:
        a, b = os.stat(os.path.join(src, item)), os.stat(os.path.join(dest, item))
        with open(os.path.join(src, item), "rb") as sent, open(os.path.join(dest, item), "rb") as landed:
            assert sent.read() == landed.read()
        assert (a.st_mtime_ns, a.st_mode) == (b.st_mtime_ns, b.st_mode)


@pytest.mark.parametrize("strategy", ["individual", "bundle"])
def test_fetch_over_ssh_brings_only_the_selection_in_one_transfer(sshd, tmp_path, monkeypatch, strategy):
    src, items = tree(tmp_path / "remote"), chosen(300)
    rsync_calls = count_invocations(tmp_path / "shim", "rsync", monkeypatch)
    result = fetch(sshd.url(src), items, str(tmp_path / "here"), ssh_opts(sshd, strategy=strategy))
    assert result.strategy == strategy and result.transfers == 1 and result.files == len(items)
    streamed = strategy == "bundle"                       # a bundle streams from the far side's sender
    assert len(rsync_calls()) == (0 if streamed else 1) and (result.route == "stream") == streamed
    check_fetched(src, str(tmp_path / "here"), items)


def test_fetch_with_sizes_plans_without_listing_and_accepts_duplicates(sshd, tmp_path):
    src, items = tree(tmp_path / "remote", 60), chosen(60)
    sizes = [os.path.getsize(os.path.join(src, i)) for i in items]
    result = fetch(sshd.url(src), items + items[:3], str(tmp_path / "here"), ssh_opts(sshd, strategy="bundle"),
                   sizes=sizes + sizes[:3])
    assert result.files == len(items)
    check_fetched(src, str(tmp_path / "here"), items)


def test_a_directory_item_brings_its_subtree_and_local_sources_work(tmp_path):
    src = tree(tmp_path / "src", 70)
    result = fetch(src, ["s1", "s2/deep/f0002.csv"], str(tmp_path / "here"), StagingOptions(strategy="bundle"))
    expected = [f"s1/deep/f{n:04d}.csv" for n in range(1, 70, 7)] + ["s2/deep/f0002.csv"]
    assert result.files == len(expected)
    check_fetched(src, str(tmp_path / "here"), expected)


@pytest.mark.parametrize("strategy", ["individual", "bundle"])
def test_send_over_ssh(sshd, tmp_path, strategy):
    src, items = tree(tmp_path / "src", 120), chosen(120)
    result = send(src, items, sshd.url(str(tmp_path / "remote")), ssh_opts(sshd, strategy=strategy))
    assert result.strategy == strategy and result.files == len(items)
    check_fetched(src, str(tmp_path / "remote"), items)


def test_bad_selections_are_named(sshd, tmp_path):
    src = tree(tmp_path / "remote", 10)
    with pytest.raises(UsageError, match="'../etc/passwd'"):
        fetch(sshd.url(src), ["../etc/passwd"], str(tmp_path / "here"))
    with pytest.raises(SourceError, match="s0/nope.csv"):
        fetch(src, ["s0/nope.csv"], str(tmp_path / "here"), StagingOptions(strategy="bundle"))
    with pytest.raises(Exception, match="nope.csv"):
        fetch(sshd.url(src), ["s0/nope.csv"], str(tmp_path / "here2"), ssh_opts(sshd, strategy="bundle"))
    assert not os.path.exists(tmp_path / "here2" / "s0")


def test_the_far_side_streams_with_the_requested_shard_size(sshd, tmp_path):
    src, items = tree(tmp_path / "remote", 300), chosen(300)
    log = tmp_path / "far-side.log"
    shim = tmp_path / "python-shim"
    shim.write_text(f'#!/bin/sh\necho "$@" >> {log}\nexec {sys.executable} "$@"\n')
    shim.chmod(0o755)
    options = ssh_opts(sshd, strategy="bundle", shard_size=4096)
    fetch(sshd.url(src), items, str(tmp_path / "here"),
          StagingOptions(**{**options.__dict__, "remote_python": str(shim)}))
    sends = [line for line in log.read_text().splitlines() if "mpi_stager send" in line]
    assert len(sends) == 1 and "--shard-size 4096" in sends[0], sends
    check_fetched(src, str(tmp_path / "here"), items)
