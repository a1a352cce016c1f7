"""The pallet bundle format: a sharded, indexed tar stream that plain tar can read."""
from .errors import (BundleError, CorruptBundleError, DestinationError, PalletError, SourceError,
                     UnsafeMemberError, UsageError)
from .index import FORMAT_VERSION, Entry, Index, Shard
from .reader import Bundle
from .tarformat import Kind
from .unpack import UnpackOptions, UnpackResult, unpack
from .verify import VerifyReport, verify_bundle, verify_tree
from .writer import PackOptions, PackResult, pack

__all__ = [
    "FORMAT_VERSION", "Bundle", "BundleError", "CorruptBundleError", "DestinationError", "Entry", "Index",
    "Kind", "PackOptions", "PackResult", "PalletError", "Shard", "SourceError", "UnpackOptions",
    "UnpackResult", "UnsafeMemberError", "UsageError", "VerifyReport", "pack", "unpack", "verify_bundle",
    "verify_tree",
]
