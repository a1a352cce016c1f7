"""Route conformance suite shipped with pallet: every registered route runs one round trip, kill and bad-input cases.

Route authors subclass RouteConformance in a pytest module, set ``route``
(the registered name) and ``direction``, and provide a ``route_case``
fixture returning a :class:`RouteCase` that reaches a far side where that
route is the one chosen. The cases run the installed ``pallet`` command
(``push`` for a push route, ``pull`` for a pull route) with
``--strategy bundle``, as a user would, and compare trees strictly. The
cases about what DEST already holds (planted links at every level, extra
entries, every kind of entry, kill -9 and rerun) run with
``--strategy individual`` too on routes that carry files one by one
(``individual`` True): whatever the planner picks, nothing is written
outside DEST and nothing of the source is left out. An interrupted run
(SIGINT to its process group, as a terminal's Ctrl-C; SIGTERM to pallet
alone) ends with 130 or 143 and one line, and a rerun finishes it. On a
route that compares DEST with the source (``compares_dest``), a second run
of the same command finds everything in place and moves nothing; where the
far side's own tar sets DEST's mtimes (``whole_seconds``), they are the
source's to the second, as GNU tar restores them from a format 2 bundle.
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from collections.abc import Callable
from typing import ClassVar

import pytest

from staging_core.testing import (assert_same_snapshot, assert_same_tree, make_nasty_tree, normalize_groups,
                                  snapshot)
from staging_core.transports.base import Direction

KILL_PATIENCE_S = 60          # the kill case kills a run that left no state by then
LOCKED = 4                    # pallet's exit status when another run still holds the destination
INTERRUPT_PATIENCE_S = 30     # a guard only: an interrupted run is meant to end within a second


def _default_env() -> dict[str, str]:
    return {name: value for name, value in os.environ.items() if not name.startswith("PYTHON")}


@dataclass
class RouteCase:
    """A far side where the route under test is the one chosen.

    - ``far(path)``: the URL of ``path`` at the far side (the test's far
      sides see this machine's files, so ``path`` is an absolute local path);
      for a push it is the destination, for a pull the source;
    - ``flags``: the command-line flags that select the route and reach the
      far side (``--ssh-option``, ``--unpack-via``, ``--keep-packed`` ...);
    - ``env``: the environment of the command (None: this one, without
      PYTHON* variables);
    - ``source(tree, scratch)``: what the operation reads for ``tree``
      (default: the tree itself; a published-bundle route packs it first);
    - ``landed(dest, scratch)``: the tree as the route leaves it at ``dest``
      (default: ``dest`` itself; a route that keeps the bundle unpacks it
      into ``scratch`` first, and checks nothing else was left);
    - ``expect_route``: a part of the ``route`` the JSON summary must show.
    """

    far: Callable[[str], str]
    flags: tuple[str, ...] = ()
    env: dict[str, str] | None = None
    source: Callable[[str, str], str] = lambda tree, scratch: tree
    landed: Callable[[str, str], str] = lambda dest, scratch: dest
    expect_route: str = ""
    pallet: str = field(default_factory=lambda: os.path.join(os.path.dirname(sys.executable), "pallet"))


class RouteConformance:
    """The contract every route keeps, as tests (see the module's docstring)."""

    route: ClassVar[str] = ""
    direction: ClassVar[Direction] = Direction.PUSH
    individual: ClassVar[bool] = True       # the route also sends files one by one (--strategy individual)
    tree_at_dest: ClassVar[bool] = True     # DEST receives the tree itself (not a kept bundle)
    whole_seconds: ClassVar[bool] = False   # DEST's mtimes are set by a tar that restores whole seconds only
    compares_dest: ClassVar[bool] = True    # the route compares DEST with the source and sends only what differs
    tested_routes: ClassVar[set[tuple[Direction, str]]] = set()

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        if cls.route:
            RouteConformance.tested_routes.add((cls.direction, cls.route))

    # ------------------------------------------------------------ running the installed command

    def _argv(self, case: RouteCase, src: str, dest: str, *extra: str, strategy: str = "bundle") -> list[str]:
        if self.direction is Direction.PUSH:
            return [case.pallet, "push", "--json", "--strategy", strategy, *extra, *case.flags, src, case.far(dest)]
        return [case.pallet, "pull", "--json", "--strategy", strategy, *extra, *case.flags, case.far(src), dest]

    def _strategy(self, name: str) -> str:
        if not self.tree_at_dest:
            pytest.skip(f"the {self.route} route leaves a bundle at DEST, not the tree")
        if name == "individual" and not self.individual:
            pytest.skip(f"the {self.route} route sends no files one by one")
        return name

    def _run(self, case: RouteCase, argv: list[str]) -> subprocess.CompletedProcess:
        return subprocess.run(argv, capture_output=True, text=True, stdin=subprocess.DEVNULL, timeout=600,
                              env=case.env if case.env is not None else _default_env())

    def _succeeds(self, case: RouteCase, argv: list[str]) -> dict:
        done = self._run(case, argv)
        assert done.returncode == 0, f"{' '.join(argv)}\nexited {done.returncode}:\n{done.stderr[-3000:]}"
        summary = json.loads(done.stdout.strip().splitlines()[-1])
        # files one by one take no route's tools, nor does a run that found everything in place already
        if argv[argv.index("--strategy") + 1] == "bundle" and summary.get("route") != "already in place":
            assert case.expect_route in summary.get("route", ""), summary
        return summary

    def _kill_midway(self, case: RouteCase, argv: list[str], dest: str) -> bool:
        """Start ``argv`` and kill -9 its process group as soon as ``dest/.pallet`` (its unfinished state)
        appears; return whether it was killed (False: it finished first)."""
        process = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                   stderr=subprocess.DEVNULL, start_new_session=True,
                                   env=case.env if case.env is not None else _default_env())
        deadline = time.monotonic() + KILL_PATIENCE_S
        while process.poll() is None and time.monotonic() < deadline:
            if os.path.lexists(os.path.join(dest, ".pallet")):
                os.killpg(process.pid, signal.SIGKILL)
                process.wait()
                return True
            time.sleep(0.005)
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()
            return True
        return False

    def _rerun(self, case: RouteCase, argv: list[str], patience: float = 60) -> dict:
        """Run ``argv`` until it no longer finds the destination locked by the killed run's far-side remains."""
        deadline = time.monotonic() + patience
        while True:
            done = self._run(case, argv)
            if done.returncode != LOCKED or time.monotonic() > deadline:
                break
            time.sleep(0.5)
        assert done.returncode == 0, f"{' '.join(argv)}\nexited {done.returncode}:\n{done.stderr[-3000:]}"
        return json.loads(done.stdout.strip().splitlines()[-1])

    # ------------------------------------------------------------ the cases

    def _same_tree(self, tree: str, landed: str) -> None:
        """Strict comparison (nothing left over); mtimes to the second where the route's far tar sets them."""
        assert_same_tree(tree, landed, whole_seconds=self.whole_seconds)

    def test_round_trip_of_a_nasty_tree(self, route_case: RouteCase, tmp_path):
        tree = make_nasty_tree(str(tmp_path / "src"))
        src, dest = route_case.source(tree, str(tmp_path / "prepared")), str(tmp_path / "dest")
        self._succeeds(route_case, self._argv(route_case, src, dest))
        self._same_tree(tree, route_case.landed(dest, str(tmp_path / "landed")))

    def test_a_second_run_finds_everything_in_place(self, route_case: RouteCase, tmp_path):
        """What a run wrote (mtimes with nanoseconds; whole seconds where a far tar wrote them) compares equal
        on the next run, which moves nothing."""
        self._strategy("bundle")
        if not self.compares_dest:
            pytest.skip(f"the {self.route} route sends the whole selection every time")
        tree = make_nasty_tree(str(tmp_path / "src"))
        src, dest = route_case.source(tree, str(tmp_path / "prepared")), str(tmp_path / "dest")
        self._succeeds(route_case, self._argv(route_case, src, dest))
        again = self._succeeds(route_case, self._argv(route_case, src, dest))
        assert again.get("route") == "already in place", again
        self._same_tree(tree, route_case.landed(dest, str(tmp_path / "landed")))

    def test_a_run_killed_midway_is_finished_by_a_rerun(self, route_case: RouteCase, tmp_path):
        tree = str(tmp_path / "src")
        for n in range(1500):
            path = os.path.join(tree, f"d{n % 15:02d}", f"f{n:05d}")
            os.makedirs(os.path.dirname(path), exist_ok=True)
            with open(path, "wb") as handle:
                handle.write(os.urandom(300).hex().encode())
        src, dest = route_case.source(tree, str(tmp_path / "prepared")), str(tmp_path / "dest")
        extra = ("--shard-size", "64K") if self.direction is Direction.PUSH else ()
        killed = self._kill_midway(route_case, self._argv(route_case, src, dest, *extra), dest)
        assert killed, "the run finished before it left any state to kill it in: give the case a bigger tree"
        self._rerun(route_case, self._argv(route_case, src, dest, *extra))
        self._same_tree(tree, route_case.landed(dest, str(tmp_path / "landed")))

    def test_a_missing_source_is_named_and_nothing_is_made(self, route_case: RouteCase, tmp_path):
        src, dest = str(tmp_path / "no-such-source"), str(tmp_path / "dest")
        done = self._run(route_case, self._argv(route_case, src, dest))
        assert done.returncode != 0 and "no-such-source" in done.stderr, done.stderr
        assert "Traceback" not in done.stderr
        assert not os.path.exists(dest) or not any(os.scandir(dest))

    def test_a_destination_that_is_a_file_is_named_and_kept(self, route_case: RouteCase, tmp_path):
        tree = make_nasty_tree(str(tmp_path / "src"))
        src, dest = route_case.source(tree, str(tmp_path / "prepared")), str(tmp_path / "dest-file")
        with open(dest, "wb") as handle:
            handle.write(b"not a directory")
        done = self._run(route_case, self._argv(route_case, src, dest))
        assert done.returncode != 0 and "dest-file" in done.stderr, done.stderr
        assert "Traceback" not in done.stderr
        with open(dest, "rb") as handle:
            assert handle.read() == b"not a directory"

    # ------------------------------------------------------------ what DEST already holds

    @pytest.mark.parametrize("strategy", ["bundle", "individual"])
    def test_links_planted_in_dest_are_never_followed(self, route_case: RouteCase, tmp_path, strategy):
        tree = _planted_source(str(tmp_path / "src"))
        outside = _outside(str(tmp_path / "outside"))
        before = snapshot(outside)
        src, dest = route_case.source(tree, str(tmp_path / "prepared")), str(tmp_path / "dest")
        _plant_links(dest, outside)
        done = self._run(route_case, self._argv(route_case, src, dest, strategy=self._strategy(strategy)))
        assert snapshot(outside) == before, f"{strategy}: pallet wrote through a link planted in DEST"
        assert "Traceback" not in done.stderr and "internal error" not in done.stderr, done.stderr
        if done.returncode == 0:
            self._same_tree(tree, route_case.landed(dest, str(tmp_path / "landed")))
        else:
            assert any(name in done.stderr for name in _PLANTED), f"{strategy}: refused without naming the link:\n" \
                                                                   f"{done.stderr[-2000:]}"

    @pytest.mark.parametrize("strategy", ["bundle", "individual"])
    def test_a_dest_with_extra_and_other_kinds_is_repaired(self, route_case: RouteCase, tmp_path, strategy):
        tree = _kinds_source(str(tmp_path / "src"))
        src, dest = route_case.source(tree, str(tmp_path / "prepared")), str(tmp_path / "dest")
        _other_kinds(dest)
        argv = self._argv(route_case, src, dest, strategy=self._strategy(strategy))
        self._succeeds(route_case, argv)
        landed = normalize_groups(snapshot(route_case.landed(dest, str(tmp_path / "landed"))))
        assert landed.pop(b"extra.txt")[0] == "f" and landed.pop(b"extra-dir")[0] == "d", "extras lost"
        landed.pop(b"extra-dir/inside.txt")
        assert_same_snapshot(normalize_groups(snapshot(tree)), landed, self.whole_seconds, f"{strategy}: DEST not "
                                                                                            "repaired")
        self._succeeds(route_case, self._argv(route_case, src, dest, "--delete", strategy=strategy))
        self._same_tree(tree, route_case.landed(dest, str(tmp_path / "landed-again")))

    @pytest.mark.parametrize("strategy", ["bundle", "individual"])
    def test_hard_links_in_dest_are_regrouped_as_the_source_has_them(self, route_case: RouteCase, tmp_path,
                                                                     strategy):
        if self.direction is Direction.PULL:
            pytest.skip("a pull's listing of the source carries no inodes: DEST's grouping is not compared")
        tree = _grouped_source(str(tmp_path / "src"))
        outside = _outside(str(tmp_path / "outside"))
        src, dest = route_case.source(tree, str(tmp_path / "prepared")), str(tmp_path / "dest")
        _grouped_otherwise(tree, dest, outside)
        self._succeeds(route_case, self._argv(route_case, src, dest, strategy=self._strategy(strategy)))
        self._same_tree(tree, route_case.landed(dest, str(tmp_path / "landed")))
        with open(os.path.join(outside, "file.txt"), "rb") as handle:
            assert handle.read() == b"VICTIM\n", "a file outside DEST was written through a hard link"

    def test_an_individual_run_killed_midway_is_finished_by_a_rerun(self, route_case: RouteCase, tmp_path):
        tree = str(tmp_path / "src")
        for n in range(3000):
            path = os.path.join(tree, f"d{n % 15:02d}", f"f{n:05d}")
            os.makedirs(os.path.dirname(path), exist_ok=True)
            if n % 10 == 9:
                os.link(os.path.join(tree, f"d{(n - 1) % 15:02d}", f"f{n - 1:05d}"), path)
                continue
            with open(path, "wb") as handle:
                handle.write(os.urandom(300).hex().encode())
        os.makedirs(os.path.join(tree, "empty", "deeper"))
        os.symlink("d00/f00000", os.path.join(tree, "link"))
        src, dest = route_case.source(tree, str(tmp_path / "prepared")), str(tmp_path / "dest")
        argv = self._argv(route_case, src, dest, strategy=self._strategy("individual"))
        killed = self._kill_midway(route_case, argv, dest)
        assert killed, "the run finished before it left any state to kill it in: give the case a bigger tree"
        self._rerun(route_case, argv)
        self._same_tree(tree, route_case.landed(dest, str(tmp_path / "landed")))

    # ------------------------------------------------------------ interrupts

    @pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
    def test_an_interrupted_run_stops_with_one_line_and_a_rerun_finishes_it(self, route_case: RouteCase,
                                                                            tmp_path, signum):
        tree = _many_files(str(tmp_path / "src"), 3000)
        src, dest = route_case.source(tree, str(tmp_path / "prepared")), str(tmp_path / "dest")
        extra = ("--shard-size", "64K") if self.direction is Direction.PUSH else ()
        argv = self._argv(route_case, src, dest, *extra)
        code, stderr, seconds = self._interrupt_midway(route_case, argv, dest, signum)
        assert code != 0, "the run finished before it was interrupted: give the case a bigger tree"
        assert code == 128 + signum, f"{signum.name}: exited {code} after {seconds:.1f} s, not {128 + signum}:\n" \
                                     f"{stderr[-3000:]}"
        assert "Traceback" not in stderr and len(stderr.strip().splitlines()) == 1 and "interrupted" in stderr, \
            f"{signum.name}: not one line saying so:\n{stderr[-3000:]}"
        self._rerun(route_case, argv)
        self._same_tree(tree, route_case.landed(dest, str(tmp_path / "landed")))

    def _interrupt_midway(self, case: RouteCase, argv: list[str], dest: str,
                          signum: signal.Signals) -> tuple[int | None, str, float]:
        """Start ``argv`` in a process group of its own; once ``dest/.pallet`` (its unfinished state) appears,
        send ``signum``: SIGINT to the whole group, as a terminal's Ctrl-C does, SIGTERM to pallet alone, as
        `kill` does. Its stdout is a full pipe until then, so that it cannot end before the signal, however
        late that state appears. Return its exit status (None: it was still running INTERRUPT_PATIENCE_S later),
        its stderr and the seconds from the signal to its end."""
        gate, held = _full_pipe()
        process = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=held, stderr=subprocess.PIPE,
                                   start_new_session=True, text=True,
                                   env=case.env if case.env is not None else _default_env())
        os.close(held)
        try:
            deadline = time.monotonic() + KILL_PATIENCE_S
            while process.poll() is None and not os.path.lexists(os.path.join(dest, ".pallet")):
                assert time.monotonic() < deadline, "the run left no state to interrupt it in"
                time.sleep(0.005)
            sent = time.monotonic()
            if process.poll() is None:
                if signum == signal.SIGINT:
                    os.killpg(process.pid, signum)
                else:
                    process.send_signal(signum)
            threading.Thread(target=_drain, args=(gate,), daemon=True).start()
            try:
                _, stderr = process.communicate(timeout=INTERRUPT_PATIENCE_S)
            except subprocess.TimeoutExpired:
                return None, f"still running {INTERRUPT_PATIENCE_S} s after {signum.name}", INTERRUPT_PATIENCE_S
            return process.returncode, stderr, time.monotonic() - sent
        finally:
            if process.poll() is None:
                os.killpg(process.pid, signal.SIGKILL)
                process.communicate()


