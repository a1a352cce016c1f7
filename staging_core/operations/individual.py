"""The individual route's rules: DEST marked, temporaries in DEST/.pallet, files changed while read sent again."""
from __future__ import annotations

import os
import posixpath
import stat
from collections.abc import Callable
from dataclasses import dataclass

from bundles.errors import DestinationError, SourceError, UsageError
from bundles.reserved import TRANSFER_DIR
from bundles.scan import SourceTree, scan
from bundles.journal import JOURNAL_KINDS
from bundles.state import finish, mark_incomplete, state_path
from bundles.state_fd import remove_entry, state_dir_fd
from bundles.tarformat import Kind

from staging_core.transports.base import Endpoint, TransferResult, Transport
from staging_core.transports.errors import NotSupportedError

SCRATCH = TRANSFER_DIR            # in DEST/.pallet: where a transport keeps its temporaries (rsync --temp-dir)
READ_ROUNDS = 3                   # a file still changing after this many sends is an error naming it

# $1 DEST, $2 the marker's text: DEST/.pallet made or checked (a link or file planted there is removed, never
# followed; the directory must be this user's), the journals and an earlier run's temporaries removed, INCOMPLETE
# written anew (never through a link) and the scratch made.
_BEGIN = r"""
unset CDPATH
cd -- "$1" || exit 1
if [ -L .pallet ] || { [ -e .pallet ] && [ ! -d .pallet ]; }; then rm -f -- .pallet || exit 5; fi
mkdir -m 700 -p .pallet && [ ! -L .pallet ] && [ -O .pallet ] && cd ./.pallet || {
  echo "pallet: cannot use $1/.pallet (a link, or another user's): remove it and rerun" >&2; exit 5; }
rm -rf -- JOURNALS TRANSFER INCOMPLETE.new
(set -C && printf '%s\n' "$2" > INCOMPLETE.new) && mv -f -- INCOMPLETE.new INCOMPLETE && mkdir -m 700 TRANSFER
""".replace("JOURNALS", " ".join(f"{kind}*" for kind in JOURNAL_KINDS)).replace("TRANSFER", SCRATCH)

# $1 DEST: a selection's scratch and the INCOMPLETE marker removed, then DEST/.pallet if it is left empty.
_FINISH = r"""
unset CDPATH
cd -- "$1" && [ -d .pallet ] && [ ! -L .pallet ] && cd ./.pallet || exit 0
rm -rf -- TRANSFER INCOMPLETE && cd .. && { rmdir .pallet 2>/dev/null || :; }
""".replace("TRANSFER", SCRATCH)


@dataclass(frozen=True)
class Marked:
    """A DEST an individual transfer writes into, once marked: ``scratch`` is the transports' temporaries'
    directory relative to DEST (None where nothing could be made there: no remote command runs there)."""

    endpoint: Endpoint
    scratch: str | None


def begin(transport: Transport, endpoint: Endpoint, text: str,
          run_there: Callable[[list[str]], bytes] | None = None) -> Marked:
    """Mark DEST INCOMPLETE (``text`` says what runs), drop journals that files written one by one would make
    lie, and make DEST/.pallet/transfer for the transport's temporaries, removing an earlier run's. Locally
    through descriptors (bundles.state); remotely in one command over ``transport`` or ``run_there`` (the
    route's host). A far side that runs nothing gets no mark (and has no journal to drop)."""
    scratch = posixpath.join(".pallet", SCRATCH)
    if endpoint.is_local:
        _begin_locally(endpoint.path, text)
        return Marked(endpoint, scratch)
    argv = ["sh", "-c", _BEGIN, "pallet-begin", endpoint.path, text]
    try:
        if transport.capabilities.remote_exec:
            transport.run(argv)
        elif run_there is not None:
            run_there(argv)
        else:
            return Marked(endpoint, None)
    except NotSupportedError:
        return Marked(endpoint, None)
    return Marked(endpoint, scratch)


def _begin_locally(dest: str, text: str) -> None:
    mark_incomplete(dest, text)
    with state_dir_fd(dest) as state:
        remove_entry(state, SCRATCH)            # an earlier run's temporaries
        try:
            os.mkdir(SCRATCH, 0o700, dir_fd=state)
        except OSError as exc:
            raise DestinationError(f"cannot create ({exc.strerror})", state_path(dest, SCRATCH),
                                   "check the destination's permissions") from None


def finish_selection(transport: Transport, marked: Marked,
                     run_there: Callable[[list[str]], bytes] | None = None) -> None:
    """After a selection succeeded: its scratch and the marker go, and DEST/.pallet if nothing else is left
    in it (a whole-tree push clears all of DEST/.pallet itself)."""
    dest = marked.endpoint.path
    if marked.endpoint.is_local:
        finish(dest, state_path(dest, SCRATCH))
    elif marked.scratch is not None:
        argv = ["sh", "-c", _FINISH, "pallet-finish", dest]
        runner = transport.run if transport.capabilities.remote_exec else run_there
        if runner is not None:          # a scratch was made there by one of them (see begin)
            runner(argv)


