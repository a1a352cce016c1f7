"""Summaries and plans that tell the truth: files sent, in place and deleted counted alike on every route, plans
that look at DEST, predictions as ranges, DEST's own mtime, and examples that leave the checkout clean."""
from __future__ import annotations

import importlib.util
import json
import os
import re
import sys
from pathlib import Path

import pytest

from staging_core.testing import assert_same_tree
from tests.conftest import make_files, run_pallet
from tests.programs import SOURCE
from tests.test_tar_tools_route import bare  # noqa: F401  (a far side without pallet: the tar-tools route)

FILES = 60
CHANGED = 3


def tree(root: Path) -> str:
    return make_files(root, FILES, 4, lambda n: b"%d," % n * 20)


def change_three(src: str) -> None:
    for n in range(CHANGED):
        path = Path(src) / f"d{n % 4}" / f"f{n:05d}"
        path.write_bytes(path.read_bytes() + b"changed")


def far_url(request, where: str, path: Path) -> tuple[str, list[str]]:
    """DEST (or SRC) ``path`` as the route ``where`` reaches it, and the options that route needs."""
    if where == "local":
        return str(path), []
    server = request.getfixturevalue("bare" if where.startswith("bare") else "sshd")
    options = [f"--ssh-option={o}" for o in server.ssh_options]
    if not where.startswith("bare"):
        options += ["--remote-python", sys.executable]
    return server.url(str(path)), options


def staged(command: str, src: str, dest: str, options: list[str], *flags: str) -> dict:
    """Run a push or pull with --json; its summary."""
    return json.loads(run_pallet(command, "--json", "--quiet", *options, *flags, src, dest, check=True).stdout)


def line_of(command: str, src: str, dest: str, options: list[str], *flags: str) -> str:
    return run_pallet(command, "--quiet", *options, *flags, src, dest, check=True).stdout.strip()


ROUTES = [("local", "individual"), ("ssh", "individual"), ("ssh", "bundle"), ("bare", "individual"),
          ("bare", "bundle")]


@pytest.mark.parametrize("command", ["push", "pull"])
@pytest.mark.parametrize("where,strategy", ROUTES)
def test_every_route_counts_files_sent_and_in_place_alike(request, tmp_path, command, where, strategy):
    """One rule everywhere: ``files`` sent + ``in_place`` = the source's files; a rerun that sends nothing says so
    (the tar-tools route said "pushed 60 files ... 0 transfer(s)" with in_place 0; an individual pull from a
    far side without pallet said "pulled 60 files")."""
    src = tree(tmp_path / "src")
    far, options = far_url(request, where, tmp_path / "far")
    if command == "push":
        source, dest, edit = src, far, src
    else:
        run_pallet("push", "--quiet", *options, src, far, check=True)
        source, dest, edit = far, str(tmp_path / "here"), src
    flags = ("--strategy", strategy)
    first = staged(command, source, dest, options, *flags)
    assert (first["files"], first["in_place"]) == (FILES, 0), first
    change_three(edit)
    if command == "pull":
        run_pallet("push", "--quiet", *options, src, far, check=True)
    again = staged(command, source, dest, options, *flags)
    assert (again["files"], again["in_place"]) == (CHANGED, FILES - CHANGED), again
    assert again["bytes_sent"] is None or again["bytes_sent"] > 0, again
    same = staged(command, source, dest, options, *flags)
    assert (same["files"], same["file_bytes"], same["in_place"]) == (0, 0, FILES), same
    assert same["bytes_sent"] in (0, None) and same["predicted_range"] is None, same
    line = line_of(command, source, dest, options, *flags)
    assert line.startswith(f"{command}ed nothing: all {FILES} files already in place"), line
    # the far side's own tar sets whole seconds where it wrote (format 2 headers), and a pull copies those
    assert_same_tree(src, tmp_path / ("far" if command == "push" else "here"), whole_seconds=where == "bare")


def test_a_dry_run_that_would_send_files_does_not_say_nothing_changed(tmp_path):
    src = tree(tmp_path / "src")
    dest = str(tmp_path / "dest")
    run_pallet("push", "--quiet", src, dest, check=True)
    same = json.loads(run_pallet("push", "--dry-run", "--json", src, dest, check=True).stdout)
    assert same["route"] == "already in place" and same["would_send"] == [] and same["in_place"] == FILES, same
    change_three(src)
    planned = json.loads(run_pallet("push", "--dry-run", "--json", src, dest, check=True).stdout)
    assert len(planned["would_send"]) == CHANGED and planned["route"] == "dry run", planned
    assert (planned["files"], planned["in_place"]) == (CHANGED, FILES - CHANGED), planned


@pytest.mark.parametrize("where", ["local", "ssh", "bare"])
def test_plan_compares_with_dest_and_predicts_the_incremental_work(request, tmp_path, where):
    """`pallet plan` into a DEST already in sync predicted a full bundle where push then sent nothing."""
    src = tree(tmp_path / "src")
    dest, options = far_url(request, where, tmp_path / "dest")
    fresh = json.loads(run_pallet("plan", "--json", *options, src, dest, check=True).stdout)
    assert fresh["files"] == FILES and fresh["dest_compared"] is False
    run_pallet("push", "--quiet", *options, src, dest, check=True)
    same = json.loads(run_pallet("plan", "--json", *options, src, dest, check=True).stdout)
    assert same["dest_compared"] is True and (same["files"], same["in_place"]) == (0, FILES), same
    assert same["reason"].startswith(f"no file to send: DEST holds all {FILES} files"), same["reason"]
    assert max(c["predicted_seconds"] for c in same["candidates"]) == 0, same["candidates"]
    change_three(src)
    changed = json.loads(run_pallet("plan", "--json", *options, src, dest, check=True).stdout)
    assert (changed["files"], changed["in_place"]) == (CHANGED, FILES - CHANGED), changed
    assert changed["reason"].startswith(f"incremental: {CHANGED} of {FILES} files differ from DEST"), changed
    text = run_pallet("plan", *options, src, dest, check=True).stdout
    assert f"DEST compared: {FILES - CHANGED} files already in place, {CHANGED} to send" in text, text


