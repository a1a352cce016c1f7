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
    "push": "operations", "pull": "operations", "fetch": "selection", "send": "selection",
    "StagingOptions": "options", "StagingResult": "options", "STRATEGIES": "options",
    "plan": "planner", "load_profile": "profiles", "Inventory": "inventory", "DestinationLock": "locking",
    "OpenSource": "pull_phases", "plan_pull": "pull_phases", "move_packed": "pull_phases",
    "OpenDestination": "push_phases", "PushPlan": "push_phases", "plan_push": "push_phases",
    "finish_push": "push_phases", "compare_destination": "push_phases", "SourceSurvey": "push_phases",
    "scan_and_survey": "push_phases",
    "Strategy": "strategy_base", "Attempt": "strategy_base", "PushContext": "push_strategies",
    "push_strategy": "push_strategies", "PullContext": "pull_strategies", "pull_strategy": "pull_strategies",
    "MovedBundle": "pull_phases",
    # a kept bundle read in place by copying entries out
    "copy_out": "bundle_copy", "missing_members": "bundle_copy", "open_bundle": "bundle_copy",
    "CopiedOut": "bundle_copy",
    "run_local": "routes", "unpack_summary": "routes", "scratch_space": "scratch:scratch",
    "private_directory": "scratch",
    "parse_size": "display",
    # transports
    "Direction": "transports.base", "Endpoint": "transports.base", "RemoteEntry": "transports.base",
    "Transport": "transports.base", "parse_url": "transports.base", "local_tree_items": "transports.base",
    "open_transport": "transports.registry", "open_endpoint": "transports.registry",
    "Registration": "transports.registry", "register": "transports.registry",
    # errors: one hierarchy, rooted at PalletError
    "TransportError": "transports.errors", "RemotePathMissingError": "transports.errors",
    "MissingDependencyError": "transports.errors",
}
_ERRORS = ("PalletError", "UsageError", "SourceError", "DestinationError", "DestinationLocked", "SetupError",
           "StreamError", "BundleError", "CorruptBundleError", "SummaryError")

__all__ = sorted([*_PUBLIC, *_ERRORS])


def __getattr__(name: str):
    if name in _ERRORS:
        return getattr(importlib.import_module("bundles.errors"), name)
    if name in _PUBLIC:        # "module" or "module:name" (a name that is also a module's, such as scratch)
        module, _, attribute = _PUBLIC[name].partition(":")
        return getattr(importlib.import_module(f"{__name__}.{module}"), attribute or name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return __all__
