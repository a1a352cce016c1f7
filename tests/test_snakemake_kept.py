"""The Snakemake plugin's keep-packed retrieval: one kept bundle per remote directory, objects copied out of it."""
from __future__ import annotations

import asyncio
import os
import re
from pathlib import Path

import pytest

pytest.importorskip("snakemake")
from snakemake_interface_common.exceptions import WorkflowError  # noqa: E402

from snakemake_storage_plugin_pallet import StorageProviderSettings  # noqa: E402
from tests.servers import count_transfers  # noqa: E402
from tests.test_snakemake_plugin import (T0, in_one_round, make_inputs, provider, remote_jobs,  # noqa: E402
                                         ssh_settings)


def number(obj) -> int:
    """n of the object s<n>.csv."""
    return int(obj.local_path().name[1:6])


def kept_dirs(store: Path) -> list[Path]:
    return sorted(p for p in store.iterdir() if p.is_dir()) if store.is_dir() else []


def test_a_round_is_copied_out_of_one_kept_bundle_fetched_once(sshd, tmp_path, monkeypatch):
    data = make_inputs(tmp_path / "remote" / "data", 300)
    transfers = count_transfers(tmp_path / "shim", monkeypatch)
    store = tmp_path / "packed"
    settings = ssh_settings(sshd, keep_packed=True, packed_dir=str(store))
    storage = provider(tmp_path, settings)
    objects = [storage.object(sshd.url(str(data / f"s{n:05d}.csv"))) for n in range(0, 300, 3)]
    asyncio.run(in_one_round("managed_retrieve", objects))
    assert len(transfers()) == 1, transfers()
    for obj in objects:
        n = number(obj)
        assert obj.local_path().read_text() == f"{n},{3 * n}\n"
        assert obj.local_path().stat().st_mtime_ns == T0 + n * 1_000_001
    (kept,) = kept_dirs(store)                                   # the whole directory, for later rounds
    assert sorted(p.name for p in kept.iterdir()) == ["bundle.tar.zst", "bundle.tar.zst.pidx", "complete"]
    assert not [p for p in (tmp_path / "local").iterdir() if p.name.startswith(".pallet-")]

    another = provider(tmp_path, settings)
    others = [another.object(sshd.url(str(data / f"s{n:05d}.csv"))) for n in range(1, 300, 3)]
    asyncio.run(in_one_round("managed_retrieve", others))        # a new provider (another job): no transfer
    assert len(transfers()) == 1, transfers()
    assert all(obj.local_path().read_text() == f"{number(obj)},{3 * number(obj)}\n" for obj in others)

    (data / "s00001.csv").write_text("1,-3\n")                   # the directory changes: a new bundle, once
    changed = provider(tmp_path, settings).object(sshd.url(str(data / "s00001.csv")))
    changed.retrieve_object()
    assert changed.local_path().read_text() == "1,-3\n"
    assert len(transfers()) == 2, transfers()
    assert len(kept_dirs(store)) == 1 and kept_dirs(store) != [kept]          # the older bundle is removed

    (data / "s00002.csv").chmod(0o600)                           # a mode is part of the listing too
    moded = provider(tmp_path, settings).object(sshd.url(str(data / "s00002.csv")))
    moded.retrieve_object()
    assert moded.local_path().stat().st_mode & 0o777 == 0o600 and len(transfers()) == 3


def test_a_fetch_killed_before_its_marker_is_finished_by_the_next_retrieval(sshd, tmp_path, monkeypatch):
    data = make_inputs(tmp_path / "remote" / "data", 20)
    settings = ssh_settings(sshd, keep_packed=True, packed_dir=str(tmp_path / "packed"))
    provider(tmp_path, settings).object(sshd.url(str(data / "s00000.csv"))).retrieve_object()
    (kept,) = kept_dirs(tmp_path / "packed")
    (kept / "complete").rename(kept / "complete.part")            # as if killed between writing and renaming it
    obj = provider(tmp_path, settings).object(sshd.url(str(data / "s00003.csv")))
    obj.retrieve_object()
    assert obj.local_path().read_text() == "3,9\n"
    assert sorted(p.name for p in kept.iterdir()) == ["bundle.tar.zst", "bundle.tar.zst.pidx", "complete"]