def _full_pipe() -> tuple[int, int]:
    """A pipe (read end, write end) whose buffer is full: a write to it waits until the read end is drained."""
    read, write = os.pipe()
    os.set_blocking(write, False)
    try:
        while True:
            os.write(write, bytes(65536))
    except BlockingIOError:
        pass
    os.set_blocking(write, True)
    return read, write


def _drain(fd: int) -> None:
    """Read ``fd`` to its end, then close it."""
    with os.fdopen(fd, "rb") as pipe:
        while pipe.read(65536):
            pass


def _many_files(root: str, count: int) -> str:
    """``count`` files of 600 random bytes in 15 directories."""
    for n in range(count):
        path = os.path.join(root, f"d{n % 15:02d}", f"f{n:05d}")
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "wb") as handle:
            handle.write(os.urandom(300).hex().encode())
    return root


_PLANTED = ("h", "top.txt", "d/e", "d/g.txt")


def _write(path: str, data: bytes) -> None:
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "wb") as handle:
        handle.write(data)


def _planted_source(root: str) -> str:
    """A source whose directories and files stand where _plant_links puts links."""
    for rel in ("top.txt", "h/in-h.txt", "d/e/in-e.txt", "d/g.txt", "d/other.txt"):
        _write(os.path.join(root, rel), f"source {rel}\n".encode())
    return root


