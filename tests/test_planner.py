"""Planner decisions on tables of cases: bundle many tiny files on slow links, individual for a few big files."""
from __future__ import annotations

import os
import sys
from dataclasses import replace

import pytest

from staging_core.planning.planner import DEFAULT_SPREAD, MIN_SPREAD, LinkProfile, TreeStats, plan, spread_of, typical

LOOPBACK = LinkProfile("loopback", rtt_s=0.0001, bandwidth=1e9, per_file_s=9e-5, create_rate=30_000, is_default=False)
WAN_40MS = LinkProfile("wan-40ms", rtt_s=0.04, bandwidth=100e6, per_file_s=2e-3, create_rate=30_000,
                       stream_cap=30e6, is_default=False)
GBIT_40MS = LinkProfile("gbit-40ms", rtt_s=0.04, bandwidth=125e6, per_file_s=1e-3, create_rate=30_000,
                        is_default=False)
W1 = TreeStats.from_sizes([1024] * 65_536)
W2 = TreeStats.from_sizes([256 << 20] * 4)
MIXED = TreeStats.from_sizes([1024] * 20_000 + [512 << 20] * 2)


@pytest.mark.parametrize("stats,profile,ratio,expected", [
    (W1, WAN_40MS, 0.3, "bundle"),
    (W1, GBIT_40MS, 0.3, "bundle"),
    (W1, LOOPBACK, 0.3, "bundle"),
    (W2, WAN_40MS, 1.0, "individual"),
    (W2, LOOPBACK, 1.0, "individual"),
    (MIXED, WAN_40MS, 1.0, "hybrid"),
    (TreeStats.from_sizes([4096] * 3), WAN_40MS, 0.5, "individual"),
])
def test_strategy_table(stats, profile, ratio, expected):
    result = plan(stats, profile, compress_ratio=ratio, ranks=2)
    assert result.strategy == expected, result.reason
    assert result.chosen.strategy == expected
    assert {c.strategy for c in result.candidates} >= {"individual"}


@pytest.mark.parametrize("stats,bandwidth,ratio,compress", [
    (W1, 100e6, 0.3, True),      # compression and decompression outrun 100 MB/s
    (W1, 10e9, 0.3, False),      # a 10 GB/s link outruns the compressor
    (W2, 100e6, 0.98, False),    # incompressible data in big files
    (W1, 100e6, 0.98, True),     # incompressible 1 KiB files: their tar headers (1.8 KiB each) compress
])
def test_compress_only_when_both_rates_outrun_the_link(stats, bandwidth, ratio, compress):
    profile = LinkProfile(bandwidth=bandwidth, per_file_s=1e-3, is_default=False)
    result = plan(stats, profile, compress_ratio=ratio)
    assert result.details["compress"] is compress
    assert (result.chosen.codec == "zstd") is compress


def test_no_unpack_route_leaves_individual_only():
    result = plan(W1, WAN_40MS, compress_ratio=0.3, bundle_possible=False)
    assert result.strategy == "individual" and [c.strategy for c in result.candidates] == ["individual"]


def test_plan_explains_itself_and_mentions_the_default_profile():
    result = plan(W1, LinkProfile(), compress_ratio=0.3)
    assert "per-file overhead" in result.reason and "default link profile" in result.reason
    doc = result.to_json()
    assert doc["strategy"] == "bundle" and all("predicted_seconds" in c for c in doc["candidates"])


def test_more_ranks_never_predict_a_slower_bundle():
    times = [plan(W1, LOOPBACK, 0.3, ranks).chosen.predicted_seconds for ranks in (1, 2, 4, 8)]
    assert times == sorted(times, reverse=True)


def test_pallet_plan_command(tmp_path):
    import json
    from tests.conftest import run_pallet
    src = tmp_path / "src"
    for n in range(300):
        (src / f"d{n % 3}").mkdir(parents=True, exist_ok=True)
        (src / f"d{n % 3}" / f"f{n}.csv").write_text(f"{n},{n * 2},{n * 3}\n" * 20)
    done = run_pallet("plan", "--json", str(src), "ssh://127.0.0.1:1/scratch/data", check=True)   # nothing listens
    doc = json.loads(done.stdout)
    assert doc["far_side"] is None and "not probed" in done.stderr and "127.0.0.1" in done.stderr
    assert doc["strategy"] in ("individual", "bundle", "hybrid")
    assert {c["strategy"] for c in doc["candidates"]} >= {"individual", "bundle"}
    assert doc["histogram"]["<4KiB"] == 300 and doc["details"]["compress_ratio"] < 0.5
    assert run_pallet("plan", str(src), "nope://x/y").returncode == 2


