"""A stream's compression level fitted as it runs: up a rung while the link holds the sender, down while CPU does."""
from __future__ import annotations

import threading
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass

from .index import content_hash

# The levels a fitted stream moves between, cheapest first (zstd's negative levels are its "fast" ones). zstd 3
# and 4 are left out: on the CSV text measured (docs/benchmarks.md) they compress no better than 2 at half its speed.
LADDERS: dict[str, tuple[int, ...]] = {"zstd": (-5, -1, 1, 2, 6, 9)}
HOLD_FACTOR = 2.0        # one stage must take this many times the other's time before the level moves
MIN_SIGNAL_S = 0.002     # and at least this long: shorter waits are noise
_GIVE_UP_AFTER = 8       # a resumed stream stops looking for held shards after this many shards in a row held none


def ladder(codec: str) -> tuple[int, ...]:
    """The levels ``codec`` fits between, cheapest first; () for a codec whose level is not fitted."""
    return LADDERS.get(codec, ())


def next_rung(rung: int, waited_s: float, blocked_s: float, top: int, bottom: int = 0) -> int:
    """The ladder rung for the next shards, from how the last shard went: ``blocked_s`` the sender spent writing
    it (the pipe to the link was full), ``waited_s`` waiting for it to be built (packing and compressing). One
    rung up (compress harder) when writing took HOLD_FACTOR times the wait, one down (cheaper) when waiting
    took HOLD_FACTOR times the writing, else the same; never beyond ``bottom``..``top``. Pure."""
    if blocked_s >= MIN_SIGNAL_S and blocked_s > HOLD_FACTOR * waited_s:
        return min(rung + 1, top)
    if waited_s >= MIN_SIGNAL_S and waited_s > HOLD_FACTOR * blocked_s:
        return max(rung - 1, bottom)
    return rung


@dataclass(frozen=True)
class LevelRange:
    """Where a fitted stream starts and the levels it may use: ``levels``, a run of the codec's ladder."""

    codec: str
    start: int
    levels: tuple[int, ...]


def level_range(codec: str, start: int, low: int, high: int) -> LevelRange:
    """The rungs of ``codec``'s ladder between ``low`` and ``high`` (``start`` among them: added if it is not a
    rung, so a stream can always go back to where it started)."""
    rungs = sorted({level for level in ladder(codec) if low <= level <= high} | {start})
    return LevelRange(codec, start, tuple(rungs))


class LevelFit:
    """The level of one stream's shards, moved shard by shard (thread-safe: the stream's writer reports, the
    workers that compress read it).

    The writer reports each frame (:meth:`wrote`): the time since the previous frame ended (``waited``: the
    sender waited for the shard to be built) and the time the write took (``blocked``: the pipe towards the
    link was full). At the end of each shard :func:`next_rung` moves the level. The first shard only fills the
    pipeline and moves nothing. :meth:`take` hands out the level of the next shard compressed and counts it.

    A resumed stream: :meth:`hold` learns the hashes of the shards the receiver holds, compressed at levels
    this run does not know. While some are unmatched, a shard whose bytes are not among them is compressed
    again at the other rungs (nearest first) to find the bytes the receiver holds, so it is skipped, not sent
    again; after _GIVE_UP_AFTER shards in a row with no match the search stops.
    """

    def __init__(self, levels: LevelRange):
        self.range = levels
        self._rung = levels.levels.index(levels.start)
        self._lock = threading.Lock()
        self._used: Counter[int] = Counter()
        self._held: set[bytes] = set()
        self._misses = 0
        self._shard_waited = self._shard_blocked = 0.0
        self._shards_seen = 0

    @property
    def level(self) -> int:
        """The level the next shard is compressed at."""
        with self._lock:
            return self.range.levels[self._rung]

    def take(self) -> int:
        """The level of one more shard, counted as used."""
        with self._lock:
            level = self.range.levels[self._rung]
            self._used[level] += 1
            return level

    def _recount(self, taken: int, level: int) -> None:
        with self._lock:
            self._used[taken] -= 1
            self._used[level] += 1

    def used(self) -> dict[int, int]:
        """Shards compressed at each level so far (level -> shards)."""
        with self._lock:
            return {level: shards for level, shards in sorted(self._used.items()) if shards}

    def wrote(self, waited_s: float, blocked_s: float, ends_shard: bool, moves: bool = True) -> None:
        """One frame written: ``waited_s`` since the previous one ended, ``blocked_s`` writing it. At the end of a
        shard (``ends_shard``) the level moves, unless ``moves`` is False (a skipped shard says nothing of the
        link)."""
        with self._lock:
            self._shard_waited += waited_s
            self._shard_blocked += blocked_s
            if not ends_shard:
                return
            if moves and self._shards_seen:
                self._rung = next_rung(self._rung, self._shard_waited, self._shard_blocked,
                                       len(self.range.levels) - 1)
            self._shards_seen += moves
            self._shard_waited = self._shard_blocked = 0.0

    def hold(self, done: dict[int, bytes]) -> dict[int, bytes]:
        """Learn the receiver's answer (shard number -> hash of the bytes it holds); return it unchanged."""
        with self._lock:
            self._held = set(done.values())
        return done

    def compress(self, data: bytes, compress_at: Callable[[bytes, int], bytes]) -> bytes:
        """``data`` compressed at the level of the next shard (:meth:`take`) or, on a resumed stream, at the
        rung whose bytes the receiver holds (see the class)."""
        level = self.take()
        out = compress_at(data, level)
        if not self._searching() or self._claim(content_hash(out)):
            return out
        for other in sorted(self.range.levels, key=lambda rung: (abs(rung - level), rung)):
            if other != level:
                again = compress_at(data, other)
                if self._claim(content_hash(again)):
                    self._recount(level, other)
                    return again
        with self._lock:
            self._misses += 1
            if self._misses >= _GIVE_UP_AFTER:
                self._held.clear()
        return out

    def _searching(self) -> bool:
        with self._lock:
            return bool(self._held)

    def _claim(self, digest: bytes) -> bool:
        with self._lock:
            if digest not in self._held:
                return False
            self._held.discard(digest)
            self._misses = 0
            return True
