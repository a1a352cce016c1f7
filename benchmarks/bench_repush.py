"""Benchmark a re-push after a few changes on an emulated WAN: `pallet push` against `rsync -a` doing the same update.

Both destinations first receive the whole tree (untimed). Then, for each
repetition, CHANGES files of the source are rewritten (same size, new
mtime) and each method brings its destination up to date, alternating
which goes first; both destinations are checked against the source.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
from contextlib import ExitStack
from pathlib import Path

from push_methods import Method, MethodSpec, manifest, pallet_push, rsync_peer, run_once, start_rig
from push_report import Target, print_methods, print_targets, ratio
from wan import LinkSpec
from workloads import KIB, Workload, ensure_workload, wan_w1_args, wan_w1_parser

PALLET, RSYNC = "pallet push (auto), rerun", "rsync -a over ssh, rerun"
TARGET = 0.5            # pallet / rsync -a, re-push of W1 after 10 changes


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = wan_w1_parser(__doc__.splitlines()[0])
    parser.add_argument("--changes", type=int, default=10, help="files rewritten before each rerun (default 10)")
    return wan_w1_args(parser, argv)


def change_files(src: Path, files: list[Path], round_number: int) -> None:
    """Rewrite ``files`` under ``src`` with other bytes of the same size and a new mtime."""
    for path in files:
        data = bytearray(path.read_bytes())
        data[:8] = round_number.to_bytes(8, "little")
        path.write_bytes(bytes(data))
        os.utime(path, (1_900_000_000 + round_number, 1_900_000_000 + round_number))


def run(args: argparse.Namespace, work: Path) -> list[Method]:
    """Copy W1 (the copy is changed, never the shared tree), seed both destinations, then measure the reruns."""
    original = ensure_workload(args.workdir, Workload("W1", args.files, KIB, max(1, min(256, args.files // 256)),
                                                      False))
    src = work / "src"
    subprocess.run(["cp", "-a", f"{original}/.", str(src)], check=True)
    names = sorted(p for p in src.rglob("*") if p.is_file())
    with ExitStack() as stack:
        _, rig = start_rig(stack, work, LinkSpec(args.rtt_ms, args.rate), args.dest_root, sys.executable,
                           gridftp=False)
        dests = {PALLET: rig.dest_root / "pallet", RSYNC: rig.dest_root / "rsync"}
        specs = [MethodSpec(PALLET, "pallet", pallet_push(rig), {}), MethodSpec(RSYNC, "rsync", rsync_peer(rig), {})]
        for spec in specs:                                  # the first, whole-tree copy: untimed
            spec.run(src, dests[spec.name])
        methods = {spec.name: Method(spec.name) for spec in specs}
        for rep in range(args.repeat):
            change_files(src, names[rep * args.changes:(rep + 1) * args.changes], rep + 1)
            expected = manifest(src)
            for spec in specs if rep % 2 == 0 else reversed(specs):
                attempt = run_once(MethodSpec(spec.name, spec.slug, spec.run, expected), src, dests[spec.name])
                methods[spec.name].attempts.append(attempt)
                moved = (attempt.summary or {}).get("files")
                shown = f"{attempt.seconds:8.2f} s" if attempt.seconds is not None else f"FAILED {attempt.error}"
                print(f"    [{rep + 1}/{args.repeat}] {spec.name:32s} {shown}"
                      + (f"  ({moved} file(s) sent)" if moved is not None else ""), flush=True)
    return list(methods.values())


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))       # so that the link is torn down
    args.workdir.mkdir(parents=True, exist_ok=True)
    work = args.workdir / f"repush-{os.getpid()}"
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir()
    try:
        methods = run(args, work)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    by_name = {m.name: m for m in methods}
    print_methods(f"W1 {args.files:,} x 1 KiB, {args.changes} files changed before each rerun, "
                  f"{args.rtt_ms:g} ms, {args.rate} (medians of {args.repeat})", methods)
    target = Target(f"re-push after {args.changes} changes: pallet / rsync -a", ratio(by_name[PALLET], by_name[RSYNC]),
                    TARGET)
    print_targets([target])
    if args.json:
        Path(args.json).write_text(json.dumps({"files": args.files, "changes": args.changes, "rtt_ms": args.rtt_ms,
                                               "methods": {m.name: m.to_json() for m in methods},
                                               "target": target.to_json()}, indent=2))
    return 1 if any(m.errors for m in methods) else 0


if __name__ == "__main__":
    sys.exit(main())
