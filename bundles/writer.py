"""Write a bundle: walk the source, cut it into shards, build and compress them in parallel."""
from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import BinaryIO

from . import container, native
from .codecs import Codec, get_codec
from .errors import DestinationError, PalletError
from .index import Index
from .parallel import WorkerPool, default_jobs, jobs_for, pool_for
from .progress import NoProgress, Progress
from .scan import PACK_SECONDS_PER_ENTRY, SourceTree, scan
from .shards import (BuiltShard, HashingWriter, ShardPlan, auto_shard_size, build_from_source, build_streamed_shard,
                     place_shard, plan_shards, reset_columns, shard_source)


@dataclass(frozen=True)
class PackOptions:
    """How to pack: codec and level, target uncompressed shard size (None: automatic), workers, and
    relative names of files to leave out or, with ``include``, the only ones to pack (see
    :func:`bundles.scan.scan`)."""

    codec: str = "zstd"
    level: int | None = None
    shard_size: int | None = None
    jobs: int = 0
    exclude: frozenset[bytes] = frozenset()
    include: frozenset[bytes] | None = None


@dataclass(frozen=True)
class PackResult:
    """What pack wrote: the bundle, its sidecar index and the index itself."""

    bundle: str
    sidecar: str
    index: Index
    bundle_bytes: int
    seconds: float


def pack(src: str | os.PathLike, bundle: str | os.PathLike, options: PackOptions = PackOptions(),
         progress: Progress | None = None) -> PackResult:
    """Pack ``src`` into ``bundle`` (and ``bundle.pidx``) and return what was written.

    The bundle is written under a temporary name in the same directory and
    renamed at the end, so a failed or interrupted pack never leaves a partial
    file under the final name; the source is only read. The output bytes
    depend only on the source tree and the codec, level and shard size —
    never on ``jobs``.
    """
    started = time.monotonic()
    codec = get_codec(options.codec, options.level)
    bundle = os.fspath(bundle)
    check_destination(bundle)
    with WorkerPool(options.jobs or default_jobs(), native.releases_gil()) as pool:
        tree = scan(src, codec.name, codec.level, options.exclude, options.include, pool)
        return _write_bundle(tree, bundle, codec, options, progress, pool, started)


def _write_bundle(tree: SourceTree, bundle: str, codec: Codec, options: PackOptions, progress: Progress | None,
                  pool: WorkerPool, started: float) -> PackResult:
    index = tree.index
    index.shard_size = options.shard_size or auto_shard_size(index)
    plans = plan_shards(index, index.shard_size)
    progress = progress or NoProgress()
    progress.start("pack", len(index), sum(index.sizes))
    tmp = temp_name(bundle)
    try:
        with open(tmp, "w+b") as out:     # read back to hash streamed shards
            _write_shards(tree, plans, codec, options.jobs, pool, out, progress)
            payload = index.to_bytes()
            out.write(container.index_section(codec.name, payload, out.tell()))
            size = out.tell()
        sidecar = write_sidecar(bundle, payload)
        os.replace(tmp, bundle)
    except OSError as exc:
        raise write_error(exc, bundle) from exc
    finally:
        progress.finish()
        with contextlib.suppress(OSError):      # a failing disk may refuse this too: the error above is the news
            os.unlink(tmp)
    return PackResult(bundle, sidecar, index, size, time.monotonic() - started)


def _write_shards(tree: SourceTree, plans: list[ShardPlan], codec: Codec, jobs: int, pool: WorkerPool, out,
                  progress) -> None:
    reset_columns(tree.index)
    offset = out.tell()
    hashing: dict[int, HashingWriter] = {}

    def sink(plan: ShardPlan):
        if codec.name == "gzip":       # pigz writes to the descriptor: its bytes are read back to hash them
            return out
        hashing[plan.number] = HashingWriter(out)
        return hashing[plan.number]

    for plan, built in iter_shards(tree, plans, codec, jobs, sink, pool):
        writer = hashing.pop(plan.number, None)
        place_shard(tree.index, plan, built, out, offset, writer.digest() if writer else None)
        offset = out.tell()
        progress.advance(plan.count, built.file_bytes)


def iter_shards(tree: SourceTree, plans: list[ShardPlan], codec: Codec, jobs: int,
                sink: Callable[[ShardPlan], BinaryIO],
                pool: WorkerPool | None = None, md5: bool = False) -> Iterator[tuple[ShardPlan, BuiltShard]]:
    """Build the shards of ``plans`` and yield ``(plan, built)`` in plan order.

    Small shards are built by the workers of ``pool`` (or of a pool made
    for this call), at most two per worker ahead of the consumer, and carry
    their compressed bytes; ``jobs`` is the user's request (0: automatic,
    which builds them inline when the tree is small; see
    :func:`bundles.parallel.jobs_for`). A big shard
    (one large file) is compressed with ``jobs`` threads straight onto
    ``sink(plan)`` — called just before, once the previous shard has been
    consumed — and its BuiltShard holds no bytes. The bytes depend only on
    the tree, the codec and level, and the plans, never on ``jobs``; the
    index is not touched (see :func:`bundles.shards.record_shard`). With
    ``md5`` each BuiltShard also carries its files' md5 digests. Closing
    the generator early stops the workers.
    """
    small_plans = [p for p in plans if not p.big]
    wanted = jobs_for(sum(p.count for p in small_plans) * PACK_SECONDS_PER_ENTRY, jobs)
    threads = jobs or default_jobs()
    with pool_for(pool, wanted) as workers:
        small = workers.map(build_from_source, (shard_source(tree, codec, p, md5) for p in small_plans),
                            wanted == 1)
        try:
            for plan in plans:
                yield plan, build_streamed_shard(tree, plan, codec, threads, sink(plan), md5) if plan.big \
                    else next(small)
        finally:
            small.close()


def write_sidecar(bundle: str, payload: bytes) -> str:
    """Write the index ``payload`` as ``bundle.pidx`` (via a temporary name) and return its path."""
    sidecar = bundle + container.SIDECAR_SUFFIX
    tmp = temp_name(sidecar)
    try:
        with open(tmp, "wb") as out:
            out.write(payload)
        os.replace(tmp, sidecar)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return sidecar


def check_destination(bundle: str) -> None:
    """Raise DestinationError unless ``bundle`` can be created (parent exists and is writable)."""
    parent = os.path.dirname(os.path.abspath(bundle))
    if not os.path.isdir(parent):
        raise DestinationError("directory for the bundle does not exist", parent, "create it first (mkdir -p)")
    if os.path.isdir(bundle):
        raise DestinationError("is a directory", bundle, "give the bundle a file name, e.g. data.tar.zst")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise DestinationError("directory is not writable", parent, "write the bundle somewhere you may write")


def temp_name(path: str) -> str:
    """The hidden name a file is written under before it is renamed to ``path``."""
    head, tail = os.path.split(path)
    return os.path.join(head, f".{tail}.part-{os.getpid()}")


def write_error(exc: OSError, bundle: str) -> PalletError:
    """Explain an OSError met while writing ``bundle``."""
    if exc.errno == 28:
        return DestinationError("no space left while writing the bundle", bundle,
                                "free space or write the bundle to another file system")
    return DestinationError(f"cannot write the bundle ({exc.strerror})", bundle, "check the destination directory")
