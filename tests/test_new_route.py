"""A route pallet does not know, registered from outside its code, is chosen where it serves, carries bundles by
what it declares (never by its class), and passes the shipped route conformance suite; a strategy registered
from outside is chosen by its own rule.

The route, ``by-command``, unpacks a bundle at a local DEST in a child process (``python -m mpi_stager
unpack``) instead of in pallet's own, and logs every unpack it runs to $PALLET_TEST_ROUTE_LOG, so the tests
can count that it, not pallet's ``local`` route, did the work. The conformance suite runs the ``pallet``
command; its runs load this module first (a launcher script, :func:`launcher`), as a plugin would be loaded,
and register the route through the public registry only.

This module imports nothing of the tests package at import time: the launcher loads it by its path.
"""
from __future__ import annotations

import ast
import os
import shlex
import sys
from dataclasses import replace
from pathlib import Path
from typing import ClassVar

import pytest

from bundles.errors import PalletError
from staging_core.operations.push_pull import pull, push
from staging_core.operations.push_strategies import PushContext, push_bundle
from staging_core.operations.strategy_base import (Attempt, Strategy, register_strategy, registered_strategies,
                                                   unregister_strategy)
from staging_core.options import StagingOptions
from staging_core.routes.base import STORE_AND_FORWARD, STREAM, Route, transport_capable
from staging_core.routes.conformance import RouteCase, RouteConformance
from staging_core.routes.pack import LocalPack
from staging_core.routes.registry import RouteQuery, RouteSpec, register_route, registered_routes, unregister_route
from staging_core.routes.unpack import LocalUnpack, run_local, serves, unpack_argv, unpack_summary, unpacker
from staging_core.testing import assert_same_tree
from staging_core.transports.base import Direction

ROUTE = "by-command"
DESCRIPTION = "unpacked by command"
LOG = "PALLET_TEST_ROUTE_LOG"
ORDER = 35                      # before pallet's own `local` push route (40): a local DEST is this route's


def _log(line: str) -> None:
    log = os.environ.get(LOG)
    if log:
        with open(log, "a") as handle:
            handle.write(line + "\n")


def invocations(log: str) -> list[str]:
    """The lines the route logged to ``log``, one per unpack it ran."""
    return Path(log).read_text().splitlines() if os.path.exists(log) else []


class CommandUnpack(LocalUnpack):
    """A local DEST, unpacked by ``python -m mpi_stager unpack`` in a child process (resumable by its journal,
    DEST's lock held by the push). It declares only store-and-forward: no stream, no hybrid."""

    strategies: ClassVar[frozenset[str]] = frozenset({STORE_AND_FORWARD})
    description = DESCRIPTION

    def unpack(self, bundle_path: str, keep_journal: bool = False) -> int:
        _log(f"unpack {bundle_path}")
        here = replace(self.options, remote_python=shlex.quote(sys.executable), launcher=None)  # this Python
        argv = unpack_argv(here, bundle_path, self.endpoint.path, keep_journal, locked=True)
        return unpack_summary(run_local(argv), self.endpoint.url()).shards_skipped


def _open(query: RouteQuery) -> Route | None:
    return CommandUnpack(query.endpoint, query.options) if transport_capable(query.transport, CommandUnpack.needs) \
        else None


SPEC = RouteSpec(ROUTE, Direction.PUSH, ORDER, _open,
                 possible=lambda endpoint, options: serves(endpoint, CommandUnpack.needs))


def register() -> None:
    """What a plugin that brings the route does when it is imported."""
    register_route(SPEC)


@pytest.fixture
def by_command(tmp_path, monkeypatch):
    """The route registered in this process, its log at ``tmp_path/route.log``; unregistered afterwards."""
    log = str(tmp_path / "route.log")
    monkeypatch.setenv(LOG, log)
    register()
    yield log
    unregister_route(Direction.PUSH, ROUTE)


def launcher(directory: Path) -> str:
    """A `pallet` that loads this module (registering the route) and then runs the command line, as pallet with
    a plugin installed does."""
    script = directory / "pallet-with-route"
    script.write_text(f"""#!{sys.executable}
import importlib.util, sys
spec = importlib.util.spec_from_file_location("pallet_test_new_route", {str(Path(__file__).resolve())!r})
plugin = importlib.util.module_from_spec(spec)
sys.modules[spec.name] = plugin
spec.loader.exec_module(plugin)
plugin.register()
from staging_core.cli.main import main
sys.exit(main())
""")
    script.chmod(0o755)
    return str(script)


def _tree(root: Path, count: int = 200) -> str:
    for n in range(count):
        path = root / f"d{n % 7}" / f"f{n:04d}.txt"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(f"{n}\n" * (n % 13 + 1))
    big = root / "big.bin"
    big.write_bytes(os.urandom(3 << 20))
    return str(root)


# ---------------------------------------------------------------- the route, in this process

