"""The shipped route conformance suite, run against every registered push and pull route with its real far side."""
from __future__ import annotations

import os
import shlex
import subprocess
import sys

import pytest

from staging_core.routes.conformance import RouteCase, RouteConformance
from staging_core.routes.registry import registered_routes
from staging_core.transports.base import Direction
from tests.programs import program, user_env
from tests.test_tar_tools_route import bare  # noqa: F401  (the far side without pallet)
from tests.test_routes import gsiftp_server, needs_gridftp, slurm, via_url  # noqa: F401


def ssh_flags(server, with_pallet: bool = True) -> tuple[str, ...]:
    flags = tuple(f"--ssh-option={option}" for option in server.ssh_options)
    return (*flags, "--remote-python", sys.executable) if with_pallet else flags


def gridftp_env(server) -> dict[str, str]:
    """The GSI client environment of the test GridFTP server, for the installed command."""
    return user_env(**server.client_env, PALLET_GRIDFTP_OPTIONS=shlex.join(server.options))


def unpack_kept(dest: str, scratch: str) -> str:
    """DEST after --keep-packed holds only .pallet/incoming (bundle, index, unpack.sbatch): unpack it elsewhere."""
    incoming = os.path.join(dest, ".pallet", "incoming")
    assert os.listdir(dest) == [".pallet"] and os.listdir(os.path.join(dest, ".pallet")) == ["incoming"]
    bundle = next(name for name in os.listdir(incoming) if name.startswith("bundle.tar") and "pidx" not in name)
    assert sorted(os.listdir(incoming)) == [bundle, f"{bundle}.pidx", "unpack.sbatch"]
    subprocess.run([program("pallet"), "unpack", "--quiet", os.path.join(incoming, bundle), scratch],
                   check=True, env=user_env(), stdin=subprocess.DEVNULL, timeout=300)
    return scratch


def published(tree: str, scratch: str) -> str:
    """``tree`` packed into a bundle with its index beside it, as `pallet pack` publishes one."""
    os.makedirs(scratch)
    bundle = os.path.join(scratch, "data.tar.zst")
    subprocess.run([program("pallet"), "pack", "--quiet", tree, bundle], check=True, env=user_env(),
                   stdin=subprocess.DEVNULL, timeout=300)
    return bundle


def local_case(**extra) -> RouteCase:
    return RouteCase(far=lambda path: path, env=user_env(), pallet=program("pallet"), **extra)


def remote_case(server, **extra) -> RouteCase:
    """A far side over ssh with pallet (this environment's Python)."""
    return RouteCase(far=server.url, flags=ssh_flags(server), env=user_env(), pallet=program("pallet"), **extra)


def tar_tools_case(server) -> RouteCase:
    """A far side over ssh without pallet: its own tar and md5sum."""
    return RouteCase(far=server.url, flags=ssh_flags(server, with_pallet=False), env=user_env(),
                     expect_route="tar tools", pallet=program("pallet"))


def gridftp_case(gridftp, sshd, *flags: str, expect_route: str = "") -> RouteCase:
    """A GridFTP far side whose file system the test sshd also sees (the via host)."""
    return RouteCase(far=gridftp.url, flags=(*ssh_flags(sshd), *flags), env=gridftp_env(gridftp),
                     expect_route=expect_route, pallet=program("pallet"))


# ---------------------------------------------------------------- push routes

class TestLocalPush(RouteConformance):
    route, direction = "local", Direction.PUSH

    @pytest.fixture
    def route_case(self):
        return local_case()


class TestRemotePush(RouteConformance):
    route, direction = "remote", Direction.PUSH

    @pytest.fixture
    def route_case(self, sshd):
        return remote_case(sshd)


class TestTarToolsPush(RouteConformance):
    route, direction = "tar-tools", Direction.PUSH
    whole_seconds = True        # the far side's GNU tar sets DEST's mtimes from format 2's ustar headers

    @pytest.fixture
    def route_case(self, bare):  # noqa: F811
        return tar_tools_case(bare)


class TestKeepPackedPush(RouteConformance):
    route, direction = "keep-packed", Direction.PUSH
    tree_at_dest = False

    @pytest.fixture
    def route_case(self):
        return local_case(flags=("--keep-packed",), landed=unpack_kept, expect_route="kept packed")


@needs_gridftp
class TestUnpackViaPush(RouteConformance):
    route, direction = "unpack-via", Direction.PUSH
    individual = False      # GridFTP carries no symbolic links one by one (an individual push refuses them)
    compares_dest = False   # it ships the whole selection every time

    @pytest.fixture
    def route_case(self, gsiftp_server, sshd):  # noqa: F811
        return gridftp_case(gsiftp_server, sshd, "--unpack-via", via_url(sshd), expect_route="via ssh://")


@needs_gridftp
class TestSlurmJobPush(RouteConformance):
    route, direction = "slurm-job", Direction.PUSH
    individual = False      # as unpack-via
    compares_dest = False   # as unpack-via

    @pytest.fixture
    def route_case(self, gsiftp_server, sshd, slurm):  # noqa: F811
        return gridftp_case(gsiftp_server, sshd, *(f"--ssh-option={o}" for o in slurm.ssh_options),
                            "--unpack-via", via_url(sshd), "--unpack-job", "slurm", expect_route="slurm job")


# ---------------------------------------------------------------- pull routes

class TestLocalPull(RouteConformance):
    route, direction = "local", Direction.PULL

    @pytest.fixture
    def route_case(self):
        return local_case()


class TestRemotePull(RouteConformance):
    route, direction = "remote", Direction.PULL

    @pytest.fixture
    def route_case(self, sshd):
        return remote_case(sshd)


class TestTarToolsPull(RouteConformance):
    route, direction = "tar-tools", Direction.PULL

    @pytest.fixture
    def route_case(self, bare):  # noqa: F811
        return tar_tools_case(bare)


class TestPublishedBundlePull(RouteConformance):
    route, direction = "published-bundle", Direction.PULL
    individual = False      # a bundle is always unpacked
    compares_dest = False   # ... whole

    @pytest.fixture
    def route_case(self, sshd):
        return remote_case(sshd, source=published)


@needs_gridftp
class TestPackViaPull(RouteConformance):
    route, direction = "pack-via", Direction.PULL
    individual = False      # as unpack-via
    compares_dest = False   # as unpack-via

    @pytest.fixture
    def route_case(self, gsiftp_server, sshd):  # noqa: F811
        return gridftp_case(gsiftp_server, sshd, "--pack-via", via_url(sshd))


def test_every_registered_route_has_a_conformance_run():
    registered = {(direction, spec.name) for direction in Direction for spec in registered_routes(direction)}
    assert registered <= RouteConformance.tested_routes, \
        f"routes without a conformance run: {sorted(registered - RouteConformance.tested_routes)}"
