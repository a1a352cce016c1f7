"""What push and pull strategies share.

The interface, their registry, the record of one attempt, timed stages, one batch transfer.
"""
from __future__ import annotations

import threading
import time
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any, ClassVar, Generic, TypeVar

from bundles.errors import PalletError, UsageError
from bundles.progress import Progress
from bundles.stream import MAX_STREAMED_SHARD_SIZE

from staging_core.options import StagingOptions
from staging_core.routes.base import Route
from staging_core.transports.base import Direction, Endpoint, Transport, TransferResult
from staging_core.transports.errors import TransportError, source_side_failure

Context = TypeVar("Context")


@dataclass
class Attempt:
    """What one attempt of a strategy did: the route it reports, transfers made, seconds per stage, shards an
    earlier attempt had finished, and the file bytes the transport sent (None when it cannot tell). A route
    that compares DEST itself (the tar tools) reports the regular files it sent (``files_sent``, of
    ``file_bytes``; None: the operation's own count holds) and found in place. A pushed stream reports the
    shards it compressed at each level (``shard_levels``, level -> shards)."""

    route: str = "in place"
    transfers: int = 0
    stage_seconds: dict[str, float] = field(default_factory=dict)
    skipped_shards: int = 0
    bytes_sent: int | None = 0
    files_sent: int | None = None
    file_bytes: int = 0
    in_place: int = 0
    shard_levels: dict[int, int] = field(default_factory=dict)

    def compared(self, outcome) -> None:
        """Record what a route that compared DEST itself found (a routes.tar_tools.TarToolsOutcome)."""
        self.files_sent, self.file_bytes, self.in_place = outcome.files_sent, outcome.file_bytes, outcome.in_place

    def streamed(self, outcome) -> None:
        """Record one bundle stream (push or pull; a streaming.StreamOutcome)."""
        self.route, self.transfers, self.skipped_shards = "stream", 1, outcome.skipped_shards
        self.bytes_sent = outcome.bytes_sent
        self.stage_seconds.update(outcome.stage_seconds)
        self.shard_levels = dict(outcome.shard_levels)

    def count(self, result: TransferResult) -> None:
        """Add one transfer and the bytes it moved."""
        self.transfers += 1
        self.bytes_sent = None if self.bytes_sent is None or result.bytes_sent is None \
            else self.bytes_sent + result.bytes_sent


class Strategy(ABC, Generic[Context]):
    """One way to move what an operation selected: individually, as a stream, stored and forwarded, hybrid, or
    through the far side's tar tools.

    ``name`` is the strategy's name (a route lists the names of those that
    may carry a bundle through it in ``Route.strategies``), ``direction``
    the operation it serves (PUSH or PULL). Strategies register themselves
    (:func:`register_strategy`); for an attempt, the registered strategies
    of the direction are asked in increasing ``order`` and the first whose
    ``applies(ctx, planned)`` is True runs: ``planned`` is the plan's
    strategy (individual, bundle or hybrid), and ``applies`` reads only the
    context: the route's declarations (``Route.strategies``, ``streams``),
    the transport's capabilities and the options. It may raise UsageError
    for an option the context cannot honour (``--stream on`` where nothing
    streams).

    ``run(ctx)`` makes one attempt with everything the operation opened
    (its context: a PushContext or a PullContext) and returns what it did
    as an :class:`Attempt`; it raises a TransportError (retried by the
    caller when marked retryable) or another PalletError naming the cause.
    An attempt may be made again after a retryable failure, and must then
    resume: rsync skips files already there, journals skip finished shards.
    A strategy holds no state between attempts.
    """

    name: ClassVar[str] = ""
    direction: ClassVar[Direction]
    order: ClassVar[int] = 100

    @classmethod
    @abstractmethod
    def applies(cls, ctx: Context, planned: str) -> bool:
        """Whether this strategy carries out ``planned`` (individual, bundle, hybrid) where ``ctx`` leads."""

    @abstractmethod
    def run(self, ctx: Context) -> Attempt: ...


StrategyClass = TypeVar("StrategyClass", bound="type[Strategy[Any]]")


class StrategyRegistry:
    """Strategy classes by (direction, name). Registration happens at import time (pallet's own when
    push_strategies and pull_strategies are imported, others when their modules are), lookups from any thread
    after; a lock keeps a lookup from meeting a registration half-way. Not a place for per-operation state."""

    def __init__(self) -> None:
        self._kinds: dict[tuple[Direction, str], type[Strategy[Any]]] = {}
        self._lock = threading.Lock()

    def add(self, kind: type[Strategy[Any]]) -> None:
        with self._lock:
            self._kinds[(kind.direction, kind.name)] = kind

    def remove(self, direction: Direction, name: str) -> None:
        with self._lock:
            self._kinds.pop((direction, name), None)

    def ordered(self, direction: Direction) -> list[type[Strategy[Any]]]:
        with self._lock:
            kinds = [kind for (way, _), kind in self._kinds.items() if way is direction]
        return sorted(kinds, key=lambda kind: (kind.order, kind.name))


STRATEGIES = StrategyRegistry()


def register_strategy(kind: StrategyClass) -> StrategyClass:
    """Register a Strategy class under its ``(direction, name)``, replacing one of that name (usable as a class
    decorator). pallet's own register when their modules (push_strategies, pull_strategies) are imported."""
    if not kind.name or not isinstance(getattr(kind, "direction", None), Direction):
        raise TypeError(f"{kind.__name__} needs a name and a direction to be registered")
    STRATEGIES.add(kind)
    return kind