def test_calibrate_over_ssh_stores_a_profile_that_plan_uses(sshd, tmp_path, monkeypatch):
    import json
    from tests.conftest import run_pallet
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "config"))
    options = [f"--ssh-option={o}" for o in sshd.ssh_options]
    done = run_pallet("calibrate", "--json", "--name", "loop", "--remote-python", sys.executable, *options,
                      sshd.url(str(tmp_path / "remote")), check=True)
    measured = json.loads(done.stdout)
    assert measured["rtt_s"] > 0 and measured["bandwidth"] > 1e6 and measured["per_file_s"] >= 0
    assert measured["create_rate_measured"] is True and measured["create_rate"] > 0
    assert measured["create_rate"] != LinkProfile().create_rate and measured["pack_per_file_s"] > 0
    assert (tmp_path / "config" / "pallet" / "profiles" / "loop.toml").exists()
    assert list((tmp_path / "remote").iterdir()) == []          # scratch removed
    src = tmp_path / "src"
    src.mkdir()
    (src / "a.txt").write_text("a")
    planned = json.loads(run_pallet("plan", "--json", "--profile", "loop", str(src), "/tmp/x", check=True).stdout)
    assert planned["details"]["profile"] == "loop" and planned["details"]["default_profile"] is False
    missing = run_pallet("plan", "--profile", "nope", str(src), "/tmp/x")
    assert missing.returncode == 2 and "pallet calibrate --name nope" in missing.stderr


def test_every_candidate_is_a_range_from_the_profiles_spread():
    profile = replace(LOOPBACK, spread_low=0.7, spread_high=1.5)
    for candidate in plan(W1, profile, 0.3).candidates:
        assert candidate.low_seconds == pytest.approx(candidate.predicted_seconds * 0.7)
        assert candidate.high_seconds == pytest.approx(candidate.predicted_seconds * 1.5)
    assert plan(W1, LinkProfile(), 0.3).details["spread"] == list(DEFAULT_SPREAD)


def test_spread_of_repeated_measurements_is_a_prediction_interval_at_least_the_floor():
    assert spread_of([1.0, 1.0, 1.0]) == MIN_SPREAD                   # steady samples: the floor
    low, high = spread_of([1.0, 2.0, 4.0])
    assert low < 0.25 and high > 4                                     # three scattered samples: wide
    few, many = spread_of([1.0, 1.5]), spread_of([1.0, 1.5] * 5)
    assert few[1] > many[1] and few[0] < many[0]                       # more samples, a narrower range
    assert typical([1.0, 4.0]) == pytest.approx(2.0)
    assert spread_of([1.0]) == MIN_SPREAD


def test_a_plan_after_comparing_dest_says_what_is_left():
    nothing = plan(TreeStats(0, 0), LOOPBACK, in_place=400)
    assert nothing.reason.startswith("no file to send: DEST holds all 400 files")
    assert nothing.chosen.predicted_seconds == 0
    assert nothing.details["in_place"] == 400 and nothing.details["incremental"] is True
    some = plan(TreeStats.from_sizes([1024] * 3), LOOPBACK, in_place=397)
    assert some.reason.startswith("incremental: 3 of 400 files differ from DEST (397 already in place)")
    assert "incremental" not in plan(W1, LOOPBACK).details


def test_a_profile_keeps_its_spread_and_samples_through_toml(tmp_path, monkeypatch):
    from staging_core.planning.profiles import load_profile, save_profile
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path))
    saved = replace(LOOPBACK, spread_low=0.6, spread_high=2.5, per_file_samples=(1e-4, 2e-4), observed=2)
    save_profile(saved)
    assert load_profile("loopback") == saved


def test_observed_copies_replace_the_first_measurement_and_set_the_range(tmp_path, monkeypatch):
    from staging_core.planning.local_profile import FIRST_SPREAD, SAMPLE_WINDOW, observe
    from staging_core.planning.profiles import load_profile, save_profile
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "config"))
    name = f"local-{os.stat(tmp_path).st_dev}"
    save_profile(replace(LinkProfile(), name=name, rtt_s=0.0, bandwidth=1e12, per_file_s=1e-3,
                         per_file_samples=(1e-3, 1e-3, 1e-3), is_default=False))
    observe(str(tmp_path), 10_000, 0, 1.0)                              # 1e-4 s per file: 10x the sample's
    first = load_profile(name)
    assert first.per_file_samples == pytest.approx((1e-4,)) and first.observed == 1
    assert (first.spread_low, first.spread_high) == FIRST_SPREAD
    for seconds in (1.1, 0.9, 1.0) * 5:
        observe(str(tmp_path), 10_000, 0, seconds)
    steady = load_profile(name)
    assert len(steady.per_file_samples) == SAMPLE_WINDOW and steady.per_file_s == pytest.approx(1e-4, rel=0.1)
    assert (steady.spread_low, steady.spread_high) == MIN_SPREAD
