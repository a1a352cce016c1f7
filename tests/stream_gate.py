"""Stands in for the far side's Python in stream tests: lets a bundle stream reach the receiver up to shard 0.

Usage (as --remote-python): ``python stream_gate.py MODE DEST`` followed by
the receiver's own arguments (``-m mpi_stager receive ...``, or ``session``,
whose command line it passes on before the stream). The gate
forwards the skeleton and the frames of shard 0 and waits until DEST's
stream journal records a shard; with MODE ``kill:N``, the frames of N
shards, until it records N. Then in mode ``hold`` it stops reading, so
the sender stalls mid-stream, until the file ``DEST.release`` appears; it
then swallows the rest of its input and, when that ends, closes the
receiver's. In mode ``kill`` it kills the receiver with SIGKILL and exits
at once. Either way it writes the receiver's exit status to ``DEST.gate-exit``.
"""
from __future__ import annotations

import contextlib
import glob
import os
import subprocess
import sys
import time

from bundles.stream import FrameKind, FrameReader

RECORD = "shard-" + "[0-9]" * 6        # a journal record once written (never its temporary, shard-N.tmpR)


class Tee:
    """A reader that passes on what it reads to ``copy`` at once."""

    def __init__(self, source, copy):
        self.source, self.copy = source, copy

    def read(self, size: int) -> bytes:
        data = self.source.read(size)
        self.copy.write(data)
        self.copy.flush()
        return data


def _wait_for(pattern: str, count: int = 1) -> None:
    deadline = time.monotonic() + 120
    while len(glob.glob(pattern)) < count and time.monotonic() < deadline:
        time.sleep(0.05)


def main() -> int:
    mode, dest, *receiver_args = sys.argv[1:]
    mode, _, shards = mode.partition(":")
    count = int(shards or 1)
    receiver = subprocess.Popen([sys.executable, *receiver_args], stdin=subprocess.PIPE)
    if "session" in receiver_args:          # its hello and listing go out directly; its command comes first
        receiver.stdin.write(sys.stdin.buffer.readline())
        receiver.stdin.flush()
    reader = FrameReader(Tee(sys.stdin.buffer, receiver.stdin), "gate")
    reader.shard_limit = 1 << 40
    reader.prelude()
    frame, seen = reader.next(), 0
    while frame is not None and (seen := seen + (frame.kind in (FrameKind.SHARD, FrameKind.SKIP))) < count:
        frame = reader.next()
    _wait_for(os.path.join(dest, ".pallet", "stream-*", RECORD), count)
    if mode == "kill":
        receiver.kill()
    else:
        _wait_for(f"{dest}.release")
        while sys.stdin.buffer.read(1 << 16):
            pass
        with contextlib.suppress(BrokenPipeError):
            receiver.stdin.close()
    status = receiver.wait()
    with open(dest + ".gate-exit", "w") as handle:
        handle.write(str(status))
    return 137 if mode == "kill" else status


if __name__ == "__main__":
    sys.exit(main())
