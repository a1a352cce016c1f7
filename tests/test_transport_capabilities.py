"""Transports declare what policy needs (Capabilities flags) and the options they take (declared_options), and
the transports package imports one way."""
from __future__ import annotations

import ast
import importlib
import inspect
import os
import subprocess
import sys
from dataclasses import fields

import pytest

from staging_core.options import StagingOptions
from staging_core.transports import catalog
from staging_core.transports.base import (Capabilities, Direction, EarlyConnection, Endpoint, RemoteEntry,
                                          TransferResult, Transport, TransportOption, parse_url)
from staging_core.transports.errors import MissingDependencyError
from staging_core.transports.catalog import Registration, register, schemes, unregister
from staging_core.transports.registry import all_declared_options, declared_options, open_endpoint

POLICY_FLAGS = ("exact_listing", "posix_shell", "local_copy", "byte_ranges", "shared_connection")
# What each of pallet's own transports must declare (the flags not named: False)
EXPECTED = {
    "file": {"exact_listing", "local_copy"},
    "ssh": {"exact_listing", "posix_shell", "byte_ranges", "shared_connection"},
    "gsiftp": set(),
    "ftp": set(),
    "globus": set(),
}
TRANSPORTS_DIR = os.path.join(os.path.dirname(__file__), os.pardir, "staging_core", "transports")


def _class_of(scheme: str) -> type[Transport]:
    """The class registered for ``scheme``, imported without the program checks of transport_class (the
    declarations are what is tested, not the tools)."""
    registration = catalog.registration(scheme)
    assert registration is not None
    module, _, name = registration.target.partition(":")
    return getattr(importlib.import_module(module), name)


def _declared(capabilities: Capabilities) -> set[str]:
    return {flag for flag in POLICY_FLAGS if getattr(capabilities, flag)}


class _Bare(Transport):
    """A transport that declares nothing beyond the core contract (as one written before the flags existed)."""

    scheme = "bare"
    capabilities = Capabilities(batch=True)

    def __init__(self, endpoint: Endpoint, shelf: str = "", copies: tuple[str, ...] = ()):
        super().__init__(endpoint)
        self.shelf, self.copies = shelf, copies

    def transfer(self, direction: Direction, local_root: str, remote_root: str, items=None,
                 temp_dir=None) -> TransferResult:
        return TransferResult()

    def list(self, path: str) -> list[RemoteEntry]:
        return []

    def stat(self, path: str) -> RemoteEntry | None:
        return None

    def mkdir(self, path: str) -> None:
        pass


class _Declaring(_Bare):
    declared_options = (TransportOption("shelf", str, "", "the shelf", staging_field="remote_python"),
                        TransportOption("copies", str, (), "extra", multiple=True, staging_field="job_options"))


@pytest.mark.parametrize("scheme", sorted(EXPECTED))
def test_each_own_transport_declares_its_policy_flags(scheme):
    assert _declared(_class_of(scheme).capabilities) == EXPECTED[scheme]


def test_every_registered_scheme_is_covered_here():
    assert set(schemes()) == set(EXPECTED), "a new transport: say above which policy flags it declares"


def test_the_flags_default_to_false_so_unknown_transports_are_safe():
    assert _declared(Capabilities()) == set()
    assert _declared(_Bare.capabilities) == set()
    assert _Bare.declared_options == ()
    assert _Bare.connect_early(parse_url("/x"), StagingOptions()) is None
    assert all(field.default is False for field in fields(Capabilities) if field.name in POLICY_FLAGS)


@pytest.mark.parametrize("flags, needs", [({"posix_shell": True}, "remote_exec"),
                                          ({"byte_ranges": True, "remote_exec": True, "posix_shell": True},
                                           "streaming"),
                                          ({"byte_ranges": True, "streaming": True}, "posix_shell")])
def test_flags_that_need_others_are_refused_without_them(flags, needs):
    with pytest.raises(ValueError, match=needs):
        Capabilities(**flags)


def test_adjusted_instance_capabilities_keep_the_class_flags():
    with _class_of("ssh")(parse_url("ssh://127.0.0.1/tmp"), parallel=3) as transport:     # connects on first use
        assert transport.capabilities.concurrency == 3
        assert _declared(transport.capabilities) == EXPECTED["ssh"]
    gridftp = _class_of("ftp")(parse_url("ftp://127.0.0.1:2121/data"))
    assert gridftp.capabilities.names == "printable-ascii" and _declared(gridftp.capabilities) == set()


@pytest.mark.parametrize("scheme", sorted(EXPECTED))
def test_declared_options_are_the_constructor_keywords(scheme):
    kind = _class_of(scheme)
    parameters = dict(list(inspect.signature(kind.__init__).parameters.items())[2:])      # past self, endpoint
    declared = {option.name: option for option in kind.declared_options}
    assert list(declared) == list(parameters), f"{kind.__name__}: declared options and keywords differ"
    for name, option in declared.items():
        default = parameters[name].default
        assert option.default == (tuple(default) if option.multiple else default), name
        assert option.help and option.type in (str, int, float, bool, object), name
        if option.multiple:
            assert isinstance(option.default, tuple) and all(isinstance(v, option.type) for v in option.default)
        elif option.default is not None:
            assert isinstance(option.default, option.type), name
        if option.choices and option.default is not None:
            assert option.default in option.choices, name
        assert option.settable == (option.type is not object), name
        if option.staging_field is not None:
            assert option.staging_field in {f.name for f in fields(StagingOptions)}, name


