"""Shards are cut at entries chosen by content: adding or removing entries moves only the cuts near them."""
from __future__ import annotations

from array import array

from bundles import PackOptions, pack, shards
from bundles.extract import is_streamed
from bundles.index import Index
from bundles.shards import plan_shards
from bundles.stream import raw_bound
from bundles.tarformat import BLOCK, padding

TARGET = 64 << 10


def index_of(names: list[bytes], size: int = 1000) -> Index:
    """An index of regular files ``names``, each of ``size`` bytes (only paths and sizes matter to the cuts)."""
    return Index("zstd", 3, TARGET, paths=list(names), kinds=array("B", [0] * len(names)),
                 sizes=array("Q", [size] * len(names)), links=[b""] * len(names))


def shards_of(index: Index) -> list[tuple[bytes, ...]]:
    return [tuple(index.paths[p.first:p.first + p.count]) for p in plan_shards(index, TARGET)]


def names(numbers) -> list[bytes]:
    return [b"d%02d/f%05d.dat" % (n % 40, n) for n in numbers]


def test_shards_away_from_additions_and_removals_keep_their_entries():
    before = names(range(20_000))
    after = before[:1000] + names(range(50_000, 50_005)) + before[1000:3000] + before[3010:]
    old, new = shards_of(index_of(before)), set(shards_of(index_of(after)))
    kept = sum(shard in new for shard in old)
    assert len(old) > 100 and kept >= len(old) - 6, (kept, len(old))


def test_every_shard_holds_between_a_half_and_twice_the_target_but_the_last():
    index = index_of(names(range(20_000)))
    entry = BLOCK + 1000 + padding(1000)
    plans = plan_shards(index, TARGET)
    sizes = [p.count * entry for p in plans]
    assert all(TARGET // 2 <= size < 2 * TARGET for size in sizes[:-1]), sizes
    assert sum(p.count for p in plans) == len(index)
    assert [p.first for p in plans] == [sum(q.count for q in plans[:n]) for n in range(len(plans))]


def test_a_file_of_the_target_size_or_more_stands_alone():
    index = index_of(names(range(10)))
    index.sizes[4] = TARGET
    plans = plan_shards(index, TARGET)
    big = [p for p in plans if p.big]
    assert [(p.first, p.count) for p in big] == [(4, 1)]


def test_no_shard_built_whole_can_decode_past_the_held_limit(monkeypatch):
    """Long names count at their largest: a shard closes before an entry that could take its tar bytes past
    HELD_RAW_LIMIT (1 MiB here, in place of 1 GiB), which a receiver refuses to hold; without that rule this
    tree is one shard of about 2.5 MiB of headers."""
    tree = index_of([b"%s/%05d" % (b"n" * 300, n) for n in range(5000)], size=0)
    assert len(plan_shards(tree, 64 << 20)) == 1
    monkeypatch.setattr(shards, "HELD_RAW_LIMIT", 1 << 20)
    plans = plan_shards(tree, 64 << 20)
    assert len(plans) > 2 and all(raw_bound(tree, p) <= 1 << 20 for p in plans)
    assert [p.first for p in plans[1:]] == [p.first + p.count for p in plans[:-1]] and plans[-1].last


def test_a_file_of_half_the_held_limit_stands_alone_whatever_the_target():
    """With --shard-size 4G, a 600 MiB file is still a big shard (streamed, never built or received whole)."""
    tree = index_of([b"a", b"b", b"c"], size=10)
    tree.sizes[1] = 600 << 20
    assert [(p.count, p.big) for p in plan_shards(tree, 4 << 30)] == [(1, False), (1, True), (1, False)]


def test_readers_stream_a_file_that_stands_alone_below_the_target(monkeypatch, tmp_path):
    """A file of half HELD_RAW_LIMIT stands alone even under a larger --shard-size, and readers (unpack, verify,
    mount) stream its shard rather than hold it whole (the limit is 16 MiB here, in place of 1 GiB)."""
    monkeypatch.setattr(shards, "HELD_RAW_LIMIT", 16 << 20)
    (tmp_path / "src").mkdir()
    (tmp_path / "src" / "big").write_bytes(bytes(10 << 20))
    (tmp_path / "src" / "small").write_bytes(b"x")
    result = pack(str(tmp_path / "src"), str(tmp_path / "b.tar.zst"), PackOptions(shard_size=32 << 20, jobs=1))
    index = result.index
    big = next(s for s in index.shards if index.paths[s.first_entry] == b"big")
    assert big.entry_count == 1 and is_streamed(index, big)


def test_a_shards_raw_bound_is_the_sum_of_its_entries_bounds():
    """The receiver's bound of a shard (bundles.stream.raw_bound, taken column by column) is the planner's own
    entry by entry (bundles.shards.entry_bound), for every kind of entry: a file's data and padding only."""
    index = Index("zstd", 3, 0)
    for n, (kind, size) in enumerate([(1, 0), (0, 0), (0, 1), (0, 511), (0, 513), (2, 7), (3, 9), (0, 1 << 20)]):
        index.paths.append(b"d/" * n + b"entry%d" % n)
        index.links.append(b"target" * n if kind in (2, 3) else b"")
        index.kinds.append(kind)
        index.sizes.append(size)
    for first in range(len(index)):
        for count in range(1, len(index) - first + 1):
            plan = shards.ShardPlan(0, first, count, False, False)
            assert raw_bound(index, plan) == 2 * BLOCK + sum(shards.entry_bound(index, i)
                                                             for i in range(first, first + count))
