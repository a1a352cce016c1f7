"""The peak memory of unpack and verify as a formula of the bundle's index (stated in docs/bundle-format.md)."""
from __future__ import annotations

from .extract import held_whole
from .index import Index, Shard

BASE_BYTES = 64 << 20             # the interpreter, its libraries and the native engine
PER_ENTRY_BYTES = 160             # the index's columns and objects per entry, names aside
WORKER_STACK_BYTES = 8 << 20      # each worker thread's stack
WORKER_ARENA_BYTES = 64 << 20     # the malloc arena glibc may reserve for each thread (address space, mostly unused)
STREAM_BUFFER_BYTES = 16 << 20    # a streamed shard: its 8 MiB chunks, and a zstd window of at most 8 MiB


def shard_bytes(index: Index, shard: Shard) -> int:
    """Memory one worker holds for ``shard``: its compressed and decoded bytes when it is held whole, else
    fixed buffers (bundles.extract.held_whole)."""
    return shard.length + shard.raw_size if held_whole(index, shard) else STREAM_BUFFER_BYTES


def peak_bytes(index: Index, workers: int) -> int:
    """The most address space `pallet unpack` or `pallet verify` with ``workers`` workers needs for ``index``:

        BASE + entries x PER_ENTRY + bytes of all names and link targets
             + workers x (STACK + ARENA + largest shard)

    where a shard counts its compressed plus decoded size when that is at most HOLD_LIMIT (bundles.extract),
    and STREAM_BUFFER otherwise: such a shard (one file too large to share a shard, or a shard cut at a large
    ``--shard-size``) is read as a stream. ARENA is address space glibc reserves per thread, not memory used: the
    resident peak is lower by up to that much per worker. The input's size does not appear: files are never held whole.
    """
    names = sum(map(len, index.paths)) + sum(map(len, index.links))
    largest = max((shard_bytes(index, shard) for shard in index.shards), default=0)
    per_worker = WORKER_STACK_BYTES + WORKER_ARENA_BYTES + largest
    return BASE_BYTES + len(index) * PER_ENTRY_BYTES + names + max(1, workers) * per_worker