def test_all_declared_options_lists_every_scheme_as_its_class_declares():
    listed = all_declared_options()
    assert sorted(listed) == schemes()
    for scheme, options in listed.items():
        assert options == _class_of(scheme).declared_options, scheme
    assert [o.name for o in listed["ssh"]] == ["ssh_options", "parallel", "master", "keep"]
    assert [o.name for o in listed["file"]] == ["link_mode", "threads"]
    ssh_options = listed["ssh"][0]
    assert (ssh_options.staging_field, ssh_options.flag, ssh_options.multiple) == ("ssh_options", "--ssh-option", True)
    assert not next(o for o in listed["globus"] if o.name == "client").settable


def test_listing_the_options_imports_no_transport():
    code = ("import sys; from staging_core.transports import registry; listed = registry.all_declared_options(); "
            "loaded = sorted(m for m in sys.modules if m.split('.')[-1] in "
            "('local', 'ssh', 'ssh_master', 'gridftp', 'globus', 'globus_sdk') and "
            "(m.startswith('staging_core.transports.') or m == 'globus_sdk')); "
            "print(len(listed), loaded)")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                          cwd=os.path.join(os.path.dirname(__file__), os.pardir))
    assert done.stdout.split(" ", 1) == [str(len(EXPECTED)), "[]\n"], done.stdout + done.stderr


def test_a_plugin_transport_declares_its_options_on_its_class():
    register("shelf", Registration(f"{__name__}:_Declaring"))
    register("shelfx", Registration(f"{__name__}:_Declaring", modules=("no_such_module_for_pallet",)))
    try:
        assert declared_options("shelf") == _Declaring.declared_options
        assert all_declared_options()["shelf"] == _Declaring.declared_options
        assert "shelfx" not in all_declared_options()            # cannot be opened either
        with pytest.raises(MissingDependencyError, match="no_such_module_for_pallet"):
            declared_options("shelfx")
    finally:
        unregister("shelf")
        unregister("shelfx")


def test_options_from_follows_the_declarations():
    options = StagingOptions(ssh_options=("-v",), remote_python="py3", job_options=("a", "b"),
                             transport_options={"ssh": {"ssh_options": ["-q"], "parallel": 2},
                                                "bare": {"copies": ["z"]}, "file": {"threads": 3}})
    assert _class_of("ssh").options_from(options) == {"ssh_options": ["-q", "-v"], "parallel": 2}
    assert _class_of("ssh").options_from(StagingOptions()) == {"ssh_options": []}
    assert _class_of("file").options_from(options) == {"threads": 3}
    assert _Bare.options_from(options) == {"copies": ["z"]}                   # nothing declared: as given
    assert _Declaring.options_from(options) == {"copies": ["z", "a", "b"], "shelf": "py3"}
    given = StagingOptions(remote_python="py3", transport_options={"bare": {"shelf": "mine"}})
    assert _Declaring.options_from(given) == {"shelf": "mine", "copies": []}  # given wins over the field


def test_the_early_ssh_connection_is_the_one_the_transport_takes_over(sshd, tmp_path):
    kind = _class_of("ssh")
    endpoint = parse_url(sshd.url(str(tmp_path)))
    options = StagingOptions(ssh_options=tuple(sshd.ssh_options))
    early = kind.connect_early(endpoint, options)
    assert isinstance(early, EarlyConnection) and early.option == "master"
    try:
        given = {"ssh": {early.option: early.connection}}
        with open_endpoint(endpoint, StagingOptions(ssh_options=options.ssh_options,
                                                    transport_options=given)) as transport:
            assert transport._master is early.connection
            assert transport.run(["echo", "hi"]) == b"hi\n"
    finally:
        early.close()


def _transport_imports() -> dict[str, set[str]]:
    """Module -> the modules of staging_core.transports it imports (at the top or inside functions)."""
    names = {name[:-3] for name in os.listdir(TRANSPORTS_DIR) if name.endswith(".py")}
    graph = {}
    for name in names:
        with open(os.path.join(TRANSPORTS_DIR, f"{name}.py")) as source:
            tree = ast.parse(source.read())
        found = set()
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.level == 1:
                found |= {node.module.split(".")[0]} if node.module else {alias.name for alias in node.names}
            elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("staging_core.transports."):
                found.add(node.module.split(".")[2])
            elif isinstance(node, ast.Import):
                found |= {alias.name.split(".")[2] for alias in node.names
                          if alias.name.startswith("staging_core.transports.")}
        graph[name] = found & names - {name}
    return graph


def test_the_transports_package_imports_one_way():
    graph = _transport_imports()
    assert "catalog" in graph["base"] and "registry" not in graph["base"]
    assert graph["catalog"] == set() and "declarations" not in graph["registry"]
    state: dict[str, str] = {}

    def visit(name: str, path: list[str]) -> None:
        state[name] = "open"
        for dep in sorted(graph[name]):
            assert state.get(dep) != "open", f"import cycle: {' -> '.join([*path, name, dep])}"
            if dep not in state:
                visit(dep, [*path, name])
        state[name] = "done"

    for name in sorted(graph):
        if name not in state:
            visit(name, [])