def unregister_strategy(direction: Direction, name: str) -> None:
    """Remove a registered strategy (nothing if there is none)."""
    STRATEGIES.remove(direction, name)


def registered_strategies(direction: Direction) -> list[type[Strategy[Any]]]:
    """The strategies of ``direction`` in the order they are asked."""
    return STRATEGIES.ordered(direction)


def select_strategy(direction: Direction, ctx: Context, planned: str, route: Route | None) -> Strategy[Context]:
    """The first registered strategy of ``direction`` that applies to ``ctx`` and ``planned`` (``route``: the
    context's route, for the error); PalletError when none does."""
    for kind in registered_strategies(direction):
        if kind.applies(ctx, planned):
            return kind()
    where = "without a route" if route is None else f"through the route {route.description!r}"
    raise PalletError(f"no {direction.value} strategy carries out a {planned} plan {where} "
                      f"(it carries: {', '.join(sorted(route.strategies)) if route is not None else 'nothing'})",
                      hint="use --strategy individual, or --stream auto where a route carries only streams")


class Stage:
    """Time one stage of an attempt and show it on ``progress``."""

    def __init__(self, attempt: Attempt, progress: Progress, name: str, files: int = 0, nbytes: int = 0):
        self.attempt, self.progress, self.name, self.files, self.nbytes = attempt, progress, name, files, nbytes

    def __enter__(self):
        self.started = time.monotonic()
        self.progress.start(self.name, self.files, self.nbytes)
        return self

    def __exit__(self, *exc) -> None:
        if exc[0] is None and self.files:
            self.progress.advance(self.files, self.nbytes)
        self.progress.finish()
        seconds = self.attempt.stage_seconds
        seconds[self.name] = seconds.get(self.name, 0.0) + time.monotonic() - self.started


def resolve_strategy(chosen, options: StagingOptions, route: Route | None, endpoint: Endpoint) -> str:
    """The strategy to run: the planner's choice (a planner.Plan) under ``--strategy auto``, else the user's;
    UsageError when the user asks for a bundle where no route can unpack or pack one."""
    if options.strategy == "auto":
        return chosen.strategy
    if options.strategy != "individual" and route is None:
        raise UsageError(f"--strategy {options.strategy} needs a way to run pallet at {endpoint.url()}",
                         hint="add --unpack-via ssh://HOST (a host that mounts that file system), "
                              "--keep-packed, or use --strategy individual")
    return options.strategy


def streams_where(capable: bool, options: StagingOptions, why_not: str, needs: str = "") -> bool:
    """Whether ``options.stream`` (auto, on, off) streams where ``capable`` says it can, and ``--shard-size``
    allows (see :func:`check_stream_shard_size`); UsageError for 'on' where it cannot."""
    check_stream_shard_size(options)
    if options.stream == "on" and not capable:
        raise UsageError(f"--stream on: {why_not}", hint=f"use --stream auto or off{needs}")
    return capable and options.stream != "off" and not _above_streamed_shards(options)


def check_stream_shard_size(options: StagingOptions) -> None:
    """UsageError for ``--stream on`` with a ``--shard-size`` no stream carries: a receiver holds each shard
    sent whole, so shards above MAX_STREAMED_SHARD_SIZE are stored and forwarded instead."""
    if options.stream == "on" and _above_streamed_shards(options):
        most = MAX_STREAMED_SHARD_SIZE >> 20
        raise UsageError(f"--stream on: a --shard-size above {most}M is not streamed",
                         hint=f"use --stream auto or off, or --shard-size {most}M or less")


def _above_streamed_shards(options: StagingOptions) -> bool:
    return bool(options.shard_size and options.shard_size > MAX_STREAMED_SHARD_SIZE)


def transfer_all(transport: Transport, direction: Direction, local: str, endpoint: Endpoint,
                 items: list[str] | None, temp_dir: str | None = None) -> TransferResult:
    """One batch transfer (the transport's temporaries in ``temp_dir``, relative to the destination root); raise
    a TransportError naming the files, and the first one's error, if any failed."""
    result = transport.transfer(direction, local, endpoint.path, items, temp_dir)
    if not result.ok:
        unreadable = source_side_failure(result.failed, local if direction is Direction.PUSH else endpoint.path)
        if unreadable is not None:          # the source's fault: exits as the bundle routes' SourceError does
            raise unreadable
        first = sorted(result.failed)[0]
        names = ", ".join(sorted(result.failed)[:10])
        rest = "send" if direction is Direction.PUSH else "fetch"
        raise TransportError(f"{len(result.failed)} file(s) failed: {names} (first: {first}: "
                             f"{_one_line(result.failed[first])})", endpoint.url(),
                             f"fix that cause; a rerun then {rest}s the rest", retryable=False)
    return result


def _one_line(error: BaseException) -> str:
    """An error's message without its path and hint (those are the transfer's own), with the last line of what
    the tool said when there is one (``copy failed (Input/output error)``)."""
    message = getattr(error, "message", None) or str(error).splitlines()[0]
    said = getattr(error, "stderr", "").strip().splitlines()
    return f"{message} ({said[-1][:200]})" if said and said[-1] not in message else message
