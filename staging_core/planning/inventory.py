"""Inventories: entry sizes of a local tree or a remote listing, summarised for the planner."""
from __future__ import annotations

import os
import posixpath
import random
from dataclasses import dataclass
from collections.abc import Sequence

import zstandard

from bundles.scan import SourceTree
from bundles.tarformat import Kind

from staging_core.planning.planner import LARGE_FILE_BYTES, TreeStats
from staging_core.transports.base import Transport

SAMPLE_BYTES = 4 << 20


@dataclass(frozen=True)
class Inventory:
    """Sizes of the regular files of a tree (columnar), with a histogram and planner statistics."""

    root: str
    sizes: list[int]
    large_file_bytes: int = LARGE_FILE_BYTES

    @property
    def stats(self) -> TreeStats:
        return TreeStats.from_sizes(self.sizes, self.large_file_bytes)

    def histogram(self) -> dict[str, int]:
        """File counts per size class (< 4 KiB, < 64 KiB, < 1 MiB, < 64 MiB, larger)."""
        bounds = [(4 << 10, "<4KiB"), (64 << 10, "<64KiB"), (1 << 20, "<1MiB"), (64 << 20, "<64MiB")]
        counts = {label: 0 for _, label in bounds} | {">=64MiB": 0}
        for size in self.sizes:
            counts[next((label for bound, label in bounds if size < bound), ">=64MiB")] += 1
        return counts


def tree_inventory(tree: SourceTree, large_file_bytes: int = LARGE_FILE_BYTES) -> tuple[Inventory, list[bytes]]:
    """The inventory of an already scanned tree (a push scans once for planning and packing)."""
    index = tree.index
    files = [i for i, kind in enumerate(index.kinds) if kind == Kind.FILE]
    return (Inventory(os.fsdecode(tree.root), [index.sizes[i] for i in files], large_file_bytes),
            [index.paths[i] for i in files])


def remote_inventory(transport: Transport, root: str, large_file_bytes: int = LARGE_FILE_BYTES,
                     items: Sequence[str] | None = None) -> Inventory:
    """One recursive listing through the transport (one `find` over ssh, Globus ls pages, ...); with
    ``items``, only the files among them or under those that are directories count."""
    entries = [e for e in transport.list(root) if e.kind == "f"]
    if items is not None:
        wanted = {posixpath.normpath(i) for i in items}
        entries = [e for e in entries if _selected(e.path, wanted)]
    return Inventory(root, [e.size for e in entries], large_file_bytes)


def _selected(path: str, wanted: set[str]) -> bool:
    while path and path != ".":
        if path in wanted:
            return True
        path = posixpath.dirname(path)
    return False


def compress_ratio(root: str, paths: list[bytes], budget: int = SAMPLE_BYTES, seed: int = 0) -> float:
    """zstd-compressed / original size of a random sample of files, read up to ``budget`` bytes."""
    rng = random.Random(seed)
    sample = rng.sample(paths, min(len(paths), 2000))
    chunks, total = [], 0
    for rel in sample:
        try:
            with open(os.path.join(os.fsencode(root), rel), "rb") as handle:
                chunk = handle.read(max(0, min(budget - total, 1 << 20)))
        except OSError:
            continue
        chunks.append(chunk)
        total += len(chunk)
        if total >= budget:
            break
    data = b"".join(chunks)
    if not data:
        return 1.0
    return len(zstandard.ZstdCompressor(level=3).compress(data)) / len(data)
