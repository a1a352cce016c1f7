"""One far-side shell session for a tar-tools push: list, hash, extract shard by shard and check, on one channel."""
from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable
from dataclasses import dataclass, field

from bundles.errors import DestinationError, StreamError
from mpi_stager.wire import check_tar_tools_line, tar_tools_script

from staging_core.transports.base import Endpoint, Transport
from staging_core.transports.errors import classify

FRAME_BYTES = 4 << 20     # stream bytes gathered into one frame (one `head -c` there)


@dataclass
class FrameWriter:
    """Shard bytes as frames on the session's input, gathered to :data:`FRAME_BYTES` so `head -c` runs seldom."""

    write_raw: Callable[[bytes], None]
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
    """The far side's end of a tar-tools push into ``endpoint``: the tar-tools "session" script
    (mpi_stager.wire, docs/wire.md); a context manager.

    Every method writes one command; those that expect a reply block until
    it arrives. When the far side fails, the next call raises the
    TransportError its status and message give (a DestinationError for the
    script's own refusals). Closing without :meth:`finish` leaves DEST marked
    incomplete and resumable.
    """

    def __init__(self, transport: Transport, endpoint: Endpoint, decoder: str):
        self.endpoint = endpoint
        self.far = transport.stream_into(["sh", "-c", tar_tools_script("session"), "pallet-session", endpoint.path,
                                          decoder])
        self._errors: list[bytes] = []
        self._drain = threading.Thread(target=lambda: self._errors.append(self.far.stderr.read()),
                                       name="pallet-session-stderr", daemon=True)
        self._drain.start()

    def __enter__(self) -> FarSession:
        return self

    def __exit__(self, kind, *exc) -> None:
        if kind is not None and issubclass(kind, KeyboardInterrupt):
            self._abandon()                         # SIGINT, SIGTERM: the far side is not waited for
        self.close(failed=kind is not None)

    def listing(self) -> bytes:
        """The listing records the session opened with, after its version line (checked)."""
        self._to_far_side(self.far.stdin.flush)
        line = self.far.stdout.readline()
        if not line:
            raise self._failure(self._ended())
        try:
            check_tar_tools_line(line, self.endpoint.url())
        except StreamError:
            self._abandon()
            raise
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
        with contextlib.suppress(OSError):
            self.far.stdin.close()
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
        with contextlib.suppress(OSError):
            self.far.stdin.close()
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
