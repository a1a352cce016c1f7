"""Lazy registry of transports by URL scheme: modules are imported only when a scheme is used.

The table of schemes itself lives in :mod:`staging_core.transports.catalog` (which ``base`` reads to parse
URLs, so imports point one way: catalog <- base <- registry): import :class:`Registration`, :func:`register`,
:func:`unregister` and :func:`schemes` from there, and :func:`parse_url` from ``base``.
"""
from __future__ import annotations

import importlib
import importlib.util
import shutil

from bundles.errors import UsageError

from .base import Capabilities, EarlyConnection, Endpoint, Transport, TransportOption, parse_url
from .catalog import Registration, registration, schemes
from .errors import MissingDependencyError

__all__ = ["all_declared_options", "capable", "declared_capabilities", "declared_options", "open_endpoint",
           "open_transport", "transport_class"]


def _registered(scheme: str) -> Registration:
    found = registration(scheme)
    if found is None:
        raise UsageError(f"no transport for {scheme}:// URLs", hint=f"available: {', '.join(schemes())}")
    return found


def _missing_modules(found: Registration) -> list[str]:
    return [m for m in found.modules if importlib.util.find_spec(m) is None]


def _load(target: str):
    module_name, _, name = target.partition(":")
    return getattr(importlib.import_module(module_name), name)


def transport_class(scheme: str) -> type[Transport]:
    """Import and return the transport class for ``scheme``; explain what is missing if it cannot."""
    found = _registered(scheme)
    missing = [p for p in found.programs if shutil.which(p) is None] + _missing_modules(found)
    if missing:
        raise MissingDependencyError(f"the {scheme} transport needs {', '.join(missing)}", hint=found.hint)
    return _load(found.target)


def declared_options(scheme: str) -> tuple[TransportOption, ...]:
    """The options the transport for ``scheme`` declares (``Transport.declared_options``), read from its
    ``Registration.options`` when it names them (nothing of the transport is imported), else from its class
    (imported now; its programs need not be installed, its Python modules must be: MissingDependencyError
    says which are not). UsageError for a scheme with no transport."""
    found = _registered(scheme)
    if found.options:
        return tuple(_load(found.options))
    missing = _missing_modules(found)
    if missing:
        raise MissingDependencyError(f"the {scheme} transport needs {', '.join(missing)}", hint=found.hint)
    kind: type[Transport] = _load(found.target)
    return kind.declared_options


def all_declared_options() -> dict[str, tuple[TransportOption, ...]]:
    """Every registered scheme's declared options (:func:`declared_options`), by scheme in scheme order: what
    front ends (CLI, Snakemake, Parsl) derive their per-transport settings from; the options of ``scheme`` go
    to its transport through ``StagingOptions.transport_options[scheme]``. Transports that name their options in
    ``Registration.options`` (all of pallet's own) are not imported; a registered transport that does not, and
    whose Python modules are missing, is left out (it cannot be opened either)."""
    listed: dict[str, tuple[TransportOption, ...]] = {}
    for scheme in schemes():
        try:
            listed[scheme] = declared_options(scheme)
        except MissingDependencyError:
            continue
    return listed


def open_transport(url: str | Endpoint, **options) -> Transport:
    """Return a transport connected to the endpoint of ``url`` (options go to its constructor)."""
    endpoint = url if isinstance(url, Endpoint) else parse_url(url)
    return transport_class(endpoint.scheme)(endpoint, **options)


def open_endpoint(url: str | Endpoint, options=None, early: EarlyConnection | None = None) -> Transport:
    """The transport for ``url``, given the options it declares (``Transport.options_from``) taken from
    ``options`` (a StagingOptions; None: its defaults), and ``early``, a connection started for it
    (``Transport.connect_early``), as its declared option ``early.option``: the transport takes it over."""
    endpoint = url if isinstance(url, Endpoint) else parse_url(url)
    kind = transport_class(endpoint.scheme)
    given = {} if options is None else kind.options_from(options)
    if early is not None:
        given[early.option] = early.connection
    return kind(endpoint, **given)


def capable(capabilities: Capabilities | None, needs: frozenset[str]) -> bool:
    """Whether ``capabilities`` (None: unknown, i.e. none) declare every flag of ``needs``."""
    return capabilities is not None and all(getattr(capabilities, flag) for flag in needs)


def declared_capabilities(scheme: str) -> Capabilities | None:
    """The Capabilities the transport class registered for ``scheme`` declares, read without connecting and
    without checking that its programs are installed (opening it checks those); None when no transport is
    registered for it or its Python modules cannot be imported (it cannot be opened either)."""
    found = registration(scheme)
    if found is None:
        return None
    try:
        kind: type[Transport] = _load(found.target)
    except ImportError:
        return None
    return kind.capabilities