RANGE = r"(\d+(?:\.\d+)?)–(\d+(?:\.\d+)?) s|under 0\.01 s"   # whole seconds from 100 s (display.seconds_range)


def test_predictions_are_ranges_in_plan_push_and_the_demo(tmp_path):
    """Plan, push and the demo show a range; each run here learns only its own copies (a profile of its own,
    not one that other tests' copies on a busy machine have widened)."""
    own = {"XDG_CONFIG_HOME": str(tmp_path / "config")}
    src = make_files(tmp_path / "src", 1200, 8, lambda n: b"%d" % n)
    planned = json.loads(run_pallet("plan", "--json", src, str(tmp_path / "dest"), check=True, env=own).stdout)
    for candidate in planned["candidates"]:
        assert 0 < candidate["low_seconds"] < candidate["predicted_seconds"] < candidate["high_seconds"], candidate
    low, high = planned["details"]["spread"]
    assert low < 1 < high
    text = run_pallet("plan", src, str(tmp_path / "dest"), check=True, env=own).stdout
    assert re.search(r"\* \w+ +predicted +(" + RANGE + ")", text), text
    pushed = json.loads(run_pallet("push", "--json", src, str(tmp_path / "dest"), check=True, env=own).stdout)
    low, high = pushed["predicted_range"]
    assert 0 < low < high, pushed
    line = run_pallet("push", "--quiet", src, str(tmp_path / "again"), check=True, env=own).stdout
    assert re.search(r"in \d+\.\d+ s \(predicted (" + RANGE + r")\)", line), line
    demo = run_pallet("demo", "--files", "300", check=True, env=own).stdout
    assert re.search(r"push +\d+\.\d+ s +\(predicted (" + RANGE + r"); planned: ", demo), demo


def test_local_copies_keep_their_spread_in_the_profile(tmp_path):
    """Each real copy's per-file cost joins the local profile's samples, which set its range."""
    config = tmp_path / "config"
    src = make_files(tmp_path / "src", 1200, 8, lambda n: b"%d" % n)
    for run in range(3):
        run_pallet("push", "--quiet", src, str(tmp_path / f"dest{run}"), check=True,
                   env={"XDG_CONFIG_HOME": str(config)})
    saved = next((config / "pallet" / "profiles").glob("local-*.toml")).read_text()
    assert "observed = 3" in saved and re.search(r"per_file_samples = \[[^\]]+, [^\]]+, [^\]]+\]", saved), saved
    assert re.search(r"spread_low = 0\.\d+", saved) and re.search(r"spread_high = \d+\.\d+", saved), saved


@pytest.mark.parametrize("command", ["push", "pull"])
@pytest.mark.parametrize("strategy", ["individual", "bundle"])
def test_dest_itself_gets_the_source_directorys_mtime(tmp_path, command, strategy):
    src = tree(tmp_path / "src")
    stamp = 1_577_934_245_123_456_789
    os.utime(src, ns=(stamp, stamp))
    dest = tmp_path / "dest"
    run_pallet(command, "--quiet", "--strategy", strategy, src, str(dest), check=True)
    assert dest.stat().st_mtime_ns == stamp
    os.utime(dest, ns=(0, 0))
    run_pallet(command, "--quiet", "--strategy", strategy, src, str(dest), check=True)     # nothing to send
    assert dest.stat().st_mtime_ns == stamp


@pytest.mark.parametrize("where", ["bare", "bare-individual"])
def test_an_ssh_dest_without_a_session_gets_the_source_directorys_mtime(request, tmp_path, where):
    src = tree(tmp_path / "src")
    stamp = 1_577_934_245_000_000_000
    os.utime(src, ns=(stamp, stamp))
    dest, options = far_url(request, where, tmp_path / "dest")
    strategy = "individual" if where.endswith("individual") else "bundle"
    run_pallet("push", "--quiet", "--strategy", strategy, *options, src, dest, check=True)
    assert (tmp_path / "dest").stat().st_mtime_ns == stamp


def test_the_parsl_example_writes_nothing_where_it_is_started(tmp_path, monkeypatch):
    """Running examples/parsl/many_inputs.py in a clone left runinfo/ and parsl-work/ in the checkout."""
    spec = importlib.util.spec_from_file_location("many_inputs", Path(SOURCE) / "examples/parsl/many_inputs.py")
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "argv", ["many_inputs.py", "ssh://localhost/tmp/rows"])
    loaded = []

    def load(config):
        loaded.append(config)
        return _Stop()
    monkeypatch.setattr(example.parsl, "load", load)
    with pytest.raises(_Stopped):
        example.main()
    config = loaded[0]
    workdir = config.executors[0].working_dir
    assert not Path(workdir).resolve().is_relative_to(tmp_path.resolve()), workdir
    assert Path(config.run_dir).resolve().is_relative_to(Path(workdir).resolve()), config.run_dir
    assert list(tmp_path.iterdir()) == []


class _Stopped(Exception):
    pass


class _Stop:
    """What parsl.load returns in the test: entering it stops the example before it runs anything."""

    def __enter__(self):
        raise _Stopped

    def __exit__(self, *exc):
        return False
