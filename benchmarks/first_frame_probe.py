"""Far-side stand-in for `--remote-python` that notes when a push's first shard frame arrives, then runs the real one.

Usage: ``python first_frame_probe.py LOG PYTHON -m mpi_stager session ...``. It
starts ``PYTHON -m mpi_stager ...`` with our stdout, passes our stdin on, and
when the first SHARD, DATA or SKIP frame header of a bundle stream has come
through (after the session's ``receive`` line, or at once for ``receive``)
writes the wall-clock time to LOG. Only the standard library is imported, so
that it adds little to the far side's start.

``python first_frame_probe.py --bytes LOG`` is the same probe for the hand-made
stream: it copies stdin to stdout and writes the time its first byte came.
"""
from __future__ import annotations

import contextlib
import struct
import subprocess
import sys
import time

PRELUDE = 12                        # b"PALLETST" + u32 version
FRAME = struct.Struct("<B3xIQ")     # kind, reserved, shard number, payload length
SHARD_KINDS = (2, 3, 4)             # SHARD, DATA, SKIP


def main() -> int:
    if sys.argv[1] == "--bytes":
        return first_byte(sys.argv[2])
    log, python, *args = sys.argv[1:]
    child = subprocess.Popen([python, *args], stdin=subprocess.PIPE)
    inp, out = sys.stdin.buffer, child.stdin
    try:
        if "session" in args:
            while (line := inp.readline()) and not line.startswith(b"receive"):
                out.write(line)
                out.flush()
            out.write(line)
        _pass(inp, out, PRELUDE)
        while True:
            head = _pass(inp, out, FRAME.size)
            if len(head) < FRAME.size:
                break
            kind, _, length = FRAME.unpack(head)
            if kind in SHARD_KINDS:
                _note(log)
                break
            _pass(inp, out, length)
        while data := inp.read1(1 << 16):
            out.write(data)
            out.flush()
    except BrokenPipeError:
        pass
    finally:
        with contextlib.suppress(BrokenPipeError):
            out.close()
    return child.wait()


def first_byte(log: str) -> int:
    """Copy stdin to stdout; write the time the first byte came to ``log``."""
    inp, out = sys.stdin.buffer, sys.stdout.buffer
    data = inp.read1(1 << 16)
    _note(log)
    while data:
        out.write(data)
        data = inp.read1(1 << 16)
    out.flush()
    return 0


def _note(log: str) -> None:
    with open(log, "w") as handle:
        handle.write(f"{time.time():.6f}\n")


def _pass(inp, out, size: int) -> bytes:
    data = inp.read(size)
    out.write(data)
    out.flush()
    return data


if __name__ == "__main__":
    sys.exit(main())
