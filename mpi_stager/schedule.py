"""Shard assignment: longest-processing-time first on a files+bytes cost, with a dynamic tail."""
from __future__ import annotations

import heapq
from dataclasses import dataclass

from bundles.index import Shard
from bundles.unpacking import shard_cost


@dataclass(frozen=True)
class Assignment:
    """``static[r]`` lists the shards rank r does first; ``dynamic`` is handed out on demand, in order."""

    static: list[list[int]]
    dynamic: list[int]


def assign_shards(shards: list[Shard], ranks: int, dynamic_share: float = 0.25) -> Assignment:
    """Assign shards to ``ranks`` ranks, the same on every rank (a pure function).

    Shards are sorted by decreasing cost; those making up the first
    ``1 - dynamic_share`` of the total cost go to the least-loaded rank
    (LPT), the cheaper rest are handed out dynamically to whichever rank is
    free first, which evens out ranks that run slower than the model says.
    """
    order = sorted(shards, key=lambda s: (-shard_cost(s), s.number))
    if ranks <= 1:
        return Assignment([[s.number for s in order]], [])
    total = sum(shard_cost(s) for s in order)
    loads = [(0.0, rank) for rank in range(ranks)]
    static: list[list[int]] = [[] for _ in range(ranks)]
    assigned = 0.0
    split = len(order)
    for position, shard in enumerate(order):
        if assigned >= (1 - dynamic_share) * total and position >= ranks:
            split = position
            break
        load, rank = heapq.heappop(loads)
        static[rank].append(shard.number)
        heapq.heappush(loads, (load + shard_cost(shard), rank))
        assigned += shard_cost(shard)
    return Assignment(static, [s.number for s in order[split:]])
