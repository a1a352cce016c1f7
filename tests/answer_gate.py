"""Stands in for the far side's Python in a push test: holds back the session's answers after `receive` until a shard
arrives, to show whether the sender waited for the receiver's resume answer before its first shard.

Usage (as --remote-python): ``python answer_gate.py LOG PYTHON -m mpi_stager session --list ...``. It runs
the session with ``PYTHON`` and passes its stdin on untouched. The session's stdout is relayed too: its hello,
its listing and a ``declined`` line at once, but any other answer once the ``receive`` (or ``receive-new``)
request has gone through only after the stream's first SHARD or SKIP frame has come in, or after at most HOLD_S
seconds. LOG then reads ``shard first`` (the sender sent a shard without the answer) or ``held out`` (the time
ran out: the sender was waiting for the answer).
"""
from __future__ import annotations

import subprocess
import sys
import threading

from bundles.stream import FrameKind, FrameReader
from mpi_stager.wire import DECLINED
from stream_gate import Tee          # a sibling script: this one runs as a file too

HOLD_S = 3.0


class _Gate:
    """The session's stdout relayed to ours, held from the ``receive`` request until :meth:`open`."""

    def __init__(self, log: str):
        self.log, self.receiving, self.opened = log, threading.Event(), threading.Event()

    def relay(self, child_out) -> None:
        hello, header = child_out.readline(), child_out.readline()
        self._pass(hello + header + child_out.read(int(header.split()[1])))
        while line := child_out.readline():
            if line != DECLINED and self.receiving.is_set() and not self.opened.wait(HOLD_S):
                self.open("held out")
            self._pass(line)

    @staticmethod
    def _pass(data: bytes) -> None:
        sys.stdout.buffer.write(data)
        sys.stdout.buffer.flush()

    def open(self, verdict: str) -> None:
        if not self.opened.is_set():
            with open(self.log, "w") as handle:
                handle.write(verdict)
            self.opened.set()


def main() -> int:
    log, python, *args = sys.argv[1:]
    session = subprocess.Popen([python, *args], stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    gate = _Gate(log)
    relay = threading.Thread(target=gate.relay, args=(session.stdout,), daemon=True)
    relay.start()
    while (request := sys.stdin.buffer.readline()) and not request.startswith(b"receive"):
        session.stdin.write(request)
        session.stdin.flush()
    gate.receiving.set()
    session.stdin.write(request)
    reader = _stream_reader(session)
    frame = reader.next()                                   # the skeleton
    if request.startswith(b"receive-new") and sys.stdin.buffer.peek(1)[:1] == b"r":   # declined: a request follows
        session.stdin.write(sys.stdin.buffer.readline())
        reader = _stream_reader(session)
        frame = reader.next()
    while frame is not None and frame.kind not in (FrameKind.SHARD, FrameKind.SKIP):
        frame = reader.next()
    gate.open("shard first")
    while data := sys.stdin.buffer.read1(1 << 16):
        session.stdin.write(data)
        session.stdin.flush()
    session.stdin.close()
    status = session.wait()
    relay.join()
    return status


def _stream_reader(session) -> FrameReader:
    """A reader of the stream on our stdin, past its prelude, that passes on what it reads to the session."""
    reader = FrameReader(Tee(sys.stdin.buffer, session.stdin), "gate")
    reader.shard_limit = 1 << 40
    reader.prelude()
    return reader


if __name__ == "__main__":
    sys.exit(main())
