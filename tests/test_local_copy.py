"""The local transport's parallel copy (native threads) against the one-by-one copy: same trees, same rules."""
from __future__ import annotations

import json
import os
import shutil

import pytest

from bundles import native
from staging_core import StagingOptions, send
from staging_core.transports.base import Direction, parse_url
from staging_core.transports.local import LocalTransport
from tests.conftest import assert_same_tree, make_files, run_pallet

pytestmark = pytest.mark.usefixtures("each_engine")


def _transport(dest, threads: int = 0) -> LocalTransport:
    return LocalTransport(parse_url(str(dest)), threads=threads)


@pytest.mark.parametrize("threads", [1, 4])
def test_the_nasty_tree_is_copied_exactly(nasty_tree, tmp_path, threads):
    dest = tmp_path / "dest"
    dest.mkdir()
    result = _transport(dest, threads).transfer(Direction.PUSH, nasty_tree, str(dest))
    assert not result.failed
    assert_same_tree(nasty_tree, dest)


def test_many_files_in_new_directories_and_a_rerun(tmp_path):
    src = make_files(tmp_path / "src", 2000, 30, lambda n: b"%d\n" % n * (n % 50))
    dest = tmp_path / "dest"
    run_pallet("push", "--quiet", "--strategy", "individual", src, str(dest), check=True)
    assert_same_tree(src, dest)
    (dest / "d3" / "f00003").write_bytes(b"damaged")
    os.unlink(dest / "d4" / "f00004")
    done = json.loads(run_pallet("push", "--json", "--strategy", "individual", src, str(dest), check=True).stdout)
    assert (done["files"], done["in_place"]) == (2, 1998), done
    assert_same_tree(src, dest)


def test_a_planted_link_is_replaced_not_written_through(tmp_path):
    src = tmp_path / "src"
    src.mkdir()
    (src / "f").write_bytes(b"new bytes")
    sentinel = tmp_path / "sentinel"
    sentinel.write_bytes(b"keep me")
    dest = tmp_path / "dest"
    dest.mkdir()
    os.symlink(sentinel, dest / "f")
    result = _transport(dest).transfer(Direction.PUSH, str(src), str(dest), ["f"])
    assert result.done == ["f"] and sentinel.read_bytes() == b"keep me"
    assert not os.path.islink(dest / "f") and (dest / "f").read_bytes() == b"new bytes"


def test_a_failed_copy_names_the_file_it_concerns(tmp_path):
    src = tmp_path / "src"
    (src / "sub").mkdir(parents=True)
    (src / "sub" / "ok").write_bytes(b"ok")
    dest = tmp_path / "dest"
    (dest / "sub" / "ok").mkdir(parents=True)       # a directory where the file goes
    result = _transport(dest).transfer(Direction.PUSH, str(src), str(dest), ["sub", "sub/ok"])
    assert list(result.failed) == ["sub/ok"]
    assert str(dest / "sub" / "ok") in str(result.failed["sub/ok"])


def test_the_engine_in_use_is_the_one_asked_for(each_engine):
    assert (native.module() is not None) == (each_engine == "native")


def test_a_local_push_plans_a_parallel_copy_from_a_measured_profile(tmp_path, monkeypatch, each_engine):
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "config"))
    src = make_files(tmp_path / "src", 300, 6, lambda n: b"%d\n" % n)
    planned = json.loads(run_pallet("plan", "--json", src, str(tmp_path / "dest"), check=True).stdout)
    saved = list((tmp_path / "config" / "pallet" / "profiles").glob("local-*.toml"))
    if each_engine == "native":
        assert planned["strategy"] == "individual" and planned["details"]["profile"].startswith("local-")
        assert "needs no bundle" in planned["reason"] and len(saved) == 1
        assert "per_file_s = " in saved[0].read_text()
    else:       # one file at a time in Python: bundles stay in the running, on the generic profile
        assert planned["details"]["profile"] == "default" and not saved
    pushed = json.loads(run_pallet("push", "--json", src, str(tmp_path / "dest"), check=True).stdout)
    assert pushed["strategy"] == planned["strategy"]
    forced = json.loads(run_pallet("push", "--json", "--strategy", "bundle", src, str(tmp_path / "packed"),
                                   check=True).stdout)
    assert forced["strategy"] == "bundle"
    for dest in ("dest", "packed"):
        assert_same_tree(src, tmp_path / dest)
    assert {p.name for p in tmp_path.iterdir()} - {"config"} == {"dest", "packed", "src"}     # no scratch left


def test_a_finished_local_copy_corrects_a_profile_measured_at_a_bad_moment(tmp_path, monkeypatch, each_engine):
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "config"))
    src = make_files(tmp_path / "src", 1200, 12, lambda n: b"x")
    run_pallet("plan", src, str(tmp_path / "dest"), check=True)          # measures the profile (native)
    saved = list((tmp_path / "config" / "pallet" / "profiles").glob("local-*.toml"))
    if each_engine == "python":
        assert not saved
        return
    text = saved[0].read_text()
    saved[0].write_text(text.replace(next(line for line in text.splitlines() if line.startswith("per_file_s")),
                                     "per_file_s = 1.0"))     # as if measured while the disk was stalled
    pushed = json.loads(run_pallet("push", "--json", src, str(tmp_path / "dest"), check=True).stdout)
    corrected = float(next(line for line in saved[0].read_text().splitlines()
                           if line.startswith("per_file_s")).split("=")[1])
    shown = pushed["seconds"] + 0.0005                         # --json rounds seconds to the millisecond
    assert 0 < corrected <= shown / 1200                       # the first real copy replaces the measured sample


def test_measuring_the_local_route_in_an_existing_destination_leaves_nothing_there(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "config"))      # no saved profile: it is measured now
    if native.module() is None:
        pytest.skip("the local route is measured only with the native engine")
    src = make_files(tmp_path / "src", 3, 1, lambda n: b"%d\n" % n)
    (tmp_path / "dest").mkdir()
    run_pallet("plan", "--json", src, str(tmp_path / "dest"), check=True)
    assert list((tmp_path / "dest").iterdir()) == []
    shutil.rmtree(tmp_path / "config")
    send(src, ["d0/f00001"], f"file://{tmp_path / 'dest'}", StagingOptions(progress=False))      # a selection
    assert sorted(str(p.relative_to(tmp_path / "dest")) for p in (tmp_path / "dest").rglob("*")) == ["d0", "d0/f00001"]
