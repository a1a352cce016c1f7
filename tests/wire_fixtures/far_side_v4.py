"""A far side one session protocol version newer than this pallet's, which no longer speaks it (a fixture).

Usage (as --remote-python): ``python far_side_v4.py LOG -m mpi_stager ARGS...``. For ``session`` it answers
with the hello of a session v4 far side that serves v4 only (summaries v2, bundle stream v2, one capability
more), then reads its input to the end; it serves nothing. Any other command is refused (status 2): a client
that falls back to separate commands fails differently. LOG gets one line per event.
"""
from __future__ import annotations

import os
import sys

HELLO = b"pallet-session 4 session=4 summary=2 stream=2 caps=clear,dirs,listing,receive,receive-new,store,wait\n"


def log(path: str, line: str) -> None:
    with open(path, "a") as handle:
        handle.write(line + "\n")


def main() -> int:
    path, _flag, _module, command, *_args = sys.argv[1:]
    log(path, f"hello from the client: {os.environ.get('PALLET_HELLO', '(none)')}")
    if command != "session":
        log(path, f"refused command: {command}")
        print(f"far side v4 (a test fixture): {command} is not served here", file=sys.stderr)
        return 2
    sys.stdout.buffer.write(HELLO)
    sys.stdout.buffer.flush()
    got = sum(len(chunk) for chunk in iter(lambda: sys.stdin.buffer.read(1 << 16), b""))
    log(path, f"session ended: its input closed after {got} bytes")
    return 0


if __name__ == "__main__":
    sys.exit(main())
