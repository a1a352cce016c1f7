"""The host session's wire: its hello, framed requests and answers, and the payloads of stat, list, put and get."""
from __future__ import annotations

import json
from collections.abc import Iterable
from typing import BinaryIO
from dataclasses import dataclass

from bundles.inline import InlineDirectory, InlineFile
from bundles.errors import DestinationError, DestinationLocked, PalletError, SourceError, StreamError, UsageError

from .versions import HOST_VERSION, MIN_HOST_VERSION, install_hint

# ---------------------------------------------------------------- hello (docs/wire.md, "The host session")

HOST_HELLO_PREFIX = b"pallet-host "     # the far side's hello line: ``pallet-host N host=LOW-HIGH caps=A,B``
HOST_HELLO_ENV = "PALLET_HOST_HELLO"    # the client's versions, ``host=LOW-HIGH``, in the command's environment
HOST_CAPS = frozenset({"stat", "list", "put", "get"})
MAX_LINE = 128                          # a request's or answer's header line, newline included


@dataclass(frozen=True)
class HostHello:
    """A far side's hello: the host-session version it speaks here (0: none in common) and what it has."""

    speaks: int
    low: int
    high: int
    caps: frozenset[str]

    def line(self) -> bytes:
        return HOST_HELLO_PREFIX + (f"{self.speaks} host={self.low}-{self.high} "
                                    f"caps={','.join(sorted(self.caps))}\n").encode()

    @classmethod
    def parse(cls, line: bytes) -> HostHello | None:
        """The hello on ``line``; None when it is none."""
        if not line.startswith(HOST_HELLO_PREFIX) or not line.endswith(b"\n"):
            return None
        first, *words = line[len(HOST_HELLO_PREFIX):].decode(errors="replace").split()
        fields = dict(word.partition("=")[::2] for word in words)
        low, _, high = fields.get("host", "").partition("-")
        if not first.isdigit() or not low.isdigit() or not (high or low).isdigit():
            return None
        return cls(int(first), int(low), int(high or low), frozenset(filter(None, fields.get("caps", "").split(","))))


def host_client_text() -> str:
    """The value of :data:`HOST_HELLO_ENV` this pallet sends."""
    return f"host={MIN_HOST_VERSION}-{HOST_VERSION}"


def far_hello(client: str | None) -> HostHello:
    """The far side's hello to a client whose :data:`HOST_HELLO_ENV` is ``client`` (None: it sent none)."""
    low, _, high = (client or "").removeprefix("host=").partition("-")
    speaks = 0
    if low.isdigit() and (high or low).isdigit():
        newest = min(HOST_VERSION, int(high or low))
        speaks = newest if newest >= max(MIN_HOST_VERSION, int(low)) else 0
    return HostHello(speaks, MIN_HOST_VERSION, HOST_VERSION, HOST_CAPS if speaks else frozenset())


# ---------------------------------------------------------------- framing

def frame(tag: str, payload: bytes = b"") -> bytes:
    """A request (``stat`` ...) or answer (``ok``, ``error``): ``TAG SIZE\\n`` and SIZE bytes."""
    return f"{tag} {len(payload)}\n".encode() + payload


def read_exactly(inp: BinaryIO, size: int, source: str) -> bytes:
    """``size`` bytes of ``inp``; StreamError when it ends before them."""
    data = inp.read(size)
    if len(data) != size:
        raise StreamError(f"a request ends after {len(data)} of {size} bytes", source, "rerun the operation")
    return data


def parse_header(line: bytes, source: str) -> tuple[str, int]:
    """``(tag, size)`` of a frame's header line; StreamError for anything else."""
    tag, _, size = line.strip().decode(errors="replace").partition(" ")
    if not line.endswith(b"\n") or not tag.isalpha() or not size.isdigit():
        raise StreamError(f"unexpected host-session line {line[:60]!r}", source, install_hint(source))
    return tag, int(size)


# ---------------------------------------------------------------- errors across the wire

class TooLarge(PalletError):
    """A ``get`` selection holds more bytes than its limit: the caller moves it another way."""


_KINDS: dict[str, type[PalletError]] = {"locked": DestinationLocked, "destination": DestinationError,
                                        "source": SourceError, "usage": UsageError, "stream": StreamError,
                                        "too-large": TooLarge}


