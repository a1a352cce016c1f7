"""pallet's staging core: the `pallet` command line, the planner, transports, push and pull, reading in place.

The names below are its public API, imported lazily (a name's module is
loaded on first use, as fsspec's registry does), so that ``import
staging_core`` stays cheap. The Snakemake and Parsl plugins import only
these.
"""
from __future__ import annotations

import importlib

_PUBLIC = {
    # operations
    "push": "operations.push_pull", "pull": "operations.push_pull",
    "fetch": "operations.selection", "send": "operations.selection", "fetch_if_small": "operations.selection",
    # a run's warm connections: one host session per host, shared by threads (docs/host-sessions.md)
    "HostSessions": "far_side.host_session", "HostSession": "far_side.host_session",
    "SessionLost": "far_side.host_session", "NoHostSession": "far_side.host_session",
    "StagingOptions": "options", "StagingResult": "results", "STRATEGIES": "options",
    "OptionDeclaration": "options", "declarations": "options", "TransportSetting": "options",
    "transport_settings": "options",
    "plan": "planning.planner", "load_profile": "planning.profiles", "Inventory": "planning.inventory",
    "DestinationLock": "locking",
    "OpenSource": "operations.pull_phases", "plan_pull": "operations.pull_phases",
    "move_packed": "operations.pull_phases",
    "OpenDestination": "operations.push_phases", "PushPlan": "operations.push_phases",
    "plan_push": "operations.push_phases", "finish_push": "operations.push_phases",
    "compare_destination": "operations.push_phases", "SourceSurvey": "operations.push_phases",
    "scan_and_survey": "operations.push_phases",
    "Strategy": "operations.strategy_base", "Attempt": "operations.strategy_base",
    "PushContext": "operations.push_strategies", "push_strategy": "operations.push_strategies",
    "PullContext": "operations.pull_strategies", "pull_strategy": "operations.pull_strategies",
    "MovedBundle": "operations.pull_phases",
    # a kept bundle read in place by copying entries out
    "copy_out": "in_place.bundle_copy", "missing_members": "in_place.bundle_copy",
    "open_bundle": "in_place.bundle_copy", "CopiedOut": "in_place.bundle_copy",
    "run_local": "routes.unpack", "unpack_summary": "routes.unpack", "scratch_space": "scratch:scratch",
    "private_directory": "scratch",
    "parse_size": "cli.display",
    # transports
    "Direction": "transports.base", "Endpoint": "transports.base", "RemoteEntry": "transports.base",
    "Transport": "transports.base", "parse_url": "transports.base", "local_tree_items": "transports.base",
    "open_transport": "transports.registry", "open_endpoint": "transports.registry",
    "Registration": "transports.catalog", "register": "transports.catalog",
    "Capabilities": "transports.base", "capable": "transports.registry",
    "declared_capabilities": "transports.registry",
    # routes and strategies: what a route or strategy added from outside pallet registers with
    "Route": "routes.base", "RouteSpec": "routes.registry", "RouteQuery": "routes.registry",
    "register_route": "routes.registry", "register_strategy": "operations.strategy_base",
    # errors: one hierarchy, rooted at PalletError
    "TransportError": "transports.errors", "RemotePathMissingError": "transports.errors",
    "MissingDependencyError": "transports.errors",
}
_ERRORS = ("PalletError", "UsageError", "SourceError", "DestinationError", "DestinationLocked", "SetupError",
           "StreamError", "BundleError", "CorruptBundleError", "SummaryError")

# a list at run time, derived from the lazy table so that the two cannot drift apart
__all__ = sorted([*_PUBLIC, *_ERRORS])  # noqa: PLE0605


def __getattr__(name: str):
    if name in _ERRORS:
        return getattr(importlib.import_module("bundles.errors"), name)
    if name in _PUBLIC:        # "module" or "module:name" (a name that is also a module's, such as scratch)
        module, _, attribute = _PUBLIC[name].partition(":")
        return getattr(importlib.import_module(f"{__name__}.{module}"), attribute or name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return __all__