def _outside(root: str) -> str:
    """Directories and a file outside DEST that planted links point to; nothing may change them."""
    for rel in ("dir-a/keep.txt", "dir-b/keep.txt", "file.txt"):
        _write(os.path.join(root, rel), b"precious\n")
    return root


def _plant_links(dest: str, outside: str) -> None:
    """Links at every level of DEST where the source has a directory or a file."""
    os.makedirs(os.path.join(dest, "d"))
    os.symlink(os.path.join(outside, "dir-a"), os.path.join(dest, "h"))
    os.symlink(os.path.join(outside, "file.txt"), os.path.join(dest, "top.txt"))
    os.symlink(os.path.join(outside, "dir-b"), os.path.join(dest, "d", "e"))
    os.symlink(os.path.join(outside, "file.txt"), os.path.join(dest, "d", "g.txt"))


def _kinds_source(root: str) -> str:
    """Files, a symlink, a hard-link pair and an empty directory."""
    _write(os.path.join(root, "file.txt"), b"file\n")
    _write(os.path.join(root, "sub", "linked-a"), b"one inode, two names\n")
    os.link(os.path.join(root, "sub", "linked-a"), os.path.join(root, "sub", "linked-b"))
    os.symlink("file.txt", os.path.join(root, "link"))
    os.symlink("sub/linked-a", os.path.join(root, "as-file"))
    os.makedirs(os.path.join(root, "empty", "deeper"))
    _write(os.path.join(root, "was-link.txt"), b"a file here\n")
    return root