def encode_error(error: PalletError) -> bytes:
    """An ``error`` answer's payload: the error's kind, message, path and hint."""
    kind = next((name for name, cls in _KINDS.items() if type(error) is cls), "error")
    if kind == "error":
        kind = next((name for name, cls in _KINDS.items() if isinstance(error, cls)), "error")
    return json.dumps({"kind": kind, "message": error.message, "path": error.path, "hint": error.hint}).encode()


def decode_error(payload: bytes, source: str) -> PalletError:
    """The PalletError an ``error`` answer carries (a StreamError when the payload is none)."""
    try:
        said = json.loads(payload)
        cls = _KINDS.get(said["kind"], PalletError)
        return cls(str(said["message"]), said.get("path") or source, said.get("hint"))
    except (ValueError, KeyError, TypeError):
        return StreamError(f"the far side's error cannot be read: {payload[:80]!r}", source, install_hint(source))


# ---------------------------------------------------------------- payloads

def encode_put(dest: str, files: Iterable[InlineFile], dirs: Iterable[InlineDirectory], wait: bool,
               contents: Iterable[bytes]) -> bytes:
    """A ``put`` payload: one JSON line (DEST, whether to wait for its lock, files, directories), then the
    files' bytes in their order."""
    head = {"dest": dest, "wait": wait, "files": [f.row() for f in files],
            "dirs": [[d.path, d.mode, d.mtime_ns] for d in dirs]}
    return json.dumps(head).encode() + b"\n" + b"".join(contents)


@dataclass(frozen=True)
class PutRequest:
    dest: str
    wait: bool
    files: list[InlineFile]
    dirs: list[InlineDirectory]
    body_at: int                # where the first file's bytes start in the payload


def decode_put(payload: bytes, source: str) -> PutRequest:
    head, at = _json_line(payload, source)
    try:
        files = [InlineFile.from_row(row) for row in head["files"]]
        dirs = [InlineDirectory(str(p), int(m), int(t)) for p, m, t in head["dirs"]]
        request = PutRequest(str(head["dest"]), bool(head["wait"]), files, dirs, at)
    except (KeyError, TypeError, ValueError):
        raise StreamError("a put request cannot be read", source, install_hint(source)) from None
    if at + sum(f.size for f in files if f.kind == "f") != len(payload):
        raise StreamError("a put request's bytes do not match its files' sizes", source, "rerun the operation")
    return request


def encode_get(root: str, paths: Iterable[str], limit: int) -> bytes:
    """A ``get`` payload: the root, the paths below it (files or directories, taken whole), and the most bytes
    the answer may carry (a larger selection is refused, kind ``too-large``)."""
    return json.dumps({"root": root, "paths": list(paths), "limit": limit}).encode()


def decode_get(payload: bytes, source: str) -> tuple[str, list[str], int]:
    try:
        said = json.loads(payload)
        return str(said["root"]), [str(p) for p in said["paths"]], int(said["limit"])
    except (ValueError, KeyError, TypeError):
        raise StreamError("a get request cannot be read", source, install_hint(source)) from None


def encode_files(files: Iterable[InlineFile], contents: Iterable[bytes]) -> bytes:
    """A ``get`` answer: one JSON line of the files (and links, and directories as kind ``d``), then the bytes."""
    return json.dumps([f.row() for f in files]).encode() + b"\n" + b"".join(contents)


def decode_files(payload: bytes, source: str) -> tuple[list[InlineFile], int]:
    """The files of a ``get`` answer and where their bytes start."""
    rows, at = _json_line(payload, source)
    try:
        files = [InlineFile.from_row(row) for row in rows]
    except (TypeError, ValueError):
        raise StreamError("a get answer cannot be read", source, install_hint(source)) from None
    if at + sum(f.size for f in files if f.kind == "f") != len(payload):
        raise StreamError("a get answer's bytes do not match its files' sizes", source, "rerun the operation")
    return files, at


def _json_line(payload: bytes, source: str) -> tuple:
    line, newline, _ = payload.partition(b"\n")
    try:
        if not newline:
            raise ValueError
        return json.loads(line), len(line) + 1
    except ValueError:
        raise StreamError("a host-session payload has no header line", source, install_hint(source)) from None
