"""A far side of session protocol v2, frozen as pallet 0.1 spoke it before mpi_stager.wire (a fixture, never updated).

Usage (as --remote-python): ``python far_side_v2.py LOG -m mpi_stager ARGS...``. For ``session [--wait]
[--list] DEST`` it does what a v2 session did up to its requests: lock DEST (an flock on the directory),
write the hello ``pallet-session 2``, with --list DEST's listing block; then it reads its input to the end,
as a v2 session that is left. Any other command (``receive``, ``send``, ...) runs with the real pallet,
so its stream and summaries are this pallet's (what the fallback after the session is tested on). LOG
gets one line per event: the client's hello as its environment carried it, the session's start and end,
each other command.
"""
from __future__ import annotations

import fcntl
import os
import subprocess
import sys

import zstandard

HELLO = b"pallet-session 2\n"
LISTING_ARGV = ["find", ".", "-mindepth", "1", "-path", "./.pallet", "-prune", "-o",
                "-printf", r"%y\0%m\0%T@\0%s\0%l\0%i\0%n\0%P\0"]


def log(path: str, line: str) -> None:
    with open(path, "a") as handle:
        handle.write(line + "\n")


def listing(dest: str) -> bytes:
    if os.path.lexists(os.path.join(dest, ".pallet", "INCOMPLETE")):
        return b"INCOMPLETE"
    return subprocess.run(LISTING_ARGV, cwd=dest, check=True, capture_output=True).stdout


def session(path: str, args: list[str]) -> int:
    dest = args[-1]
    os.makedirs(dest, exist_ok=True)
    fd = os.open(dest, os.O_RDONLY | os.O_DIRECTORY)
    fcntl.flock(fd, fcntl.LOCK_EX | (0 if "--wait" in args else fcntl.LOCK_NB))
    out = sys.stdout.buffer
    out.write(HELLO)
    if "--list" in args:
        block = zstandard.ZstdCompressor(level=1).compress(listing(dest))
        out.write(b"listing %d\n" % len(block) + block)
    out.flush()
    got = sum(len(chunk) for chunk in iter(lambda: sys.stdin.buffer.read(1 << 16), b""))
    log(path, f"session ended: its input closed after {got} bytes")
    return 0


def main() -> int:
    path, flag, module, command, *args = sys.argv[1:]
    log(path, f"hello from the client: {os.environ.get('PALLET_HELLO', '(none)')}")
    if command == "session":
        log(path, "session v2 started")
        return session(path, args)
    log(path, f"command: {command}")
    os.execv(sys.executable, [sys.executable, flag, module, command, *args])
    return 127                  # not reached: execv does not return


if __name__ == "__main__":
    sys.exit(main())
