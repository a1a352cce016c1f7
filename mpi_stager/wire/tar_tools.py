"""The tar-tools route's shell scripts, rendered with their version line, and the check of that line."""
from __future__ import annotations


from bundles.errors import StreamError
from bundles.journal import JOURNAL_KINDS

from .messages import FIND_RECORDS
from .versions import TAR_TOOLS_VERSION


# ---------------------------------------------------------------- the tar-tools scripts (docs/wire.md)

TAR_TOOLS_LINE = b"pallet-tar-tools %d\n" % TAR_TOOLS_VERSION     # each script's first output line
MANIFEST_END = b"E\0\0\0\0\0\0\0\0"     # ends the records of the "list" script: a record of its own

_SCRIPTS = {
    # $1 DEST; md5 of the NUL-separated ./names on stdin (none when stdin is empty). Prints listing records, an
    # "E" record, then md5sum lines. It holds a flock on DEST/.pallet, as the session script does: a far-side tar
    # outlives a push killed with -9 until its input ends.
    "list": r"""
cd -- "$1" 2>/dev/null || { printf 'E\0\0\0\0\0\0\0\0'; exit 0; }
if [ -d .pallet ] && [ ! -L .pallet ]; then     # wait for a tar of a killed push that is still writing
  exec 9<.pallet; flock -w 600 9 || { echo "pallet: an earlier transfer into $1 is still running" >&2; exit 6; }
fi
""" + FIND_RECORDS + r"""
printf 'E\0\0\0\0\0\0\0\0'
xargs -0 -r md5sum --
""",
    # $1 SRC, $2 compressor ("zstd -q -c", "gzip -c" or "cat"): the NUL-separated ./names on stdin, as one posix
    # tar (exit 3: no SRC).
    "send": r"""
cd -- "$1" || exit 3
tar -c --null --no-recursion -T - -f - --format=posix --numeric-owner | $2
""",
    # $1 DEST, $2 decoder, with the far side's own tools (GNU tar, coreutils, util-linux). It makes DEST, checks
    # DEST/.pallet is a directory of ours, waits on a flock of it (a tar of a killed push may still be writing),
    # and replies with the tree's listing records. Then one command per line on stdin:
    #   H N   hash the N bytes of NUL-separated ./names that follow; reply with md5sum lines
    #   T     mark DEST incomplete; extract one run of tar shards sent as frames "SIZE\n" + SIZE bytes, ended by
    #         "0\n"; the first T starts a background md5sum fed by V, so checking overlaps the next extraction
    #   V N   queue the N bytes of NUL-separated ./names that follow (files already extracted) for that md5sum
    #   W     wait for the queued md5sums; reply with their lines
    #   F C   done: remove the INCOMPLETE mark (C=1: all of DEST/.pallet, else only if that empties it); reply
    #         "done"
    # A reply is its length in bytes on one line, then the bytes. End of input before F: the pusher is gone
    # (exit 9). Exit 5, 6, 8: the script's own refusals (message on stderr).
    "session": (r"""
set -u
fail() { echo "pallet: $1" >&2; exit "$2"; }
mkdir -p -- "$1" 2>/dev/null && cd -- "$1" || fail "cannot create or enter $1" 5
if [ -L .pallet ] || { [ -e .pallet ] && { [ ! -d .pallet ] || [ ! -O .pallet ]; }; }; then
  fail "$1/.pallet is not a directory of yours; remove it" 5
fi
mkdir -p .pallet && exec 9<.pallet || fail "cannot create $1/.pallet" 5
flock -w 600 9 || fail "an earlier transfer into $1 is still running" 6
rm -f .pallet/list .pallet/sums .pallet/queue .pallet/checked
reply() { wc -c < "$1"; cat -- "$1"; }
""" + FIND_RECORDS + r""" > .pallet/list
reply .pallet/list
checker=
while read -r command size; do
  case $command in
  H) head -c "$size" | xargs -0 -r md5sum -- > .pallet/sums 2>/dev/null; reply .pallet/sums ;;
  T) if [ -z "$checker" ]; then
       rm -rf JOURNALS && : > .pallet/INCOMPLETE && mkfifo .pallet/queue \
         && exec 8<>.pallet/queue || fail "cannot write in $1" 5
       xargs -0 -r -n 2048 md5sum -- < .pallet/queue > .pallet/checked 2>/dev/null 8>&- &
       checker=$!
     fi
     while read -r frame && [ "$frame" != 0 ]; do head -c "$frame" || exit 1; done 8>&- \
       | $2 8>&- | tar -x -p --no-same-owner -f - 8>&- || exit 7 ;;
  V) head -c "$size" >&8 ;;
  W) exec 8>&-; wait "$checker"; checker=; rm -f .pallet/queue; reply .pallet/checked ;;
  F) rm -f .pallet/INCOMPLETE .pallet/list .pallet/sums .pallet/checked
     if [ "$size" = 1 ]; then rm -rf .pallet; else rmdir .pallet 2>/dev/null; fi
     printf '4\ndone'; exit 0 ;;
  *) fail "unexpected command from the pusher" 8 ;;
  esac
done
exit 9
""").replace("JOURNALS", " ".join(f".pallet/{kind}*" for kind in JOURNAL_KINDS)),
}


def tar_tools_script(name: str) -> str:
    """The tar-tools script ``name`` ("list", "send" or "session"), run as ``sh -c SCRIPT pallet-NAME ARGS``: it
    first prints :data:`TAR_TOOLS_LINE`, which the client checks (:func:`check_tar_tools_line`)."""
    return (f"# pallet tar-tools {name} script, version {TAR_TOOLS_VERSION}\n"
            f"printf 'pallet-tar-tools %s\\n' {TAR_TOOLS_VERSION}" + _SCRIPTS[name])


def check_tar_tools_line(line: bytes, where: str) -> None:
    """Raise StreamError unless ``line`` (not empty: an empty one is a far side that failed first, whose status
    says why) is this version's :data:`TAR_TOOLS_LINE`."""
    if line and line != TAR_TOOLS_LINE:
        said = line[:60].decode(errors="replace").strip()
        raise StreamError(f"the far side's tar-tools script answered {said!r}, not "
                          f"{TAR_TOOLS_LINE.decode().strip()!r}", where,
                          "check that nothing there prints to stdout in non-interactive shells, then rerun")


def strip_tar_tools_line(output: bytes, where: str) -> bytes:
    """A script's whole output without its version line (checked)."""
    line, _, rest = output.partition(b"\n")
    check_tar_tools_line(line + b"\n", where)
    return rest
