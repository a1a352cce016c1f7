"""A stream's compression level fitted to the link: chosen from the profile, moved as it runs, resumable, over ssh."""
from __future__ import annotations

import io
import json
import os
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest
import zstandard

from bundles import PackOptions, pack
from bundles.codecs import get_codec
from bundles.errors import CorruptBundleError, UsageError
from bundles.index import Index, content_hash
from bundles.level_fit import LADDERS, LevelFit, level_range, next_rung
from bundles.progress import NoProgress
from bundles.reader import Bundle
from bundles.stream import encode_skeleton, shard_key
from mpi_stager.send import prepare_source, send_stream
from staging_core.far_side.streaming import at_level, stream_push
from staging_core.planning.level import fit_level, level_stages, planned_level
from staging_core.planning.planner import LinkProfile, TreeStats, plan
from staging_core.transports.base import parse_url
from staging_core.transports.registry import open_transport
from tests.conftest import assert_same_tree, run_pallet
from tests.programs import python_module, user_env
from tests.test_stream import options, tiny_tree

W1 = TreeStats.from_sizes([1024] * 65_536)
FAST_FAR_SIDE = LinkProfile("fit", rtt_s=0.04, create_rate=1e6, decompress_rate=2e9, is_default=False)
SPEEDS = [100e9, 10e9, 1e9, 125e6, 30e6, 10e6, 1e6]
ZSTD = LADDERS["zstd"]


# ---------------------------------------------------------------- the level chosen from the profile (pure)

def fitted(bandwidth: float, ratio: float = 0.44, **changes):
    return fit_level(W1, replace(FAST_FAR_SIDE, bandwidth=bandwidth, **changes), ratio, ranks=2)


def test_a_fast_link_gets_the_cheapest_level_and_a_slow_one_a_dearer_one():
    levels = [fitted(speed).level for speed in SPEEDS]
    assert levels == sorted(levels), levels                     # slower link, never a cheaper level
    assert levels[0] == ZSTD[0] and levels[-1] == ZSTD[-1] and len(set(levels)) >= 3, levels


@pytest.mark.parametrize("bandwidth", SPEEDS)
def test_the_level_is_the_cheapest_at_which_the_link_does_not_hold_the_stream_back(bandwidth):
    profile = replace(FAST_FAR_SIDE, bandwidth=bandwidth)
    chosen = fit_level(W1, profile, 0.44, 2)
    stages = {level: level_stages(W1, profile, 0.44, 2, level) for level in ZSTD}
    least = min(stage.seconds for stage in stages.values())
    assert stages[chosen.level].seconds <= least * 1.02                  # as fast as any, within the tie
    assert all(stages[level].seconds > least * 1.02 for level in ZSTD if level < chosen.level)   # the cheapest
    cheaper = [stages[level] for level in ZSTD if level < chosen.level]
    if not stages[chosen.level].link_bound:
        assert "the cheapest at which the link" in chosen.why and all(stage.link_bound for stage in cheaper)
    else:
        assert "the link sets the pace" in chosen.why
    assert (chosen.low, chosen.fixed) == (ZSTD[0], False) and chosen.high >= chosen.level
    dearer = [level for level in ZSTD if level > chosen.high]           # the CPU could not feed the link there
    assert all(profile.level_compress_rates[profile.levels.index(level)] * 2 < bandwidth for level in dearer)


def test_a_far_side_slow_to_create_files_keeps_the_cheapest_level_even_on_a_slow_link():
    assert fitted(30e6, create_rate=2_000).level == ZSTD[0]         # unpacking sets the pace: the link is idle
    assert fitted(30e6).level > ZSTD[0]


def test_incompressible_data_gains_nothing_from_a_dearer_level():
    assert fitted(30e6, ratio=1.0).level == ZSTD[0] < fitted(30e6, ratio=0.3).level


def test_the_users_level_wins_and_other_codecs_keep_their_default():
    asked = fit_level(W1, FAST_FAR_SIDE, 0.44, asked=7)
    assert (asked.level, asked.low, asked.high, asked.fixed) == (7, 7, 7, True) and "--level" in asked.why
    gzip = fit_level(W1, FAST_FAR_SIDE, 0.44, codec="gzip")
    assert (gzip.level, gzip.fixed) == (6, True)


