"""push and pull --dry-run: compare with the destination and plan, then report what would change, changing nothing."""
from __future__ import annotations

import os
import time

from bundles.errors import UsageError
from bundles.scan import SourceTree
from bundles.tarformat import Kind

from staging_core.operations.repair import (Comparison, PullComparison, compare_with_dest, compare_with_local, dest_md5,
                                            lists_exactly)
from staging_core.options import StagingOptions
from staging_core.results import StagingResult
from staging_core.planning.inventory import Inventory
from staging_core.planning.local_profile import route_profile
from staging_core.planning.planner import plan
from staging_core.transports.base import Endpoint, RemoteEntry
from staging_core.transports.registry import open_endpoint


def push_dry_run(tree: SourceTree, endpoint: Endpoint, options: StagingOptions, started: float) -> StagingResult:
    """push --dry-run: what would be sent (and deleted with --delete); nothing is locked, made or changed."""
    with open_endpoint(endpoint, options) as transport:
        comparison = compare_with_dest(transport, endpoint, tree, options.checksum)
    if comparison is None:
        comparison = Comparison(to_send=list(tree.index.paths))
    index = tree.index
    sending = set(comparison.to_send)
    files = [i for i, path in enumerate(index.paths) if path in sending and index.kinds[i] == Kind.FILE]
    inventory = Inventory(os.fsdecode(tree.root), [index.sizes[i] for i in files], options.large_file_bytes)
    shown = [os.fsdecode(p) for p in comparison.to_send] + [os.fsdecode(index.paths[i]) + "/"
                                                             for i in comparison.dirs_to_fix]
    return _result(endpoint, endpoint.url(), inventory, len(files), comparison.in_place, shown,
                   [os.fsdecode(p) for p in comparison.extra], options, started)


def planned_files(tree: SourceTree, comparison: Comparison | None, large_file_bytes: int
                  ) -> tuple[Inventory, list[bytes]]:
    """The inventory and paths of the regular files of ``tree`` a push sends: those ``comparison`` (DEST
    compared with the tree as push compares it) found differing, or all when DEST was not compared."""
    index = tree.index
    sending = None if comparison is None else set(comparison.to_send)
    files = [i for i, kind in enumerate(index.kinds) if kind == Kind.FILE
             and (sending is None or index.paths[i] in sending)]
    return (Inventory(os.fsdecode(tree.root), [index.sizes[i] for i in files], large_file_bytes),
            [index.paths[i] for i in files])


def pull_dry_run(endpoint: Endpoint, dest: str, options: StagingOptions, started: float) -> StagingResult:
    """pull --dry-run from a source whose listing is exact (its transport declares ``exact_listing``: ssh and
    local sources): what would be fetched into ``dest`` (and deleted there with --delete), from one listing of
    the source; nothing is locked, made or changed, here or there."""
    if not lists_exactly(endpoint):
        raise UsageError(f"pull --dry-run compares listings of ssh and local sources, not {endpoint.scheme}://",
                         endpoint.url(), "run it without --dry-run, or against an ssh URL of the same files")
    with open_endpoint(endpoint, options) as transport:
        listed = transport.list(endpoint.path)
        hashes = (lambda paths: dest_md5(transport, endpoint, paths)) if options.checksum else None
        comparison = compare_with_local(listed, dest, hashes, dry_run=True) if os.path.isdir(dest) else None
    if comparison is None:
        comparison = _everything(listed)
    inventory = Inventory(endpoint.path, list(comparison.sizes), options.large_file_bytes)
    shown = list(comparison.to_fetch) + [entry.path + "/" for entry in comparison.dirs_to_fix]
    return _result(endpoint, dest, inventory, len(inventory.sizes), comparison.in_place, shown,
                   [os.fsdecode(p) for p in comparison.extra], options, started)


def _everything(listed: list[RemoteEntry]) -> PullComparison:
    """What a pull into an empty or missing DEST fetches: every entry of the listing."""
    found = PullComparison()
    for entry in listed:
        if entry.kind == "d":
            found.dirs_to_fix.append(entry)
        else:
            found.to_fetch.append(entry.path)
            found.sizes.append(entry.size if entry.kind == "f" else 0)
    return found


def _result(endpoint: Endpoint, dest: str, inventory: Inventory, files: int, in_place: int, shown: list[str],
            extra: list[str], options: StagingOptions, started: float) -> StagingResult:
    """The dry run's summary, counted as a run's: ``files`` it would send, ``in_place`` it found; its route is
    'already in place' when it would change nothing, else 'dry run' (it changed nothing, but DEST differs)."""
    profile, bundle_possible = route_profile(endpoint, options, True, measure=False)
    chosen = plan(inventory.stats, profile, 0.5, max(1, options.ranks), bundle_possible)
    would_delete = tuple(extra) if options.delete else ()
    route = "dry run" if shown or would_delete else "already in place"
    return StagingResult(dest, chosen, "dry run", route, files, inventory.stats.bytes, 0,
                         time.monotonic() - started, in_place=in_place, would_send=tuple(shown),
                         would_delete=would_delete)
