"""Time to the first shard byte of `pallet push` on an emulated WAN: from pallet's start until the far side reads a
shard frame (first_frame_probe.py stands in for its Python and notes the moment), against 0.3 s + one round trip
and against the hand-made stream's first byte at the far side, measured in the same run."""
from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import time
from contextlib import ExitStack
from pathlib import Path

from bench_bundle import pallet_cmd
from push_methods import check_destination, manifest, start_rig, stream_peer
from push_report import Target, print_targets
from wan import NS_IP, LinkSpec, ping_rtt_ms
from workloads import KIB, Workload, ensure_workload, wan_w1_args, wan_w1_parser

PROBE = Path(__file__).with_name("first_frame_probe.py")
BUDGET_S = 0.3                     # the bound: 0.3 s + one round trip


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    return wan_w1_args(wan_w1_parser(__doc__.splitlines()[0]), argv)


def first_byte(rig, src: Path, dest: Path, log: Path) -> tuple[float, float, dict]:
    """One push of ``src``: seconds to the far side's first shard frame, seconds in all, and its summary."""
    far_python = f"{sys.executable} {PROBE} {log} {sys.executable}"
    argv = [*pallet_cmd(), "push", "--quiet", "--json", "--remote-python", far_python, str(src),
            rig.sshd.url(str(dest))]
    started = time.time()
    done = subprocess.run(argv, env=rig.pallet_env(), capture_output=True, text=True, stdin=subprocess.DEVNULL)
    total = time.time() - started
    if done.returncode != 0 or not log.exists():
        raise SystemExit(f"pallet push failed ({done.returncode}):\n{done.stderr[-2000:]}")
    return float(log.read_text()) - started, total, json.loads(done.stdout.strip().splitlines()[-1])


def peer_first_byte(rig, src: Path, dest: Path, log: Path) -> tuple[float, float]:
    """One hand-made stream of ``src``: seconds to the far side's first byte, and seconds in all."""
    started = time.time()
    total = stream_peer(rig, [sys.executable, str(PROBE), "--bytes", str(log)])(src, dest).seconds
    return float(log.read_text()) - started, total


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))       # so that the link is torn down
    args.workdir.mkdir(parents=True, exist_ok=True)
    src = ensure_workload(args.workdir, Workload("W1", args.files, KIB, max(1, min(256, args.files // 256)), False))
    expected, work = manifest(src), args.workdir / f"first-byte-{os.getpid()}"
    work.mkdir()
    firsts: list[float] = []
    peers: list[float] = []
    try:
        with ExitStack() as stack:
            _, rig = start_rig(stack, work, LinkSpec(args.rtt_ms, args.rate), args.dest_root, sys.executable,
                               gridftp=False)
            rtt_s = ping_rtt_ms(NS_IP) / 1000
            for rep in range(args.repeat):
                for which in (("pallet", "peer") if rep % 2 == 0 else ("peer", "pallet")):
                    dest = rig.fresh_dest(f"first-{which}")
                    if which == "pallet":
                        first, total, summary = first_byte(rig, src, dest, work / f"first-{rep}")
                        firsts.append(first)
                        what = f"first shard frame at the far side {first:6.2f} s, push {total:6.2f} s " \
                               f"({summary['route']})"
                    else:
                        first, total = peer_first_byte(rig, src, dest, work / f"peer-{rep}")
                        peers.append(first)
                        what = f"hand-made stream's first byte there {first:6.2f} s, stream {total:6.2f} s"
                    if problem := check_destination(expected, dest):
                        raise SystemExit(problem)
                    print(f"    [{rep + 1}/{args.repeat}] {what}", flush=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    median, peer = statistics.median(firsts), statistics.median(peers)
    print(f"\nW1 {args.files:,} x 1 KiB, {args.rtt_ms:g} ms (ping {rtt_s * 1000:.1f} ms), {args.rate}: time to the "
          f"first shard frame, median of {args.repeat}: {median:.2f} s; the hand-made stream's first byte "
          f"{peer:.2f} s (pallet/stream {median / peer:.2f})")
    target = Target(f"time to first shard byte, s (bound {BUDGET_S} s + one round trip)", median,
                    round(BUDGET_S + rtt_s, 3))
    print_targets([target])
    if args.json:
        Path(args.json).write_text(json.dumps({"files": args.files, "rtt_ms": args.rtt_ms, "ping_ms": rtt_s * 1000,
                                               "first_frame_s": firsts, "peer_first_byte_s": peers,
                                               "target": target.to_json()}, indent=2))
    return 0 if median <= BUDGET_S + rtt_s else 1


if __name__ == "__main__":
    sys.exit(main())
