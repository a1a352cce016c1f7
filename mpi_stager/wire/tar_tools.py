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
    # $1 DEST, $2 decoder, $3 DEST's lock: "held" (the caller holds it; the default), "try" or "wait" (the session
    # takes it: a flock on DEST itself, as staging_core.locking takes it; exit 4 when another run holds it, unless
    # that is a session whose pusher went away and whose tar still writes: then it waits for it). With the far
    # side's own tools (GNU tar, coreutils, util-linux). It makes DEST, checks DEST/.pallet is a directory of ours,
    # waits on a flock of it (a tar of a killed push may still be writing), and replies with the tree's listing
    # records. Then one command per line on stdin:
    #   T     mark DEST incomplete; extract one run of tar shards sent as frames "SIZE\n" + SIZE bytes, ended by "0\n"
    #   V N M queue the N bytes of md5sum check lines that follow ("HEX  ./NAME\n", files already there) for a
    #         background `md5sum -c`, which checks them while the next run arrives; then append the M bytes of
    #         NUL-separated ./names that follow (names md5sum -c cannot read back) to those hashed at W
    #   W     wait for the queued checks; reply with md5sum -c's status, the numbers of the lines that failed and
    #         the count of lines checked, one per line; then reply with the md5sum lines of the names to hash
    #   F C S done: remove the INCOMPLETE mark (C=1: all of DEST/.pallet, else only if that empties it), give DEST
    #         the mtime S (seconds.nanoseconds; none: leave it); reply "done". The lock is held until input ends.
    # A reply is its length in bytes on one line, then the bytes. End of input before F: the pusher is gone
    # (exit 9). Exit 4: DEST is locked; 5, 6, 8: the script's own refusals (message on stderr).
    "session": (r"""
set -u
fail() { echo "pallet: $1" >&2; exit "$2"; }
mkdir -p -- "$1" 2>/dev/null && cd -- "$1" || fail "cannot create or enter $1" 5
case ${3:-held} in
held) ;;
wait) exec 7<. && flock 7 || fail "cannot lock $1" 5 ;;
*) exec 7<. || fail "cannot open $1" 5
   flock -n 7 || { [ -f .pallet/ABANDONED ] && flock -w 600 7; } || exit 4 ;;
esac
[ ! -L .pallet ] || rm -f .pallet || fail "cannot remove the link $1/.pallet" 5    # removed, never followed
if [ -e .pallet ] && { [ ! -d .pallet ] || [ ! -O .pallet ]; }; then
  fail "$1/.pallet is not a directory of yours; remove it" 5
fi
mkdir -p .pallet && [ ! -L .pallet ] && exec 9<.pallet || fail "cannot create $1/.pallet" 5
flock -w 600 9 || fail "an earlier transfer into $1 is still running" 6
STATE=".pallet/list .pallet/sums .pallet/queue .pallet/checked .pallet/failed .pallet/status .pallet/odd"
rm -f $STATE .pallet/ABANDONED
trap 'rm -f .pallet/ABANDONED' EXIT            # made when the pusher went away while this session's tar wrote
reply() { wc -c < "$1"; cat -- "$1"; }
""" + FIND_RECORDS + r""" > .pallet/list
reply .pallet/list
checker= marked= finished=
start_checker() {
  [ -n "$checker" ] && return 0
  mkfifo .pallet/queue && exec 8<>.pallet/queue 6<.pallet/queue || fail "cannot write in $1" 5
  { LC_ALL=C md5sum -c - 2>/dev/null; echo "$?" > .pallet/status; } <&6 > .pallet/checked 6<&- 7<&- 8>&- &
  checker=$!
  exec 6<&-          # the checker holds the queue's reading end from its start: no open of it waits for a writer
}
while read -r command size more; do
  case $command in
  T) if [ -z "$marked" ]; then
       rm -rf JOURNALS && : > .pallet/INCOMPLETE || fail "cannot write in $1" 5
       marked=1
     fi
     { while read -r frame && [ "$frame" != 0 ]; do head -c "$frame" || exit 1; done
       [ "$frame" = 0 ] || : > .pallet/ABANDONED; } 8>&- \
       | $2 8>&- | tar -x -p --no-same-owner -f - 8>&- || exit 7 ;;
  V) if [ "$size" != 0 ]; then start_checker; head -c "$size" >&8; fi
     if [ "$more" != 0 ]; then head -c "$more" >> .pallet/odd; fi ;;
  W) if [ -n "$checker" ]; then
       exec 8>&-; wait "$checker"; checker=; rm -f .pallet/queue
       { cat .pallet/status; LC_ALL=C sed -n -e '/: OK$/!=' -e '$=' .pallet/checked; } > .pallet/failed
     else echo 0 > .pallet/failed; fi
     reply .pallet/failed
     : > .pallet/sums; [ ! -s .pallet/odd ] || xargs -0 -r md5sum -- < .pallet/odd > .pallet/sums 2>/dev/null
     rm -f .pallet/odd; reply .pallet/sums ;;
  F) rm -f .pallet/INCOMPLETE $STATE
     if [ "$size" = 1 ]; then rm -rf .pallet; else rmdir .pallet 2>/dev/null; fi
     [ -z "$more" ] || touch -m -d "@$more" . 2>/dev/null || :
     marked= finished=1; printf '4\ndone' ;;
  *) fail "unexpected command from the pusher" 8 ;;
  esac
done
[ -n "$finished" ] && exit 0
[ -n "$marked" ] || { rm -f $STATE; rmdir .pallet 2>/dev/null; }
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