def test_the_plan_says_which_level_and_why_and_the_stream_takes_it():
    chosen = plan(W1, replace(FAST_FAR_SIDE, bandwidth=1e6), compress_ratio=0.44, ranks=2)
    fitted_level = chosen.details["level"]
    assert chosen.strategy == "bundle" and fitted_level["level"] == ZSTD[-1] and not fitted_level["fixed"]
    assert f"zstd level {ZSTD[-1]}:" in chosen.reason and "adjusted between" in chosen.reason
    assert planned_level(chosen.details, "zstd", None).level == ZSTD[-1]
    assert planned_level(chosen.details, "zstd", 4).level == 4           # --level
    assert planned_level(chosen.details, "gzip", None).level == 6        # --codec gzip: its default
    asked = plan(W1, replace(FAST_FAR_SIDE, bandwidth=10e6), compress_ratio=0.44, ranks=2, level=5)
    assert asked.details["level"]["level"] == 5 and "as asked (--level)" in asked.reason


def test_a_profile_without_level_rates_keeps_zstds_default():
    bare = replace(FAST_FAR_SIDE, levels=(), level_compress_rates=(), level_ratios=())
    assert fit_level(W1, bare, 0.44).level == 3


# ---------------------------------------------------------------- adjusted as the stream runs (pure)

@pytest.mark.parametrize("waited,blocked,expected", [
    (0.001, 0.200, 3),      # the writes waited on the link: compress harder
    (0.200, 0.001, 1),      # the writer waited on the compressor: cheaper
    (0.100, 0.120, 2),      # neither clearly: stay
    (0.0005, 0.0015, 2),    # too short to say anything
])
def test_one_rung_at_a_time_towards_the_stage_that_waits(waited, blocked, expected):
    assert next_rung(2, waited, blocked, top=5) == expected


def test_the_rungs_stop_at_the_ends():
    assert next_rung(5, 0.0, 1.0, top=5) == 5 and next_rung(0, 1.0, 0.0, top=5) == 0


def fit_from(start: int = 1) -> LevelFit:
    return LevelFit(level_range("zstd", start, ZSTD[0], ZSTD[-1]))


def test_the_level_moves_per_shard_after_the_first_and_not_on_skipped_shards():
    fit = fit_from(1)
    fit.wrote(0.0, 0.5, ends_shard=True)                        # the first shard fills the pipeline
    assert fit.level == 1
    fit.wrote(0.0, 0.3, ends_shard=False)                       # a big shard's DATA frames add up ...
    fit.wrote(0.0, 0.3, ends_shard=True)                        # ... to one shard blocked on the link
    assert fit.level == 2
    fit.wrote(0.9, 0.0, ends_shard=True, moves=False)           # skipped: says nothing of the link
    assert fit.level == 2
    for _ in range(10):
        fit.wrote(0.5, 0.0, ends_shard=True)                    # waiting on the compressor
    assert fit.level == ZSTD[0]
    assert [fit.take(), fit.take()] == [ZSTD[0], ZSTD[0]] and fit.used() == {ZSTD[0]: 2}


def test_a_start_between_rungs_is_a_rung_of_its_own():
    assert level_range("zstd", 3, ZSTD[0], ZSTD[-1]).levels == (-5, -1, 1, 2, 3, 6, 9)


def test_a_resumed_stream_finds_the_level_a_held_shard_was_compressed_at():
    data = b"".join(b"%d,%d,%.3f\n" % (n, n * 7, n / 3) for n in range(20_000))
    held = zstandard.ZstdCompressor(level=6).compress(data)
    fit = fit_from(1)
    fit.hold({0: content_hash(held)})
    codec = replace(get_codec("zstd", 1), fit=fit)
    assert codec.compress(data) == held and fit.used() == {6: 1}
    assert codec.compress(data) == zstandard.ZstdCompressor(level=1).compress(data)     # matched once only


def test_the_stream_id_and_shard_keys_do_not_depend_on_the_level(tmp_path):
    src = tiny_tree(tmp_path / "src", 300)
    one, three = prepare_source(src, "zstd", 1, 16 << 10), prepare_source(src, "zstd", 1, 16 << 10)
    one.tree.index.level = 1
    assert encode_skeleton(one.tree.index, one.plans)[1] == encode_skeleton(three.tree.index, three.plans)[1]
    assert [shard_key(one.tree.index, p) for p in one.plans] == [shard_key(three.tree.index, p) for p in three.plans]


def test_zstd_fast_levels_decode_and_zero_is_refused():
    assert get_codec("zstd", -5).level == -5
    with pytest.raises(UsageError):
        get_codec("zstd", 0)


def test_pack_keeps_its_fixed_default_level(tmp_path):
    src = tiny_tree(tmp_path / "src", 200)
    result = pack(src, tmp_path / "b.tar.zst", PackOptions())
    assert result.index.level == 3
    opened = Bundle.open(tmp_path / "b.tar.zst")
    os.close(opened.fd)
    assert opened.index is not None and opened.index.level == 3


# ---------------------------------------------------------------- real streams over ssh

def csv_tree(root: Path, count: int) -> str:
    for n in range(count):
        path = root / f"d{n % 20:02d}" / f"f{n:05d}.csv"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(b"".join(b"%d,%d,%d\n" % (n, i, (n * i) % 977) for i in range(60)))
    return str(root)


