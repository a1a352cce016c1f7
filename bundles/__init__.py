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

# the keys of _PUBLIC, written out so that tools reading the source see them
__all__ = [
    "Bundle", "BundleError", "CorruptBundleError", "DestinationError", "Entry", "FORMAT_VERSION", "Index", "Kind",
    "PackOptions", "PackResult", "PalletError", "Shard", "SourceError", "UnpackOptions", "UnpackResult",
    "UnsafeMemberError", "UsageError", "VerifyReport", "pack", "unpack", "verify_bundle", "verify_tree",
]


def __getattr__(name: str):
    module = _PUBLIC.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{module}"), name)


def __dir__() -> list[str]:
    return sorted({*globals(), *_PUBLIC})