def _other_kinds(dest: str) -> None:
    """DEST holding extras, and the source's names as other kinds or with names missing."""
    _write(os.path.join(dest, "extra.txt"), b"extra\n")
    _write(os.path.join(dest, "extra-dir", "inside.txt"), b"extra\n")
    _write(os.path.join(dest, "file.txt"), b"file\n")
    _write(os.path.join(dest, "link"), b"a file where the source has a link\n")
    _write(os.path.join(dest, "sub", "linked-a"), b"one inode, two names\n")
    os.symlink("file.txt", os.path.join(dest, "was-link.txt"))


def _grouped_source(root: str) -> str:
    """A hard-link group of three names, a pair of separate files alike in every way, and a pair (x, y)."""
    _write(os.path.join(root, "g", "a"), b"one inode, three names\n")
    os.link(os.path.join(root, "g", "a"), os.path.join(root, "g", "b"))
    os.link(os.path.join(root, "g", "a"), os.path.join(root, "c"))
    for name in ("s1", "s2"):
        _write(os.path.join(root, name), b"alike but separate\n")
    _write(os.path.join(root, "h", "x"), b"SOURCE\n")
    os.link(os.path.join(root, "h", "x"), os.path.join(root, "h", "y"))
    for name in ("g/a", "s1", "s2", "h/x"):
        os.utime(os.path.join(root, name), ns=(1_700_000_000_000_000_000,) * 2)
    return root


def _grouped_otherwise(tree: str, dest: str, outside: str) -> None:
    """DEST holding the same names with the same size and mtime, linked otherwise: the group as three separate
    files, the separate pair as one inode, and h/x linked to a file outside DEST (other bytes, same size and
    mtime) with h/y missing."""
    for name in ("g/a", "g/b", "c", "s1"):
        _write(os.path.join(dest, name), b"one inode, three names\n" if name != "s1" else b"alike but separate\n")
    os.link(os.path.join(dest, "s1"), os.path.join(dest, "s2"))
    victim = os.path.join(outside, "file.txt")
    with open(victim, "wb") as handle:
        handle.write(b"VICTIM\n")
    os.makedirs(os.path.join(dest, "h"))
    os.link(victim, os.path.join(dest, "h", "x"))
    for name in ("g/a", "g/b", "c", "s1", "h/x"):
        os.utime(os.path.join(dest, name), ns=(1_700_000_000_000_000_000,) * 2)
    for name in ("g", "h", ""):
        st = os.stat(os.path.join(tree, name))
        os.utime(os.path.join(dest, name), ns=(st.st_atime_ns, st.st_mtime_ns))
