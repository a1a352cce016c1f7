"""Lazy registry of transports by URL scheme: modules are imported only when a scheme is used."""
from __future__ import annotations

import importlib
import importlib.util
import re
import shutil
from dataclasses import dataclass

from bundles.errors import UsageError

from .base import Endpoint, Transport, parse_url
from .errors import MissingDependencyError


@dataclass(frozen=True)
class Registration:
    """Where a transport lives, and what it needs installed (programs on PATH, Python modules)."""

    target: str                       # "package.module:Class"
    programs: tuple[str, ...] = ()
    modules: tuple[str, ...] = ()
    hint: str = ""


_SCHEME_NAME = re.compile(r"^[a-z][a-z0-9+.-]*$")
_REGISTRY: dict[str, Registration] = {
    "file": Registration("staging_core.transports.local:LocalTransport"),
    "ssh": Registration("staging_core.transports.ssh:SSHTransport", ("ssh", "rsync"),
                        hint="install openssh-client and rsync (apt-get install openssh-client rsync)"),
    "globus": Registration("staging_core.transports.globus:GlobusTransport", modules=("globus_sdk",),
                           hint="pip install 'pallet[globus]'"),
    "gsiftp": Registration("staging_core.transports.gridftp:GridFTPTransport", ("globus-url-copy",),
                           hint="install globus-url-copy (apt-get install globus-gass-copy-progs)"),
    "ftp": Registration("staging_core.transports.gridftp:GridFTPTransport", ("globus-url-copy",),
                        hint="install globus-url-copy (apt-get install globus-gass-copy-progs)"),
}


def register(scheme: str, registration: Registration) -> None:
    """Add or replace the transport for ``scheme`` (plugins may register their own): from then on
    ``scheme://[user@]host[:port]/abs`` URLs parse and open it, and nothing else in pallet needs to change."""
    if not _SCHEME_NAME.match(scheme):
        raise UsageError(f"{scheme!r} is not a URL scheme", hint="use lower-case letters, digits, + - or .")
    _REGISTRY[scheme] = registration


def unregister(scheme: str) -> None:
    """Remove the transport registered for ``scheme`` (nothing if there is none)."""
    _REGISTRY.pop(scheme, None)


def schemes() -> list[str]:
    """Schemes with a registered transport."""
    return sorted(_REGISTRY)


def transport_class(scheme: str) -> type[Transport]:
    """Import and return the transport class for ``scheme``; explain what is missing if it cannot."""
    registration = _REGISTRY.get(scheme)
    if registration is None:
        raise UsageError(f"no transport for {scheme}:// URLs", hint=f"available: {', '.join(schemes())}")
    missing = [p for p in registration.programs if shutil.which(p) is None]
    missing += [m for m in registration.modules if importlib.util.find_spec(m) is None]
    if missing:
        raise MissingDependencyError(f"the {scheme} transport needs {', '.join(missing)}", hint=registration.hint)
    module_name, _, class_name = registration.target.partition(":")
    return getattr(importlib.import_module(module_name), class_name)


def open_transport(url: str | Endpoint, **options) -> Transport:
    """Return a transport connected to the endpoint of ``url`` (options go to its constructor)."""
    endpoint = url if isinstance(url, Endpoint) else parse_url(url)
    return transport_class(endpoint.scheme)(endpoint, **options)


def open_endpoint(url: str | Endpoint, options=None) -> Transport:
    """The transport for ``url``, given the options it declares (``Transport.options_from``) taken from
    ``options`` (a StagingOptions; None: its defaults)."""
    endpoint = url if isinstance(url, Endpoint) else parse_url(url)
    kind = transport_class(endpoint.scheme)
    return kind(endpoint, **({} if options is None else kind.options_from(options)))
