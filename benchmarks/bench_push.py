"""Benchmark `pallet push` and `pallet pull` on an emulated WAN against tar|zstd|ssh, rsync -a, scp and
globus-url-copy."""
from __future__ import annotations

import argparse
import json
import signal
import sys
import tempfile
from contextlib import ExitStack
from dataclasses import asdict, dataclass
from pathlib import Path

from bench_bundle import code_version
from push_grid import GridCase, Tree, run_grid, score
from push_methods import (Manifest, Method, MethodSpec, Rig, gridftp_peer, manifest, measure, pallet_pull, pallet_push,
                          rsync_peer, sample_of, scp_sample, start_rig, stream_peer, stream_pull_peer,
                          verified_stream_peer)
from push_report import Target, print_grid, print_methods, print_targets, ratio, write_chart
from wan import LinkCheck, LinkSpec, WanLink
from workloads import KIB, MIB, MixedWorkload, Workload, common_parser, ensure_workload

PALLET_AUTO, STREAM, RSYNC = "pallet push (auto)", "tar | zstd | ssh | zstd -d | tar x", "rsync -a over ssh"
PALLET_GRIDFTP, GRIDFTP_PEER, SCP = "pallet push bundle over GridFTP", "globus-url-copy -r -pp -cc 16", "scp"
PALLET_TAR_TOOLS = "pallet push bundle, far side without pallet (tar tools)"
VERIFIED_FLOOR = "the same stream, md5sum -c there (verified floor)"
PALLET_PULL, STREAM_PULL, RSYNC_PULL = "pallet pull (auto)", "ssh 'tar | zstd' | zstd -d | tar x", "rsync -a pull"


@dataclass(frozen=True)
class Headline:
    """The headline comparisons: W1 and W2 (labels, method results) and the link they ran on."""

    check: LinkCheck
    w1_label: str
    w1: list[Method]
    w2_label: str
    w2: list[Method]


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = common_parser(__doc__, "smoke run, 1 repetition: W1 1,000 files, W2 4 x 4 MiB, mixed 1,000 x 1 KiB "
                                    "+ 1 x 64 MiB, a 20-file scp sample")
    parser.add_argument("--rtt-ms", type=float, default=40.0, help="round trip added by the link (default 40)")
    parser.add_argument("--only", type=lambda text: text.split(","), metavar="SLUG[,SLUG...]",
                        help="run just these W1 methods, and no W2: stream, verified-stream, pallet-auto, "
                             "pallet-tar-tools, rsync, pallet-gridftp, guc, scp, pallet-pull, stream-pull, "
                             "rsync-pull")
    parser.add_argument("--dest-root", type=Path, help="where the far side writes (default: under --workdir; a tmpfs "
                                                       "such as /dev/shm takes a noisy disk out of the ratios)")
    parser.add_argument("--rate", default="1gbit", help="tbf rate cap of the headline link (default 1gbit)")
    parser.add_argument("--files", type=int, help="W1 file count (default 65,536; 1,000 with --quick)")
    parser.add_argument("--scp-sample", type=int, help="files copied one scp each (default 200; 20 with --quick)")
    parser.add_argument("--chart", metavar="FILE.png", help="write a PNG chart of the results")
    parser.add_argument("--grid", action=argparse.BooleanOptionalAction, default=True,
                        help="run the planner accuracy grid (default: on)")
    parser.add_argument("--headline", action=argparse.BooleanOptionalAction, default=True,
                        help="run the headline comparisons (default: on; --no-headline --grid runs the grid alone)")
    parser.add_argument("--remote-python", default=sys.executable,
                        help="the Python pallet runs in the namespace (default: this one)")
    args = parser.parse_args(argv)
    if args.quick:
        args.repeat = 1
    args.files = args.files or (1_000 if args.quick else 65_536)
    args.scp_sample = args.scp_sample or (20 if args.quick else 200)
    return args


