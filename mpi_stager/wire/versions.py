"""Protocol versions, the exit statuses a client acts on, and the error of a version no side shares."""
from __future__ import annotations

from bundles.errors import PalletError
# The bundle stream's version and its receiver's answer are defined beside that framing in bundles.stream_reply (the
# bundle format's streamed form is below mpi_stager) and listed here, so that this package names every version.
from bundles.stream_reply import STREAM_VERSION as STREAM_VERSION
from bundles.stream_reply import decode_resume_reply as decode_resume_reply
from bundles.stream_reply import encode_resume_reply as encode_resume_reply


# ---------------------------------------------------------------- versions (docs/wire.md, "Versions")

SESSION_VERSION = 3         # hello, requests and answers of `mpi_stager session`
MIN_SESSION_VERSION = 3     # the oldest session version this pallet speaks, as client and as far side
SUMMARY_VERSION = 1         # the far side's JSON summaries (below); readers read every version up to theirs
MIN_SUMMARY_VERSION = 0     # a summary without a version field (a pallet before versioned summaries) reads as 0
HOST_VERSION = 1            # `mpi_stager serve`: the host session's hello, requests and answers (wire/host.py)
MIN_HOST_VERSION = 1        # the oldest host-session version this pallet speaks, as client and as far side
TAR_TOOLS_VERSION = 2       # the shell scripts of the tar-tools route and their output
# STREAM_VERSION, the bundle stream's framing, is defined with that framing in bundles.stream (the bundle format's
# streamed form, below mpi_stager) and listed here: this module is the one place that names every version.

# Exit statuses of the far-side commands that a client acts on.
USAGE_ERROR = 2             # argparse: a command or option the far side does not know (a pallet before sessions)
SOURCE_MISSING = 3          # `mpi_stager send`: SRC does not exist
LOCKED = 4                  # another operation holds DEST's lock (bundles.errors.DestinationLocked)
RECEIVER_GONE = 5           # `send`, `receive`, `session`: the peer went away


class WireVersionError(PalletError):
    """The two sides speak no common version of a protocol, and falling back would not help: the hint names the
    fix (the same pallet on both sides)."""


def install_hint(where: str | None) -> str:
    """The fix for a far side of another version: `pallet remote install` of the host ``where`` names (an ssh
    URL gives ``ssh://[user@]host[:port]``, anything else HOST)."""
    from urllib.parse import urlsplit       # only for an error: a far side starts without it
    parts = urlsplit(where) if where and "://" in where else None
    host = f"ssh://{parts.netloc}" if parts is not None and parts.scheme == "ssh" and parts.netloc else "HOST"
    return f"install the same pallet version at the far side: `pallet remote install {host}`"
