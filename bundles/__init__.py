"""The pallet bundle format: a sharded, indexed tar stream that plain tar can read.

The names below are the package's API, each loaded from its module on
first use (PEP 562), so that ``import bundles.errors`` alone stays cheap:
a far-side session or a command that only parses its arguments does not
load the packer, the unpacker and the verifier.
"""
from __future__ import annotations

import importlib

_PUBLIC = {
    "BundleError": "errors", "CorruptBundleError": "errors", "DestinationError": "errors", "PalletError": "errors",
    "SourceError": "errors", "UnsafeMemberError": "errors", "UsageError": "errors",
    "FORMAT_VERSION": "index", "Entry": "index", "Index": "index", "Shard": "index",
    "Bundle": "reader", "Kind": "tarformat",
    "UnpackOptions": "unpacking", "UnpackResult": "unpacking", "unpack": "unpacking",
    "VerifyReport": "verify", "verify_bundle": "verify", "verify_tree": "verify",
    "PackOptions": "writer", "PackResult": "writer", "pack": "writer",
}

__all__ = sorted(_PUBLIC)


def __getattr__(name: str):
    module = _PUBLIC.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{module}"), name)


def __dir__() -> list[str]:
    return sorted({*globals(), *_PUBLIC})
