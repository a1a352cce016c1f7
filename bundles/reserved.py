"""The names pallet reserves for its own state: refused in every tree and archive it moves."""
from __future__ import annotations

STATE_DIR = ".pallet"
PARTIAL_DIR = ".pallet-partial"  # in any directory: rsync keeps an interrupted file there until a rerun completes it
WRITING_DIR = "writing"          # in STATE_DIR: files written from a stream, renamed into place once checked
TRANSFER_DIR = "transfer"        # in STATE_DIR: a transport's temporaries while files go one by one (rsync --temp-dir)


def reserved_problem(path: bytes) -> str | None:
    """Why relative ``path`` may not be in a tree or archive pallet moves (a name of its own state), or None."""
    parts = path.split(b"/")
    if parts[0] == STATE_DIR.encode():
        return f"the name {STATE_DIR} is reserved for pallet's state in a destination"
    if PARTIAL_DIR.encode() in parts:
        return f"the name {PARTIAL_DIR} is reserved for pallet's interrupted transfers"
    return None
