"""Route conformance suite shipped with pallet: every registered route runs one round trip, kill and bad-input cases.

Route authors subclass RouteConformance in a pytest module, set ``route``
(the registered name) and ``direction``, and provide a ``route_case``
fixture returning a :class:`RouteCase` that reaches a far side where that
route is the one chosen. The cases run the installed ``pallet`` command
(``push`` for a push route, ``pull`` for a pull route) with
``--strategy bundle``, as a user would, and compare trees strictly.
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from typing import Callable, ClassVar

from .testing import assert_same_tree, make_nasty_tree
from .transports.base import Direction

KILL_PATIENCE_S = 60          # the kill case kills a run that left no state by then
LOCKED = 4                    # pallet's exit status when another run still holds the destination


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
    tested_routes: ClassVar[set[tuple[Direction, str]]] = set()

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        if cls.route:
            RouteConformance.tested_routes.add((cls.direction, cls.route))

    # ------------------------------------------------------------ running the installed command

    def _argv(self, case: RouteCase, src: str, dest: str, *extra: str) -> list[str]:
        if self.direction is Direction.PUSH:
            return [case.pallet, "push", "--json", "--strategy", "bundle", *extra, *case.flags, src, case.far(dest)]
        return [case.pallet, "pull", "--json", "--strategy", "bundle", *extra, *case.flags, case.far(src), dest]

    def _run(self, case: RouteCase, argv: list[str]) -> subprocess.CompletedProcess:
        return subprocess.run(argv, capture_output=True, text=True, stdin=subprocess.DEVNULL, timeout=600,
                              env=case.env if case.env is not None else _default_env())

    def _succeeds(self, case: RouteCase, argv: list[str]) -> dict:
        done = self._run(case, argv)
        assert done.returncode == 0, f"{' '.join(argv)}\nexited {done.returncode}:\n{done.stderr[-3000:]}"
        summary = json.loads(done.stdout.strip().splitlines()[-1])
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

    def test_round_trip_of_a_nasty_tree(self, route_case: RouteCase, tmp_path):
        tree = make_nasty_tree(str(tmp_path / "src"))
        src, dest = route_case.source(tree, str(tmp_path / "prepared")), str(tmp_path / "dest")
        self._succeeds(route_case, self._argv(route_case, src, dest))
        assert_same_tree(tree, route_case.landed(dest, str(tmp_path / "landed")))    # strict: nothing left over

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
        assert_same_tree(tree, route_case.landed(dest, str(tmp_path / "landed")))

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
