"""A transport pallet does not know, registered from outside its code, parses, opens and passes the shipped
conformance suite: the registry is the only list of schemes."""
from __future__ import annotations

import os
import shutil

import pytest

from bundles.errors import UsageError
from staging_core import StagingOptions, pull, push
from staging_core.testing import ConformanceTarget, TransportConformance, assert_same_tree
from tests.conftest import make_files
from staging_core.transports.base import (Capabilities, Direction, Endpoint, RemoteEntry, TransferResult,
                                          Transport, parse_url)
from staging_core.transports.errors import RemotePathMissingError
from staging_core.transports.catalog import Registration, register, schemes, unregister
from staging_core.transports.registry import open_transport

SCHEME = "vault"


class VaultTransport(Transport):
    """``vault://SHELF/abs``: files kept under a directory per shelf (given as ``root``), copied with shutil."""

    scheme = SCHEME
    capabilities = Capabilities(batch=True, symlinks=True, hardlinks=False, per_file_overhead_s=1e-5)

    def __init__(self, endpoint: Endpoint, root: str = ""):
        super().__init__(endpoint)
        self.root = os.path.join(root, endpoint.host)

    def _here(self, path: str) -> str:
        return os.path.join(self.root, path.lstrip("/"))

    def transfer(self, direction: Direction, local_root: str, remote_root: str,
                 items: list[str] | None = None, temp_dir: str | None = None) -> TransferResult:
        result = TransferResult()
        source, target = ((local_root, self._here(remote_root)) if direction is Direction.PUSH
                          else (self._here(remote_root), local_root))
        for item in self.all_items(direction, local_root, remote_root) if items is None else items:
            try:
                _copy(os.path.join(source, item), os.path.join(target, item))
                result.done.append(item)
            except OSError as exc:
                result.failed[item] = RemotePathMissingError(exc.strerror, os.path.join(source, item))
        for item in sorted(result.done, key=lambda name: name.count("/"), reverse=True):     # filling changed them
            if os.path.isdir(os.path.join(target, item)) and not os.path.islink(os.path.join(target, item)):
                shutil.copystat(os.path.join(source, item), os.path.join(target, item))
        return result

    def list(self, path: str) -> list[RemoteEntry]:
        top = self._here(path)
        found = []
        for current, dirs, files in os.walk(top):
            for name in dirs + files:
                found.append(_entry(os.path.join(current, name), os.path.relpath(os.path.join(current, name), top)))
        return found

    def stat(self, path: str) -> RemoteEntry | None:
        here = self._here(path)
        return _entry(here, "") if os.path.lexists(here) else None

    def mkdir(self, path: str) -> None:
        os.makedirs(self._here(path), exist_ok=True)


def _copy(source: str, target: str) -> None:
    os.makedirs(os.path.dirname(target), exist_ok=True)
    if os.path.lexists(target) and not os.path.isdir(target):
        os.unlink(target)
    if os.path.islink(source):
        os.symlink(os.readlink(source), target)
        shutil.copystat(source, target, follow_symlinks=False)
    elif os.path.isdir(source):
        os.makedirs(target, exist_ok=True)
        shutil.copystat(source, target)
    else:
        shutil.copy2(source, target)


def _entry(path: str, rel: str) -> RemoteEntry:
    st = os.lstat(path)
    kind = "l" if os.path.islink(path) else "d" if os.path.isdir(path) else "f"
    return RemoteEntry(rel, kind, st.st_size, st.st_mode & 0o7777, st.st_mtime_ns,
                       os.readlink(path) if kind == "l" else "")


@pytest.fixture(scope="module")
def vault_registered():
    register(SCHEME, Registration(f"{__name__}:VaultTransport"))
    yield
    unregister(SCHEME)


class TestVaultConformance(TransportConformance):
    scheme = SCHEME

    @pytest.fixture
    def conformance_target(self, vault_registered, tmp_path):
        transport = open_transport(f"{SCHEME}://shelf1/data", root=str(tmp_path / "vault"))
        transport.mkdir("/data")
        return ConformanceTarget(transport, "/data")


def test_the_registry_is_the_only_list_of_schemes(vault_registered):
    assert SCHEME in schemes()
    assert parse_url(f"{SCHEME}://shelf1/data/x") == Endpoint(SCHEME, "/data/x", "shelf1")
    unregister(SCHEME)
    try:
        with pytest.raises(UsageError, match="unknown URL scheme 'vault'"):
            parse_url(f"{SCHEME}://shelf1/data/x")
    finally:
        register(SCHEME, Registration(f"{__name__}:VaultTransport"))
    with pytest.raises(UsageError, match="is not a URL scheme"):
        register("Not A Scheme", Registration(f"{__name__}:VaultTransport"))


def test_a_push_and_a_pull_run_through_it_with_its_own_options(vault_registered, tmp_path):
    src = make_files(tmp_path / "src", 60, 3, lambda n: b"vault %d\n" % n)       # no hard links: it has none
    options = StagingOptions(transport_options={SCHEME: {"root": str(tmp_path / "vault")}}, stream="off")
    pushed = push(src, f"{SCHEME}://shelf2/data", options)
    assert pushed.strategy == "individual" and pushed.files > 0      # no way to run pallet there: individual
    assert_same_tree(src, tmp_path / "vault" / "shelf2" / "data")
    pulled = pull(f"{SCHEME}://shelf2/data", str(tmp_path / "back"), options)
    assert pulled.strategy == "individual" and pulled.files == pushed.files
    assert_same_tree(src, tmp_path / "back")