def test_the_registered_route_is_asked_before_local_and_carries_the_bundle(by_command, tmp_path):
    assert [spec.name for spec in registered_routes(Direction.PUSH)].index(ROUTE) \
        < [spec.name for spec in registered_routes(Direction.PUSH)].index("local")
    src = _tree(tmp_path / "src")
    result = push(src, str(tmp_path / "dest"), StagingOptions(strategy="bundle"))
    assert (result.strategy, result.route) == ("bundle", DESCRIPTION)
    ran = invocations(by_command)
    assert len(ran) == 1 and ran[0].startswith(f"unpack {tmp_path / 'dest' / '.pallet' / 'incoming' / 'bundle.tar'}")
    assert_same_tree(src, tmp_path / "dest")


def test_a_hybrid_plan_runs_as_a_bundle_through_a_route_that_does_not_carry_hybrid(by_command, tmp_path):
    src = _tree(tmp_path / "src")
    result = push(src, str(tmp_path / "dest"), StagingOptions(strategy="hybrid", large_file_bytes=1 << 20))
    assert (result.strategy, result.route, result.transfers) == ("bundle", DESCRIPTION, 1)
    assert len(invocations(by_command)) == 1
    assert_same_tree(src, tmp_path / "dest")


def test_without_the_route_a_local_dest_takes_pallets_own(by_command, tmp_path):
    unregister_route(Direction.PUSH, ROUTE)
    src = _tree(tmp_path / "src", 20)
    result = push(src, str(tmp_path / "dest"), StagingOptions(strategy="bundle", stream="off"))
    assert result.route == "in place" and invocations(by_command) == []
    assert_same_tree(src, tmp_path / "dest")


def test_a_selection_through_the_route_leaves_nothing_of_pallets(by_command, tmp_path):
    src = _tree(tmp_path / "src", 40)
    from staging_core.operations.selection import send
    result = send(src, ["d1", "d2/f0002.txt"], str(tmp_path / "dest"), StagingOptions(strategy="bundle"))
    assert result.route == DESCRIPTION and len(invocations(by_command)) == 1
    assert not os.path.exists(tmp_path / "dest" / ".pallet")
    assert sorted(os.listdir(tmp_path / "dest")) == ["d1", "d2"]


# ---------------------------------------------------------------- strategies registered from outside

TAGGED = "tagged"


class TaggedUnpack(LocalUnpack):
    """A route that only the ``tagged`` strategy carries."""

    strategies: ClassVar[frozenset[str]] = frozenset({TAGGED})
    description = "tagged route"


class TaggedPush(Strategy[PushContext]):
    """Stores and forwards through a route that lists ``tagged``, saying so in the summary."""

    name, direction, order = TAGGED, Direction.PUSH, 45
    runs = 0

    @classmethod
    def applies(cls, ctx: PushContext, planned: str) -> bool:
        return planned != "individual" and ctx.route is not None and TAGGED in ctx.route.strategies

    def run(self, ctx: PushContext) -> Attempt:
        TaggedPush.runs += 1
        attempt = Attempt()
        push_bundle(ctx, frozenset(), attempt, unpacker(ctx.route, self.name))
        attempt.route = f"tagged: {attempt.route}"
        return attempt


@pytest.fixture
def tagged():
    spec = RouteSpec("tagged", Direction.PUSH, ORDER,
                     lambda q: TaggedUnpack(q.endpoint, q.options) if transport_capable(q.transport,
                                                                                         TaggedUnpack.needs) else None)
    register_route(spec)
    register_strategy(TaggedPush)
    TaggedPush.runs = 0
    yield
    unregister_strategy(Direction.PUSH, TAGGED)
    unregister_route(Direction.PUSH, "tagged")


def test_a_strategy_registered_from_outside_is_chosen_by_its_rule(tagged, tmp_path):
    names = [kind.name for kind in registered_strategies(Direction.PUSH)]
    assert names == ["individual", "tar-tools", "hybrid", "stream", TAGGED, "store-and-forward"]
    src = _tree(tmp_path / "src", 30)
    result = push(src, str(tmp_path / "dest"), StagingOptions(strategy="bundle"))
    assert (result.strategy, result.route, TaggedPush.runs) == ("bundle", "tagged: tagged route", 1)
    assert_same_tree(src, tmp_path / "dest")
    again = push(src, str(tmp_path / "dest2"), StagingOptions(strategy="individual"))     # its rule says no
    assert again.route == "individual" and TaggedPush.runs == 1


def test_a_plan_no_registered_strategy_carries_is_refused_naming_the_route(tagged, tmp_path):
    unregister_strategy(Direction.PUSH, TAGGED)
    with pytest.raises(PalletError, match="no push strategy carries out a bundle plan through the route 'tagged"):
        push(_tree(tmp_path / "src", 5), str(tmp_path / "dest"), StagingOptions(strategy="bundle"))


def test_a_route_declares_only_capabilities_that_exist():
    with pytest.raises(TypeError, match="teleport"):
        type("Teleporting", (LocalUnpack,), {"needs": frozenset({"teleport"})})


# ---------------------------------------------------------------- a pull route registered from outside