def ssh_flags(sshd) -> list[str]:
    return [f"--ssh-option={o}" for o in sshd.ssh_options]


def summary_of(done: subprocess.CompletedProcess) -> dict:
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_a_push_fits_its_level_and_says_so_and_a_pull_brings_it_back(sshd, tmp_path):
    src = csv_tree(tmp_path / "src", 3000)
    common = ["--json", "--quiet", "--strategy", "bundle", "--shard-size", str(32 << 10),
              "--remote-python", sys.executable, *ssh_flags(sshd)]
    pushed = summary_of(run_pallet("push", *common, src, sshd.url(str(tmp_path / "dest"))))
    assert pushed["route"] == "stream"
    levels = {int(level): shards for level, shards in pushed["shard_levels"].items()}
    assert set(levels) <= set(ZSTD) and sum(levels.values()) >= 10
    planned = run_pallet("plan", "--json", *ssh_flags(sshd), "--remote-python", sys.executable, src,
                         sshd.url(str(tmp_path / "elsewhere")))
    start = summary_of(planned)["details"]["level"]["level"]
    assert len(levels) > 1 or set(levels) == {start}, (levels, start)
    assert_same_tree(src, tmp_path / "dest")
    pulled = summary_of(run_pallet("pull", "--json", "--quiet", "--strategy", "bundle", "--remote-python",
                                   sys.executable, *ssh_flags(sshd), sshd.url(str(tmp_path / "dest")),
                                   str(tmp_path / "back")))
    assert pulled["route"] == "stream"
    assert_same_tree(src, tmp_path / "back")


def test_a_level_asked_for_is_every_shards(sshd, tmp_path):
    src = csv_tree(tmp_path / "src", 1000)
    pushed = summary_of(run_pallet("push", "--json", "--quiet", "--strategy", "bundle", "--level", "6",
                                   "--shard-size", str(32 << 10), "--remote-python", sys.executable,
                                   *ssh_flags(sshd), src, sshd.url(str(tmp_path / "dest"))))
    assert list(pushed["shard_levels"]) == ["6"]
    assert_same_tree(src, tmp_path / "dest")


class ScriptedFit(LevelFit):
    """A fit whose shards take the levels of a script in turn (an earlier stream whose level moved)."""

    def __init__(self, script: list[int]):
        super().__init__(level_range("zstd", script[0], ZSTD[0], ZSTD[-1]))
        self.script = list(script)

    def take(self) -> int:
        return self.script.pop(0) if self.script else super().take()


def test_a_resumed_stream_skips_shards_held_at_other_levels(sshd, tmp_path):
    """A stream whose shards went at several levels is cut short after its last shard; the rerun, fitted from
    the same start, finds each held shard's level and sends none of them again."""
    src = csv_tree(tmp_path / "src", 1200)
    source = prepare_source(src, "zstd", 1, 16 << 10)
    script = [1, 6, -1, 9, 2, -5] * 40
    fitted_source = at_level(source, 1, ScriptedFit(script), declared=True)
    out = io.BytesIO()
    send_stream(fitted_source, out, lambda stream_id: {}, NoProgress())
    dest = tmp_path / "dest"
    cut = subprocess.run([*python_module("mpi_stager"), "receive", "--json", str(dest)],
                         input=out.getvalue()[:-1], env=user_env(), capture_output=True)
    assert cut.returncode == 1 and (dest / ".pallet" / "INCOMPLETE").exists(), cut.stderr
    shards = len(fitted_source.plans)
    assert shards >= 8
    endpoint = parse_url(sshd.url(str(dest)))
    start = planned_level({"level": {"codec": "zstd", "level": 1, "low": ZSTD[0], "high": ZSTD[-1],
                                     "fixed": False, "why": ""}}, "zstd", None)
    with open_transport(endpoint, ssh_options=list(sshd.ssh_options)) as transport:
        again = stream_push(transport, src, endpoint, "zstd", options(sshd, shard_size=16 << 10, jobs=1),
                            NoProgress(), level=start)
    assert again.skipped_shards == shards and again.receiver.data_bytes == 0, again
    assert len(again.shard_levels) > 1
    assert_same_tree(src, dest)
    assert not os.path.exists(dest / ".pallet")


def test_an_index_that_records_a_fast_level_reads_back():
    """A stream fitted to a fast link may start at one of zstd's negative levels, and its index records it."""
    index = Index("zstd", -5, 1 << 20)
    assert Index.from_bytes(index.to_bytes()).level == -5
    with pytest.raises(CorruptBundleError):
        Index.from_bytes(Index("zstd", 1 << 20, 1 << 20).to_bytes())
