"""One far-side shell session for a tar-tools push: list, hash, extract shard by shard and check, over one ssh channel."""
from __future__ import annotations

import threading
from dataclasses import dataclass, field

from bundles.errors import DestinationError
from bundles.state import JOURNAL_KINDS

from staging_core.routes.tar_tools import FIND_RECORDS
from staging_core.transports.base import Endpoint, Transport
from staging_core.transports.errors import classify

FRAME_BYTES = 4 << 20     # stream bytes gathered into one frame (one `head -c` there)

# Run as `sh -c SCRIPT pallet-session DEST DECODER` with the far side's own tools (GNU tar, coreutils, util-linux).
# It makes DEST, checks DEST/.pallet is a directory of ours, waits on a flock of it (a tar of a killed push may
# still be writing), and replies with the tree's find records. Then one command per line on stdin:
#   H N   hash the N bytes of NUL-separated ./names that follow; reply with md5sum lines
#   T     mark DEST incomplete; extract one run of tar shards sent as frames "SIZE\n" + SIZE bytes, ended by "0\n";
#         the first T starts a background md5sum fed by V, so checking overlaps the next shard's extraction
#   V N   queue the N bytes of NUL-separated ./names that follow (files already extracted) for that md5sum
#   W     wait for the queued md5sums; reply with their lines
#   F C   done: remove the INCOMPLETE mark (C=1: all of DEST/.pallet, else only if that empties it); reply "done"
# A reply is its length in bytes on one line, then the bytes. End of input before F: the pusher is gone (exit 9).
SESSION_SCRIPT = (r"""
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
""").replace("JOURNALS", " ".join(f".pallet/{kind}*" for kind in JOURNAL_KINDS))


@dataclass
class FrameWriter:
    """Shard bytes as frames on the session's input, gathered to :data:`FRAME_BYTES` so `head -c` runs seldom."""

    write_raw: object
    pending: list[bytes] = field(default_factory=list)
    size: int = 0

    def write(self, data) -> None:
        self.pending.append(bytes(data))
        self.size += len(data)
        if self.size >= FRAME_BYTES:
            self.flush()

    def flush(self) -> None:
        if self.size:
            self.write_raw(b"%d\n" % self.size)
            for piece in self.pending:          # one by one: gathering them would copy the frame twice
                self.write_raw(piece)
        self.pending, self.size = [], 0


class FarSession:
    """The far side's end of a tar-tools push into ``endpoint`` (see SESSION_SCRIPT); a context manager.

    Every method writes one command; those that expect a reply block until
    it arrives. When the far side fails, the next call raises the
    TransportError its status and message give (a DestinationError for the
    script's own refusals). Closing without :meth:`finish` leaves DEST marked
    incomplete and resumable.
    """

    def __init__(self, transport: Transport, endpoint: Endpoint, decoder: str):
        self.endpoint = endpoint
        self.far = transport.stream_into(["sh", "-c", SESSION_SCRIPT, "pallet-session", endpoint.path, decoder])
        self._errors: list[bytes] = []
        self._drain = threading.Thread(target=lambda: self._errors.append(self.far.stderr.read()),
                                       name="pallet-session-stderr", daemon=True)
        self._drain.start()

    def __enter__(self) -> "FarSession":
        return self

    def __exit__(self, kind, *exc) -> None:
        if kind is not None and issubclass(kind, KeyboardInterrupt):
            self._abandon()                         # SIGINT, SIGTERM: the far side is not waited for
        self.close(failed=kind is not None)

    def listing(self) -> bytes:
        """The find records the session opened with."""
        return self._reply()

    def hash_now(self, names: bytes) -> bytes:
        """md5sum lines of the NUL-separated ``./names`` (files as they are there now)."""
        self._send(b"H %d\n" % len(names) + names)
        return self._reply()

    def shard(self) -> FrameWriter:
        """Start one tar run there; write its shards' bytes to the FrameWriter, then call :meth:`end_shard`."""
        self._send(b"T\n")
        return FrameWriter(self._send)

    def end_shard(self, frames: FrameWriter, names: bytes) -> None:
        """End the run and queue its files (NUL-separated ``./names``) for checking once its tar is done."""
        frames.flush()
        self._send(b"0\n" + (b"V %d\n" % len(names) + names if names else b""))

    def checked(self) -> bytes:
        """md5sum lines of every file queued since the last call, waiting for the far side's md5sum."""
        self._send(b"W\n")
        return self._reply()

    def finish(self, clear_state: bool) -> None:
        """Take the INCOMPLETE mark away (and DEST/.pallet with ``clear_state``); the session ends."""
        self._send(b"F %d\n" % clear_state)
        self._reply()
        self.close()

    def close(self, failed: bool = False) -> None:
        """End the session, waiting for the far side to exit; raise if it failed before finishing, unless
        ``failed``: an error here (a source file that changed while read, say) is on its way, and the far side's
        failure is only its echo (its tar saw the stream end in the middle of a frame)."""
        if self.far.returncode is not None:
            return
        code = self._ended()
        self.far.stdout.close()
        if code not in (0, 9) and not failed:
            raise self._failure(code)

    def _abandon(self) -> None:
        """End our input (the far side's script ends as it reads its end), stop ssh and our reads of its output."""
        try:
            self.far.stdin.close()
        except OSError:
            pass
        self.far.stop()
        self.far.wait()
        self.far.stdout.close()

    def _send(self, data: bytes) -> None:
        self._to_far_side(self.far.stdin.write, data)

    def _to_far_side(self, operation, *args) -> None:
        """Write to (or flush) the session's input; a far side that has gone raises what its status says."""
        try:
            operation(*args)
        except (BrokenPipeError, ConnectionResetError):
            raise self._failure(self._ended()) from None

    def _reply(self) -> bytes:
        self._to_far_side(self.far.stdin.flush)
        line = self.far.stdout.readline()
        body = self.far.stdout.read(int(line)) if line.strip().isdigit() else b""
        if not line.strip().isdigit() or len(body) != int(line):
            raise self._failure(self._ended())
        return body

    def _ended(self) -> int:
        """Close the session's input and wait for the far side: its exit status."""
        try:
            self.far.stdin.close()
        except OSError:
            pass
        code = self.far.wait()
        self._drain.join()
        return code

    def _failure(self, code: int):
        message = b"".join(self._errors).decode(errors="replace").strip()
        if code in (5, 6, 8):
            return DestinationError(message.removeprefix("pallet: ") or f"the far side stopped ({code})",
                                    self.endpoint.url(), "fix that, then rerun: what landed intact is kept")
        return classify(message, code, ["tar", "-x"], self.endpoint.url(),
                        f"the far side's tar session failed with status {code}")
