"""Pack one source with N ranks: shared compression, shards placed at offsets from an exclusive scan."""
from __future__ import annotations

import os
import time
from contextlib import suppress
from dataclasses import replace

from bundles import container
from bundles.codecs import get_codec
from bundles.errors import PalletError
from bundles.scan import scan
from bundles.index import HASH_SIZE, Shard
from bundles.shards import (BuiltShard, ShardPlan, auto_shard_size, build_shard, plan_shards, record_shard,
                            reset_columns)
from bundles.writer import PackOptions, check_destination, temp_name, write_error, write_sidecar

from .comm import Communicator
from .wire import PackSummary

_COPY_CHUNK = 64 << 20


def pack_parallel(comm: Communicator, src: str, bundle: str, options: PackOptions) -> PackSummary:
    """Pack ``src`` into ``bundle`` with every rank; the bytes equal the serial ``pallet pack``'s.

    Rank 0 walks the source and shares the entry list; every rank computes
    the same shard cuts and builds a contiguous run of shards into a private
    part file; an exclusive scan of the part sizes gives each rank its
    offset in the bundle, where it copies its part; rank 0 then adds the
    index and renames the bundle into place.
    """
    started = time.monotonic()
    codec = get_codec(options.codec, options.level)
    tree = comm.bcast(_scan_on_root(src, bundle, codec, options.include))
    if isinstance(tree, str):
        raise PalletError(tree)
    index = tree.index
    index.shard_size = options.shard_size or auto_shard_size(index)
    plans = plan_shards(index, index.shard_size)
    mine = _my_plans(plans, comm.rank, comm.size, index.sizes)
    final_tmp = comm.bcast(temp_name(bundle) + ".mpi" if comm.rank == 0 else None)
    part = f"{final_tmp}.rank{comm.rank}"
    error, built = _build_part(tree, codec, mine, part)
    errors = [e for e in comm.allgather(error) if e]
    if errors:
        _remove(part)
        raise PalletError(errors[0])
    base = comm.exscan_sum(os.path.getsize(part))
    if comm.rank == 0:
        open(final_tmp, "wb").close()
    comm.barrier()
    _copy_into(part, final_tmp, base)
    placed = comm.allgather([_placed(index, plan, shard, base) for plan, shard in built])
    outcome = comm.bcast(_finish_on_root(index, codec, placed, final_tmp, bundle) if comm.rank == 0 else None)
    if isinstance(outcome, str):
        raise PalletError(outcome)
    size = outcome
    return PackSummary(bundle, comm.size, len(index), len(plans), size, time.monotonic() - started)


def _scan_on_root(src, bundle, codec, include):
    try:
        check_destination(bundle)
        return scan(src, codec.name, codec.level, include=include)
    except PalletError as exc:
        return str(exc)


def _my_plans(plans: list[ShardPlan], rank: int, ranks: int, sizes) -> list[ShardPlan]:
    """A contiguous run of shards per rank, balanced on files + bytes."""
    costs = [50e-6 * p.count + 2e-9 * sum(sizes[p.first:p.first + p.count]) for p in plans]
    total, bounds, running = sum(costs) or 1.0, [0], 0.0
    for position, cost in enumerate(costs):
        running += cost
        while len(bounds) < ranks and running >= total * len(bounds) / ranks:
            bounds.append(position + 1)
    bounds += [len(plans)] * (ranks + 1 - len(bounds))
    return plans[bounds[rank]:bounds[rank + 1]]


def _build_part(tree, codec, plans: list[ShardPlan], part: str):
    """Build this rank's shards into ``part``; shard offsets are relative to the part's start."""
    built = []
    try:
        reset_columns(tree.index)
        with open(part, "w+b") as out:
            for plan in plans:
                built.append((plan, build_shard(tree, codec, plan, 1, out, out.tell())))
    except PalletError as exc:
        return str(exc), built
    except OSError as exc:
        return str(write_error(exc, part)), built
    return None, built


def _copy_into(part: str, target: str, base: int) -> None:
    with open(part, "rb") as source, open(target, "r+b") as out:
        position = base
        while chunk := source.read(_COPY_CHUNK):
            os.pwrite(out.fileno(), chunk, position)
            position += len(chunk)
    _remove(part)


def _placed(index, plan: ShardPlan, shard: Shard, base: int) -> tuple:
    """What rank 0 needs to record one shard built elsewhere: its entry columns and final position."""
    lo, hi = plan.first, plan.first + plan.count
    built = BuiltShard(b"", shard.raw_size, shard.file_bytes, bytes(index.hashes[lo * HASH_SIZE:hi * HASH_SIZE]),
                       index.offsets[lo:hi], index.data_offsets[lo:hi])
    return plan, built, replace(shard, offset=shard.offset + base)


def _finish_on_root(index, codec, placed: list, final_tmp: str, bundle: str) -> int | str:
    """Rank 0: record every shard, append the index section, write the sidecar, rename; size or error."""
    reset_columns(index)
    for rank_records in placed:
        for plan, built, shard in rank_records:
            record_shard(index, plan, built, shard)
    try:
        with open(final_tmp, "r+b") as out:
            out.seek(0, os.SEEK_END)
            payload = index.to_bytes()
            out.write(container.index_section(codec.name, payload, out.tell()))
            size = out.tell()
        write_sidecar(bundle, payload)
        os.replace(final_tmp, bundle)
    except OSError as exc:
        _remove(final_tmp)
        return str(write_error(exc, bundle))
    return size


def _remove(path: str) -> None:
    with suppress(FileNotFoundError):
        os.unlink(path)