def changed_since_scan(tree: SourceTree, wanted: set[bytes] | None = None) -> list[bytes]:
    """The regular files of ``tree`` (only ``wanted`` of them, when given) whose size or mtime is no longer what
    the scan saw: a copy made meanwhile may hold bytes the file held at no one moment. A file gone since is
    reported too."""
    index, root, changed = tree.index, tree.root, []
    for i in index.positions(Kind.FILE):
        path = index.paths[i]
        if wanted is not None and path not in wanted:
            continue
        try:
            st = os.lstat(os.path.join(root, path))
        except OSError:
            changed.append(path)
            continue
        if not stat.S_ISREG(st.st_mode) or st.st_size != index.sizes[i] or st.st_mtime_ns != index.mtimes[i]:
            changed.append(path)
    return changed


def send_until_stable(send: Callable[[list[str] | None], TransferResult], tree: SourceTree,
                      listed: list[str] | None) -> list[TransferResult]:
    """Send ``listed`` (None: the whole tree) with ``send``, then again the files that changed while they were
    read (scanned anew each time), up to READ_ROUNDS sends; SourceError naming a file still changing then."""
    results = [send(listed)]
    wanted = None if listed is None else {os.fsencode(item) for item in listed}
    changed = changed_since_scan(tree, wanted)
    for _ in range(READ_ROUNDS - 1):
        if not changed:
            return results
        tree = scan(os.fsdecode(tree.root), "none", 0, include=frozenset(changed))
        results.append(send([os.fsdecode(path) for path in tree.index.paths]))
        changed = changed_since_scan(tree, set(changed))
    if changed:
        first = os.path.join(os.fsdecode(tree.root), os.fsdecode(changed[0]))
        raise SourceError(f"changed while being read, {READ_ROUNDS} times ({len(changed)} file(s) did)", first,
                          "stop what writes to it (or leave it out of the push) and run again")
    return results


def fetch_until_stable(fetch: Callable[[list[str] | None], TransferResult], transport: Transport,
                       source: Endpoint, dest: str, listed: list[str] | None, check: bool) -> list[TransferResult]:
    """Fetch ``listed`` (None: the whole tree) with ``fetch``, then compare the source's listing, made after the
    fetch, with what landed: a file whose size or mtime there is no longer what its copy here carries changed
    while it was read (the copy keeps the times read before the data) and is fetched again, up to READ_ROUNDS
    fetches; SourceError naming a file still changing then. Only with ``check``: a whole-tree pull
    (``listed``: what the comparison with DEST left of it) from a source whose listing carries exact times (a
    selection's few files would cost a listing of the whole source each round)."""
    results = [fetch(listed)]
    if not check:
        return results
    wanted = None if listed is None else set(listed)
    changed = _landed_otherwise(transport, source, dest, wanted)
    for _ in range(READ_ROUNDS - 1):
        if not changed:
            return results
        results.append(fetch(changed))
        changed = _landed_otherwise(transport, source, dest, set(changed))
    if changed:
        raise SourceError(f"changed while being read, {READ_ROUNDS} times ({len(changed)} file(s) did)",
                          posixpath.join(source.url(), changed[0]),
                          "stop what writes to it (or leave it out of the pull) and run again")
    return results


def _landed_otherwise(transport: Transport, source: Endpoint, dest: str, wanted: set[str] | None) -> list[str]:
    """The source's regular files (``wanted`` of them, when given) whose size or mtime differ from those of
    their copies under ``dest``."""
    differ = []
    for entry in transport.list(source.path):
        if entry.kind != "f" or wanted is not None and entry.path not in wanted:
            continue
        try:
            st = os.lstat(os.path.join(dest, entry.path))
        except OSError:
            differ.append(entry.path)
            continue
        if st.st_size != entry.size or st.st_mtime_ns != entry.mtime_ns:
            differ.append(entry.path)
    return differ


def uncarried_link(tree: SourceTree, transport: Transport) -> bytes | None:
    """The first symbolic link of ``tree`` when ``transport`` cannot carry symbolic links one by one (GridFTP):
    sent individually it would be left out. None when there is none or it can."""
    if transport.capabilities.symlinks:
        return None
    links = tree.index.positions(Kind.SYMLINK)
    return tree.index.paths[links[0]] if links else None


def check_carried(tree: SourceTree, transport: Transport) -> None:
    """UsageError naming a symbolic link that ``transport`` would leave out of an individual push."""
    link = uncarried_link(tree, transport)
    if link is not None:
        raise UsageError(f"{transport.scheme}:// cannot carry symbolic links one by one",
                         os.path.join(os.fsdecode(tree.root), os.fsdecode(link)),
                         "use --strategy bundle (with --unpack-via ssh://HOST), or remove the links")
