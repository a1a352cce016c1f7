"""The bundle stream's version and its receiver's resume answer, apart from the framing: the wire names them cheaply."""
from __future__ import annotations

import json

from .errors import StreamError

STREAM_VERSION = 2                       # listed with every protocol version in mpi_stager.wire (docs/wire.md)


def encode_resume_reply(stream_id: str, done: dict[int, bytes]) -> bytes:
    """The receiver's answer to a skeleton, one JSON line: the shards (number -> hash) it already holds."""
    listed = {str(n): digest.hex() for n, digest in sorted(done.items())}
    return json.dumps({"stream": stream_id, "done": listed}).encode() + b"\n"


def decode_resume_reply(line: bytes, stream_id: str, source: str | None) -> dict[int, bytes]:
    """Decode the receiver's answer to the skeleton of ``stream_id``; StreamError naming ``source`` if it is not one."""
    try:
        reply = json.loads(line)
        if reply["stream"] != stream_id:
            raise ValueError(f"stream {reply['stream']}, not {stream_id}")
        return {int(number): bytes.fromhex(digest) for number, digest in reply["done"].items()}
    except (ValueError, KeyError, TypeError, AttributeError) as exc:
        raise StreamError(f"the receiver answered {bytes(line[:200])!r} ({exc})", source,
                          "check that both sides run the same pallet version, and that no shell startup file "
                          "prints to stdout") from None
