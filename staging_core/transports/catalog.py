"""The table of URL schemes and where their transports live: the one list of schemes.

This module imports nothing of the transports package: ``base`` (which parses URLs, so must know the schemes)
and ``registry`` (which imports and opens transports) both read it, and imports point one way:
``catalog`` <- ``base`` <- ``registry`` <- the transports. Import :class:`Registration`, :func:`register`,
:func:`unregister` and :func:`schemes` from here; ``staging_core.transports.registry`` opens what they list.
"""
from __future__ import annotations

import re
from dataclasses import dataclass

from bundles.errors import UsageError


@dataclass(frozen=True)
class Registration:
    """Where a transport lives, and what it needs installed (programs on PATH, Python modules).

    ``options`` optionally names, as "package.module:NAME", the tuple of the transport's declared options
    (``Transport.declared_options``) in a module that can be imported without the transport and its
    dependencies, so that front ends can list every transport's options without loading any transport
    (see ``registry.all_declared_options``); empty: they are read from the transport class itself.
    """

    target: str                       # "package.module:Class"
    programs: tuple[str, ...] = ()
    modules: tuple[str, ...] = ()
    hint: str = ""
    options: str = ""                 # "package.module:NAME" of its declared options, importable without it


_SCHEME_NAME = re.compile(r"^[a-z][a-z0-9+.-]*$")
_GRIDFTP_HINT = "install globus-url-copy (apt-get install globus-gass-copy-progs)"
_DECLARED = "staging_core.transports.declarations"
_REGISTRY: dict[str, Registration] = {
    "file": Registration("staging_core.transports.local:LocalTransport", options=f"{_DECLARED}:LOCAL_OPTIONS"),
    "ssh": Registration("staging_core.transports.ssh:SSHTransport", ("ssh", "rsync"),
                        hint="install openssh-client and rsync (apt-get install openssh-client rsync)",
                        options=f"{_DECLARED}:SSH_OPTIONS"),
    "globus": Registration("staging_core.transports.globus:GlobusTransport", modules=("globus_sdk",),
                           hint="pip install 'pallet[globus]'", options=f"{_DECLARED}:GLOBUS_OPTIONS"),
    "gsiftp": Registration("staging_core.transports.gridftp:GridFTPTransport", ("globus-url-copy",),
                           hint=_GRIDFTP_HINT, options=f"{_DECLARED}:GRIDFTP_OPTIONS"),
    "ftp": Registration("staging_core.transports.gridftp:GridFTPTransport", ("globus-url-copy",),
                        hint=_GRIDFTP_HINT, options=f"{_DECLARED}:GRIDFTP_OPTIONS"),
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


def registration(scheme: str) -> Registration | None:
    """The registration of ``scheme``, or None when no transport is registered for it."""
    return _REGISTRY.get(scheme)
