"""`pallet demo`: build a tree of tiny files, pack, unpack, push it through the planner, verify, summarise."""
from __future__ import annotations

import json
import os
import random
import shutil
import tempfile
import time

from bundles import Bundle, PackOptions, UnpackOptions, pack, unpack, verify_bundle, verify_tree

from staging_core.cli.display import human_bytes, make_progress, seconds_range
from staging_core.operations.push_pull import push
from staging_core.options import StagingOptions

DEFAULT_FILES = 20_000


def add_parser(commands) -> None:
    p = commands.add_parser("demo", help="run the whole job on a generated tree (no cluster needed)",
                            description="Generate a tree of tiny CSV-like files, pack it into a bundle, "
                                        "unpack it into a second directory, push it to a third through the "
                                        "planner (pallet push), verify all and print a summary.")
    p.add_argument("--files", type=int, default=DEFAULT_FILES, help=f"files to generate (default {DEFAULT_FILES})")
    p.add_argument("--workdir", help="where to work (default: a temporary directory, removed afterwards)")
    p.add_argument("--keep", action="store_true", help="keep the generated tree, bundle and copy")
    p.add_argument("--jobs", "-j", type=int, default=0, metavar="N", help="worker processes (default: all CPUs)")
    p.add_argument("--json", action="store_true", help="print the summary as JSON")
    p.set_defaults(run=run)


def make_tree(root: str, files: int, seed: int = 1) -> int:
    """Write ``files`` small CSV-like files into ``root`` spread over 256 directories; return bytes."""
    rng = random.Random(seed)
    total = 0
    for n in range(files):
        directory = os.path.join(root, f"d{n % 256:03d}")
        if n < 256:
            os.makedirs(directory, exist_ok=True)
        rows = "".join(f"{n},{r},{rng.random():.6f},{rng.randint(0, 10**6)}\n" for r in range(rng.randint(10, 40)))
        with open(os.path.join(directory, f"sample_{n:06d}.csv"), "w") as handle:
            handle.write(rows)
        total += len(rows)
    return total


def run(args) -> int:
    workdir = args.workdir or tempfile.mkdtemp(prefix="pallet-demo-")
    os.makedirs(workdir, exist_ok=True)
    src, dest = os.path.join(workdir, "source"), os.path.join(workdir, "copy")
    bundle_path = os.path.join(workdir, "demo.tar.zst")
    for path in (src, dest):
        shutil.rmtree(path, ignore_errors=True)
    try:
        timings = {}
        started = time.monotonic()
        os.makedirs(src)
        data_bytes = make_tree(src, args.files)
        timings["generate"] = time.monotonic() - started
        packed = pack(src, bundle_path, PackOptions(jobs=args.jobs), make_progress())
        timings["pack"] = packed.seconds
        unpacked = unpack(bundle_path, dest, UnpackOptions(jobs=args.jobs), make_progress())
        timings["unpack"] = unpacked.seconds
        pushed = push(src, os.path.join(workdir, "pushed"), StagingOptions(jobs=args.jobs))
        timings["push"] = pushed.seconds
        started = time.monotonic()
        with Bundle.open(bundle_path) as bundle:
            problems = verify_bundle(bundle, args.jobs).problems + verify_tree(bundle.index, dest).problems
            problems += verify_tree(bundle.index, os.path.join(workdir, "pushed")).problems
        timings["verify"] = time.monotonic() - started
        summary = {"workdir": workdir, "files": args.files, "data_bytes": data_bytes,
                   "bundle_bytes": packed.bundle_bytes, "shards": len(packed.index.shards),
                   "seconds": {k: round(v, 3) for k, v in timings.items()}, "problems": problems,
                   "push": {"strategy": pushed.strategy, "reason": pushed.plan.reason,
                            "predicted_range": pushed.to_json()["predicted_range"]}}
        _print_summary(summary, args.json)
        return 0 if not problems else 1
    finally:
        if not (args.keep or args.workdir):
            shutil.rmtree(workdir, ignore_errors=True)


def _print_summary(summary: dict, as_json: bool) -> None:
    if as_json:
        print(json.dumps(summary))
        return
    t = summary["seconds"]
    ratio = summary["data_bytes"] / max(1, summary["bundle_bytes"])
    print(f"pallet demo: {summary['files']} files, {human_bytes(summary['data_bytes'])} of data")
    print(f"  generate  {t['generate']:7.2f} s")
    print(f"  pack      {t['pack']:7.2f} s  -> {human_bytes(summary['bundle_bytes'])} in {summary['shards']} "
          f"shard(s), {ratio:.1f}x smaller")
    print(f"  unpack    {t['unpack']:7.2f} s  ({summary['files'] / max(t['unpack'], 1e-9):,.0f} files/s, "
          "every file verified)")
    predicted = summary["push"]["predicted_range"]
    expected = f"predicted {seconds_range(*predicted)}; " if predicted else ""
    print(f"  push      {t['push']:7.2f} s  ({expected}planned: {summary['push']['strategy']}; "
          f"{summary['push']['reason']})")
    print(f"  verify    {t['verify']:7.2f} s  (bundle and both copies checked against the index)")
    if summary["problems"]:
        print(f"  PROBLEMS: {len(summary['problems'])}")
        for problem in summary["problems"][:20]:
            print(f"    - {problem}")
    else:
        print("  result: the copy is identical to the source")