def trees(workdir: Path, args: argparse.Namespace) -> dict[str, Tree]:
    """W1 (CSV, 256 files per directory), W2 (4 random files) and, for the grid, a mixed tree; generated once
    and reused."""
    w1 = Workload("W1", args.files, KIB, max(1, min(256, args.files // 256)), False)
    w2 = Workload("W2", 4, (4 if args.quick else 256) * MIB, 1, True)
    small = Workload("small", 1_000 if args.quick else 16_384, KIB, 4 if args.quick else 64, False)
    large = Workload("large", 1 if args.quick else 2, (64 if args.quick else 128) * MIB, 1, True)
    loads = {"W1": w1, "W2": w2, **({"mixed": MixedWorkload("Mixed", small, large)} if args.grid else {})}
    found = {}
    for key, load in loads.items():
        path = ensure_workload(workdir, load)
        found[key] = Tree(load.label, path, manifest(path), key == "mixed")
    return found


def compare(rig: Rig, src: Path, specs: list[MethodSpec], repeat: int) -> list[Method]:
    """:func:`measure` the methods, then delete what they wrote."""
    methods = measure(rig, src, specs, repeat)
    rig.clear_destinations()
    return methods


def w1_specs(rig: Rig, expected: Manifest, sample: int, only: list[str] | None = None) -> list[MethodSpec]:
    """The W1 methods (``only``: just those slugs)."""
    picked = sample_of(expected, sample)
    specs = [MethodSpec(PALLET_AUTO, "pallet-auto", pallet_push(rig), expected),
            MethodSpec(PALLET_TAR_TOOLS, "pallet-tar-tools", pallet_push(rig, "bundle", tar_tools=True), expected),
            MethodSpec(STREAM, "stream", stream_peer(rig), expected),
            MethodSpec(VERIFIED_FLOOR, "verified-stream", verified_stream_peer(rig), expected),
            MethodSpec(RSYNC, "rsync", rsync_peer(rig), expected),
            MethodSpec(PALLET_GRIDFTP, "pallet-gridftp", pallet_push(rig, "bundle", gridftp=True), expected),
            MethodSpec(GRIDFTP_PEER, "guc", gridftp_peer(rig, 16), expected),
            MethodSpec(f"{SCP} per file ({len(picked)}-file sample, extrapolated)", "scp", scp_sample(rig, picked),
                       {p: expected[p] for p in picked}, len(expected) / len(picked)),
            MethodSpec(PALLET_PULL, "pallet-pull", pallet_pull(rig), expected),
            MethodSpec(STREAM_PULL, "stream-pull", stream_pull_peer(rig), expected),
            MethodSpec(RSYNC_PULL, "rsync-pull", rsync_peer(rig, pull=True), expected)]
    return [spec for spec in specs if only is None or spec.slug in only]


def headline(link: WanLink, rig: Rig, found: dict[str, Tree], args: argparse.Namespace) -> Headline:
    link.apply(LinkSpec(args.rtt_ms, args.rate))
    check = link.checked()
    print(f"\n== headline link {check.spec.label}: ping -U {check.ping_ms:.1f} ms, one TCP stream "
          f"{check.stream_mbit:.0f} Mbit/s", flush=True)
    w1, w2 = found["W1"], found["W2"]
    print(f"-- {w1.label}")
    w1_methods = compare(rig, w1.path, w1_specs(rig, w1.expected, args.scp_sample, args.only), args.repeat)
    w2_methods = []
    if args.only is None:
        print(f"-- {w2.label}")
        w2_methods = compare(rig, w2.path, [MethodSpec(PALLET_AUTO, "pallet-auto", pallet_push(rig), w2.expected),
                                            MethodSpec(RSYNC, "rsync", rsync_peer(rig), w2.expected)], args.repeat)
    return Headline(check, w1.label, w1_methods, w2.label, w2_methods)


def targets(result: Headline) -> list[Target]:
    w1, w2 = ({m.name: m for m in methods} for methods in (result.w1, result.w2))
    if not w2:                              # --only: the ratios its methods allow
        pushes = [Target(f"W1 {name} / tar|zstd|ssh stream", ratio(w1[name], w1[STREAM]), goal)
                  for name, goal in ((PALLET_AUTO, 1.0), (PALLET_TAR_TOOLS, 1.2), (VERIFIED_FLOOR, None),
                                     (RSYNC, None))
                  if name in w1 and STREAM in w1]
        if PALLET_TAR_TOOLS in w1 and VERIFIED_FLOOR in w1:        # issue 37: the route at its verified floor
            pushes.append(Target(f"W1 {PALLET_TAR_TOOLS} / {VERIFIED_FLOOR}",
                                 ratio(w1[PALLET_TAR_TOOLS], w1[VERIFIED_FLOOR]), 1.15))
        return pushes + [Target(f"W1 {name} / reverse stream (ssh tar|zstd)", ratio(w1[name], w1[STREAM_PULL]), goal)
                         for name, goal in ((PALLET_PULL, 1.0), (RSYNC_PULL, None))
                         if name in w1 and STREAM_PULL in w1]
    scp = next(m for name, m in w1.items() if name.startswith(SCP))
    w2_strategies = sorted({a.summary.get("strategy", "?") for a in w2[PALLET_AUTO].attempts if a.summary})
    w2_individual = [a.summary.get("strategy") == "individual" for a in w2[PALLET_AUTO].attempts]
    pallet_ok = [a.seconds is not None
                 for m in (w1[PALLET_AUTO], w1[PALLET_TAR_TOOLS], w1[PALLET_GRIDFTP], w2[PALLET_AUTO])
                 for a in m.attempts]
    routes = sorted({f"{a.summary.get('strategy')} ({a.summary.get('route')})" for a in w1[PALLET_AUTO].attempts
                     if a.summary})
    tar_tools_routes = sorted({str(a.summary.get("route")) for a in w1[PALLET_TAR_TOOLS].attempts if a.summary})
    return [
        Target("W1 pallet push (auto) / tar|zstd|ssh stream", ratio(w1[PALLET_AUTO], w1[STREAM]), 1.0,
               note=", ".join(routes)),
        Target("W1 pallet push (auto) / rsync -a", ratio(w1[PALLET_AUTO], w1[RSYNC]), 0.8),
        Target("W1 tar-tools route (verified) / tar|zstd|ssh stream", ratio(w1[PALLET_TAR_TOOLS], w1[STREAM]), 1.2,
               note=", ".join(tar_tools_routes)),
        Target("W1 globus-url-copy -r -pp -cc 16 / pallet bundle over GridFTP",
               ratio(w1[GRIDFTP_PEER], w1[PALLET_GRIDFTP]), 10.0, at_least=True),
        Target("W2 pallet push (auto) / rsync -a", ratio(w2[PALLET_AUTO], w2[RSYNC]), 1.1),
        Target("W2 runs in which auto ran individual, share", _share(w2_individual), 1.0, at_least=True,
               note="ran: " + (", ".join(w2_strategies) or "nothing")),
        Target("pallet runs that completed and checked out, share", _share(pallet_ok), 1.0, at_least=True),
        Target("W1 pallet pull (auto) / reverse stream (ssh tar|zstd)", ratio(w1[PALLET_PULL], w1[STREAM_PULL]), 1.0),
        Target("W1 scp per file (extrapolated) / pallet push (auto)", ratio(scp, w1[PALLET_AUTO]), None,
               note="for scale")]


def _share(flags: list[bool]) -> float | None:
    return sum(flags) / len(flags) if flags else None


def write_json(path: str, args: argparse.Namespace, result: Headline | None, goals: list[Target],
               cases: list[GridCase]) -> None:
    doc = {"commit": code_version(), "args": {k: str(v) for k, v in vars(args).items()},
           "headline": None if result is None else {
               "link": asdict(result.check), "w1": {m.name: m.to_json() for m in result.w1},
               "w2": {m.name: m.to_json() for m in result.w2}, "targets": [t.to_json() for t in goals]},
           "grid": {"cases": [c.to_json() for c in cases],
                    "scores": [asdict(score(cases, w)) for w in ("calibrated", "default")] if cases else []}}
    Path(path).write_text(json.dumps(doc, indent=2))
    print(f"raw numbers written to {path}")


def run(args: argparse.Namespace, work: Path) -> tuple[Headline | None, list[GridCase]]:
    """Set up the link and the servers in the namespace, measure, and tear everything down."""
    found = trees(args.workdir, args)
    with ExitStack() as stack:
        link, rig = start_rig(stack, work, LinkSpec(args.rtt_ms, args.rate), args.dest_root, args.remote_python)
        result = headline(link, rig, found, args) if args.headline else None
        cases = run_grid(link, rig, [found[k] for k in ("W1", "W2", "mixed")], args.rtt_ms, args.repeat) \
            if args.grid else []
        rig.clear_destinations()
    return result, cases


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))       # so that the link is torn down
    args.workdir.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="push-", dir=args.workdir))
    result, cases = run(args, work)
    goals = targets(result) if result else []
    if result:
        print_methods(f"{result.w1_label} at {result.check.spec.label} (medians of {args.repeat})", result.w1)
        if result.w2:
            print_methods(f"{result.w2_label} at {result.check.spec.label} (medians of {args.repeat})", result.w2)
        print_targets(goals)
    if cases:
        print_grid(cases, [score(cases, w) for w in ("calibrated", "default")])
    if args.json:
        write_json(args.json, args, result, goals, cases)
    if args.chart:
        headline = ((result.w1_label, result.w1), (result.w2_label, result.w2)) if result else None
        link = f" ({result.check.spec.label})" if result else ""
        write_chart(args.chart, headline, cases, f"pallet push over an emulated WAN{link}, commit {code_version()}")
    print(f"keys, profiles and server logs of this run are in {work}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
