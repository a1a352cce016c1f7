"""Stage a selection of files under one root as one planned operation: the API the workflow plugins call."""
from __future__ import annotations

import posixpath
from collections.abc import Sequence

from bundles.errors import UsageError
from bundles.progress import Progress

from staging_core.far_side.host_session import HostSessions
from staging_core.operations.inline import fetch_inline, inline_or_none, send_inline
from staging_core.options import StagingOptions
from staging_core.results import StagingResult
from staging_core.transports.base import EarlyConnection, parse_url

_DEFAULTS = StagingOptions()


def fetch(src_root_url: str, items: Sequence[str], dest_root: str, options: StagingOptions = _DEFAULTS,
          sizes: Sequence[int] | None = None, progress: Progress | None = None,
          sessions: HostSessions | None = None) -> StagingResult:
    """Bring ``items`` (paths relative to ``src_root_url``) to ``dest_root/<item>`` in one planned operation.

    The tree below the root is kept (``a/b.csv`` lands at
    ``dest_root/a/b.csv``) with the remote modes and mtimes; an item that
    is a directory brings everything under it. The planner decides:
    individual is one batch transfer of just these items; bundle has the
    source's pack route pack just these items (``mpi_stager pack
    --files-from -`` over ssh, ``--pack-via`` for GridFTP/Globus), fetches
    bundle + index in one transfer and unpacks them here, verified and
    resumable. ``sizes`` (in the order of ``items``) spares the remote
    listing the planner otherwise needs. Fetches into one ``dest_root``
    queue on its lock. Raises UsageError for items that are not relative
    paths inside the root, SourceError naming missing items, TransportError
    or PalletError naming the cause; result.transfers counts transfers.

    ``sessions``: the run's host sessions (a workflow's). An ssh source is
    then reached over its host's warm session, and a selection small
    enough travels inline in one request (strategy ``inline``, see
    :func:`staging_core.planning.planner.plan`).
    """
    names = clean_items(items)
    named_sizes = _sizes_of(names, items, sizes)
    session = sessions.session(parse_url(src_root_url), options) if sessions is not None else None
    done = inline_or_none(session, lambda s: fetch_inline(s, parse_url(src_root_url), names, dest_root, options,
                                                          named_sizes))
    if done is not None:
        return done
    early = EarlyConnection("master", session.master) if session is not None else None
    from staging_core.operations.push_pull import pull     # loaded when needed: an inline fetch does without it
    return pull(src_root_url, dest_root, options, progress, names, named_sizes, early_connection=early)


def fetch_if_small(src_root_url: str, items: Sequence[str], dest_root: str, options: StagingOptions,
                   sizes: Sequence[int] | None, sessions: HostSessions) -> StagingResult | None:
    """:func:`fetch` when the planner sends ``items`` inline over the source host's session (``sizes`` in
    their order, or None); None, having moved nothing, when it does not."""
    names = clean_items(items)
    named_sizes = _sizes_of(names, items, sizes)
    session = sessions.session(parse_url(src_root_url), options)
    return inline_or_none(session, lambda s: fetch_inline(s, parse_url(src_root_url), names, dest_root, options,
                                                          named_sizes))


def _sizes_of(names: list[str], items: Sequence[str], sizes: Sequence[int] | None) -> list[int] | None:
    """``sizes`` (given in the order of ``items``) in the order of ``names``, their cleaned form; UsageError
    when there is not one per item."""
    if sizes is None:
        return None
    if len(sizes) != len(items):
        raise UsageError(f"{len(sizes)} sizes for {len(items)} items", hint="give one size per item, or none")
    by_name: dict[str, int] = {}
    for item, size in zip(items, sizes, strict=True):
        by_name.setdefault(posixpath.normpath(item), size)
    return [by_name[name] for name in names]


def send(src_root: str, items: Sequence[str], dest_root_url: str, options: StagingOptions = _DEFAULTS,
         progress: Progress | None = None, sessions: HostSessions | None = None) -> StagingResult:
    """Send local ``src_root/<item>`` to ``dest_root_url/<item>`` in one planned operation; the mirror of
    :func:`fetch` (bundles are stored and forwarded, then unpacked by the destination's route), ``sessions``
    as there."""
    names = clean_items(items)
    dest = parse_url(dest_root_url)
    session = sessions.session(dest, options) if sessions is not None else None
    done = inline_or_none(session, lambda s: send_inline(s, src_root, names, dest, options))
    if done is not None:
        return done
    early = EarlyConnection("master", session.master) if session is not None else None
    from staging_core.operations.push_pull import push     # loaded when needed: an inline send does without it
    return push(src_root, dest_root_url, options, progress, names, early_connection=early)


def clean_items(items: Sequence[str]) -> list[str]:
    """Normalised, de-duplicated relative paths in their first order; UsageError names any that leave the root."""
    cleaned, seen, bad = [], set(), []
    for item in items:
        name = posixpath.normpath(item)
        if not item or posixpath.isabs(name) or name == "." or name == ".." or name.startswith("../"):
            bad.append(item)
        elif name not in seen:
            seen.add(name)
            cleaned.append(name)
    if bad:
        raise UsageError(f"not a relative path inside the root: {', '.join(map(repr, bad[:5]))}",
                         hint="give paths relative to the root URL, without '..'")
    if not cleaned:
        raise UsageError("nothing selected", hint="give at least one path")
    return cleaned
