"""The shipped conformance suite, run against every registered transport with its real server."""
from __future__ import annotations

import importlib

import pytest

from staging_core.testing import ConformanceTarget, TransportConformance
from staging_core.transports.catalog import schemes
from staging_core.transports.registry import open_transport


class TestLocalConformance(TransportConformance):
    scheme = "file"

    @pytest.fixture
    def conformance_target(self, tmp_path):
        remote = tmp_path / "remote"
        remote.mkdir()
        return ConformanceTarget(open_transport(str(remote)), str(remote))


class TestLocalPythonEngineConformance(TransportConformance):
    """The local transport again, copying one file at a time as the Python engine does."""

    scheme = "file"

    @pytest.fixture
    def conformance_target(self, tmp_path, monkeypatch):
        monkeypatch.setenv("PALLET_ENGINE", "python")
        remote = tmp_path / "remote"
        remote.mkdir()
        return ConformanceTarget(open_transport(str(remote)), str(remote))


class TestSSHConformance(TransportConformance):
    scheme = "ssh"

    @pytest.fixture
    def conformance_target(self, sshd, tmp_path):
        remote = tmp_path / "remote"
        remote.mkdir()
        with open_transport(sshd.url(str(remote)), ssh_options=sshd.ssh_options) as transport:
            yield ConformanceTarget(transport, str(remote))


def test_every_registered_transport_has_a_conformance_run():
    for module in ("tests.test_gridftp", "tests.test_globus"):    # their conformance classes live there
        importlib.import_module(module)
    assert set(schemes()) <= TransportConformance.tested_schemes, \
        f"transports without a conformance run: {set(schemes()) - TransportConformance.tested_schemes}"


class TestParallelRsyncConformance(TransportConformance):
    scheme = "ssh"

    @pytest.fixture
    def conformance_target(self, sshd, tmp_path):
        remote = tmp_path / "remote"
        remote.mkdir()
        with open_transport(sshd.url(str(remote)), ssh_options=sshd.ssh_options, parallel=3) as transport:
            yield ConformanceTarget(transport, str(remote))
