"""Stands in for the far side's Python in a push test: holds back the session's answers after `receive` until a shard
arrives, to show whether the sender waited for the receiver's resume answer before its first shard.

Usage (as --remote-python): ``python answer_gate.py LOG PYTHON -m mpi_stager session ...``. It runs the
session with ``PYTHON`` and passes its stdin on untouched. The session's stdout is relayed too, except that
once the ``receive`` request has gone through, nothing more is relayed until the stream's first SHARD or SKIP
frame has come in, or for at most HOLD_S seconds. LOG then reads ``shard first`` (the sender sent a shard
without the answer) or ``held out`` (the time ran out: the sender was waiting for the answer).
"""
from __future__ import annotations

import subprocess
import sys
import threading

from bundles.stream import FrameKind, FrameReader
from stream_gate import Tee          # a sibling script: this one runs as a file too

HOLD_S = 3.0


class _Gate:
    """The session's stdout relayed to ours, held from the ``receive`` request until :meth:`open`."""

    def __init__(self, log: str):
        self.log, self.receiving, self.opened = log, threading.Event(), threading.Event()

    def relay(self, child_out) -> None:
        while data := child_out.read1(1 << 16):
            if self.receiving.is_set() and not self.opened.wait(HOLD_S):
                self.open("held out")
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
    reader = FrameReader(Tee(sys.stdin.buffer, session.stdin), "gate")
    reader.shard_limit = 1 << 40
    reader.prelude()
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


if __name__ == "__main__":
    sys.exit(main())