class CountingPack(LocalPack):
    """A local source packed in this process, as pallet's own `local` pull route, counting its packs; it
    declares store-and-forward only."""

    strategies: ClassVar[frozenset[str]] = frozenset({STORE_AND_FORWARD})
    description = "counted pack"
    packs = 0

    def pack(self, codec, items=None):
        CountingPack.packs += 1
        return super().pack(codec, items)


def test_a_pull_route_registered_from_outside_packs_the_bundle(tmp_path):
    CountingPack.packs = 0
    register_route(RouteSpec("counted", Direction.PULL, 25,
                             lambda q: CountingPack(q.endpoint, q.options)
                             if transport_capable(q.transport, CountingPack.needs) else None))
    try:
        src = _tree(tmp_path / "src", 50)
        result = pull(src, str(tmp_path / "dest"), StagingOptions(strategy="bundle", stream="auto"))
    finally:
        unregister_route(Direction.PULL, "counted")
    assert (result.strategy, result.route, CountingPack.packs) == ("bundle", "counted pack", 1)
    assert_same_tree(src, tmp_path / "dest")


# ---------------------------------------------------------------- the shipped conformance suite, via the CLI

class TestByCommandConformance(RouteConformance):
    """The shipped suite, through `pallet push` with the route loaded as a plugin; the cases that must unpack
    check that this route's command did."""

    route, direction = ROUTE, Direction.PUSH

    @pytest.fixture
    def route_case(self, tmp_path_factory):
        from tests.programs import user_env
        where = tmp_path_factory.mktemp("by-command")
        return RouteCase(far=lambda path: path, env=user_env(**{LOG: str(where / "route.log")}),
                         pallet=launcher(where), expect_route=DESCRIPTION)

    def test_round_trip_of_a_nasty_tree(self, route_case: RouteCase, tmp_path):
        super().test_round_trip_of_a_nasty_tree(route_case, tmp_path)
        assert route_case.env is not None
        ran = invocations(route_case.env[LOG])
        assert len(ran) == 1 and ran[0].startswith(f"unpack {tmp_path / 'dest' / '.pallet' / 'incoming'}/"), ran

    def test_a_run_killed_midway_is_finished_by_a_rerun(self, route_case: RouteCase, tmp_path):
        super().test_a_run_killed_midway_is_finished_by_a_rerun(route_case, tmp_path)
        assert route_case.env is not None and len(invocations(route_case.env[LOG])) >= 1


# ---------------------------------------------------------------- policy reads declarations, never classes

SOURCE = Path(__file__).resolve().parents[1] / "staging_core"
ROUTE_CLASSES = {"Route", "UnpackRoute", "PackRoute", "TarToolsRoute", "PublishedBundle", "LocalUnpack",
                 "RemoteExecUnpack", "ViaUnpack", "SlurmJobUnpack", "KeepPacked", "LocalPack", "RemoteExecPack",
                 "ViaPack"}
POLICY = [SOURCE / "operations", SOURCE / "routes" / "unpack.py", SOURCE / "routes" / "pack.py",
          SOURCE / "routes" / "registry.py", SOURCE / "routes" / "base.py",
          SOURCE / "planning" / "local_profile.py", SOURCE / "in_place" / "remote_bytes.py"]


def _modules(paths: list[Path]) -> list[Path]:
    return sorted(p for path in paths for p in ([path] if path.is_file() else path.rglob("*.py")))


def _names(node: ast.AST) -> set[str]:
    return {n.id if isinstance(n, ast.Name) else n.attr for n in ast.walk(node)
            if isinstance(n, ast.Name | ast.Attribute)}


def test_nothing_in_staging_core_asks_a_route_its_class():
    asked = [f"{path.relative_to(SOURCE)}:{node.lineno}"
             for path in _modules([SOURCE]) for node in ast.walk(ast.parse(path.read_text()))
             if isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
             and node.func.id in ("isinstance", "issubclass") and len(node.args) == 2
             and _names(node.args[1]) & ROUTE_CLASSES]
    assert asked == []


def test_policy_names_no_scheme():
    named = []
    for path in _modules(POLICY):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Compare) and "scheme" in _names(node):
                literals = [c for c in node.comparators if isinstance(c, ast.Constant) and isinstance(c.value, str)
                            or isinstance(c, ast.Tuple | ast.Name) and "SCHEMES" in ast.unparse(c)]
                if literals:
                    named.append(f"{path.relative_to(SOURCE)}:{node.lineno}: {ast.unparse(node)}")
            if isinstance(node, ast.Assign) and any("SCHEMES" in ast.unparse(t) for t in node.targets):
                named.append(f"{path.relative_to(SOURCE)}:{node.lineno}: {ast.unparse(node)}")
    assert named == []


def test_the_stream_strategy_is_still_the_streaming_routes(tmp_path):
    """pallet's own unpack and pack routes carry stream and store-and-forward (the tar tools neither)."""
    from staging_core.routes.tar_tools import TarToolsRoute
    assert STREAM in LocalUnpack.strategies and STREAM in LocalPack.strategies
    assert TarToolsRoute.strategies == frozenset({"tar-tools"}) and TarToolsRoute.compares_dest_itself