def test_a_planted_link_for_the_store_is_refused(sshd, tmp_path):
    data = make_inputs(tmp_path / "remote" / "data", 5)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (tmp_path / "packed").symlink_to(elsewhere)
    settings = ssh_settings(sshd, keep_packed=True, packed_dir=str(tmp_path / "packed"))
    obj = provider(tmp_path, settings).object(sshd.url(str(data / "s00000.csv")))
    with pytest.raises(WorkflowError, match="(?s)only this user can write into.*--storage-pallet-packed-dir"):
        obj.retrieve_object()
    assert not any(elsewhere.iterdir()) and not obj.local_path().exists()


def test_a_local_source_is_kept_too_and_a_missing_object_is_named(tmp_path, monkeypatch):
    data = make_inputs(tmp_path / "remote" / "data", 5)
    monkeypatch.setenv("KEPT_ROOT", str(tmp_path))
    settings = StorageProviderSettings(keep_packed=True, packed_dir="$KEPT_ROOT/packed")     # expanded here
    obj = provider(tmp_path, settings).object(f"file://{data}/s00000.csv")
    obj.retrieve_object()                                        # a local source packs here
    assert obj.local_path().read_text() == "0,0\n"
    assert len(kept_dirs(tmp_path / "packed")) == 1
    gone = provider(tmp_path, settings).object(f"file://{data}/s09999.csv")
    with pytest.raises(WorkflowError, match="s09999.csv.*do not exist"):
        gone.retrieve_object()


def test_remote_jobs_on_one_node_share_one_kept_bundle(sshd, tmp_path, monkeypatch):
    data = make_inputs(tmp_path / "remote" / "data", 120)
    transfers = count_transfers(tmp_path / "shim", monkeypatch)
    done, logs = remote_jobs(sshd, tmp_path, data, "--storage-pallet-keep-packed")
    scratch = tmp_path / "node-scratch"
    assert done.returncode == 0, done.stderr[-3000:]
    assert (tmp_path / "remote" / "wf" / "results" / "summary.txt").read_text() == f"120 {3 * 120 * 119 // 2}\n"
    job_output = "".join(p.read_text() for p in logs.iterdir())
    copied = re.findall(r"pallet: copied 60 object\(s\) out of the kept bundle of \S+ \((\S+)/bundle", job_output)
    assert len(copied) == 2 and copied[0] == copied[1], job_output[-3000:]      # both part jobs, one bundle
    fetches = [call for call in transfers() if call.rstrip("/").endswith(copied[0])]
    assert len(fetches) == 1, transfers()                       # two jobs, one node: one fetch of the data
    store = Path(copied[0]).parent
    assert store.is_relative_to(scratch) and os.stat(store).st_mode & 0o777 == 0o700


def test_a_kept_bundle_damaged_on_disk_is_fetched_again(sshd, tmp_path, monkeypatch, caplog):
    data = make_inputs(tmp_path / "remote" / "data", 50)
    transfers = count_transfers(tmp_path / "shim", monkeypatch)
    settings = ssh_settings(sshd, keep_packed=True, packed_dir=str(tmp_path / "packed"))
    first = provider(tmp_path, settings).object(sshd.url(str(data / "s00000.csv")))
    first.retrieve_object()
    (kept,) = kept_dirs(tmp_path / "packed")
    with open(kept / "bundle.tar.zst", "r+b") as bundle:               # a byte of the first shard flips
        bundle.seek(64)
        byte = bundle.read(1)
        bundle.seek(64)
        bundle.write(bytes([byte[0] ^ 0x10]))
    later = provider(tmp_path, settings).object(sshd.url(str(data / "s00007.csv")))
    later.retrieve_object()
    assert later.local_path().read_text() == "7,21\n"
    assert len(transfers()) == 2, transfers()
    assert any("cannot be read" in r.getMessage() and "fetching it again" in r.getMessage() for r in caplog.records)
