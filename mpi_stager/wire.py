"""The far-side wire: every protocol version and message format pallet and its far side exchange (docs/wire.md)."""
from __future__ import annotations

import json
import shlex
from collections.abc import Mapping
from dataclasses import MISSING, asdict, dataclass, field, fields
from typing import Literal, overload
from urllib.parse import urlsplit

import zstandard

from bundles.errors import PalletError, StreamError, SummaryError
from bundles.index import decode_zstd_bounded
from bundles.journal import JOURNAL_KINDS
from bundles.state import STATE_DIR
# The bundle stream's version and its receiver's answer, listed here with the rest of the wire.
from bundles.stream import STREAM_VERSION as STREAM_VERSION
from bundles.stream import decode_resume_reply as decode_resume_reply
from bundles.stream import encode_resume_reply as encode_resume_reply

# ---------------------------------------------------------------- versions (docs/wire.md, "Versions")

SESSION_VERSION = 3         # hello, requests and answers of `mpi_stager session`
MIN_SESSION_VERSION = 3     # the oldest session version this pallet speaks, as client and as far side
SUMMARY_VERSION = 1         # the far side's JSON summaries (below); readers read every version up to theirs
MIN_SUMMARY_VERSION = 0     # a summary without a version field (a pallet before versioned summaries) reads as 0
TAR_TOOLS_VERSION = 1       # the shell scripts of the tar-tools route and their output
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
    parts = urlsplit(where) if where and "://" in where else None
    host = f"ssh://{parts.netloc}" if parts is not None and parts.scheme == "ssh" and parts.netloc else "HOST"
    return f"install the same pallet version at the far side: `pallet remote install {host}`"


# ---------------------------------------------------------------- the hello (docs/wire.md, "The hello")

HELLO_PREFIX = b"pallet-session "       # the far side's hello line starts so, in every session version
HELLO_ENV = "PALLET_HELLO"              # the client's hello, in the far-side command's environment
SESSION_CAPS = frozenset({"listing", "wait", "receive", "receive-new", "dirs", "clear"})


@dataclass(frozen=True)
class Versions:
    """The versions of one protocol a side speaks, ``low`` to ``high`` (both included)."""

    low: int
    high: int

    @classmethod
    def one(cls, version: int) -> Versions:
        return cls(version, version)

    @classmethod
    def parse(cls, text: str) -> Versions | None:
        """``N`` or ``LOW-HIGH``; None for anything else."""
        low, _, high = text.partition("-")
        if not low.isdigit() or not (high or low).isdigit() or int(low) > int(high or low):
            return None
        return cls(int(low), int(high or low))

    def encode(self) -> str:
        return str(self.high) if self.low == self.high else f"{self.low}-{self.high}"

    def common(self, other: Versions) -> int | None:
        """The newest version both speak; None when there is none."""
        newest = min(self.high, other.high)
        return newest if newest >= max(self.low, other.low) else None

    def __str__(self) -> str:
        return f"v{self.high}" if self.low == self.high else f"v{self.low} to v{self.high}"


@dataclass(frozen=True)
class Hello:
    """What one side says of itself: the versions it speaks of each protocol (None: it did not say) and
    capabilities (the far side's: what it has; the client's: what it wants). ``speaks`` is the session version
    a far side speaks in this session, the number its hello line opens with."""

    session: Versions
    summary: Versions | None = None
    stream: Versions | None = None
    caps: frozenset[str] = field(default_factory=frozenset)
    speaks: int = 0

    def far_line(self) -> bytes:
        """The far side's hello: ``pallet-session N session=.. summary=.. stream=.. caps=A,B\\n``."""
        return HELLO_PREFIX + f"{self.speaks} {self._words('caps')}\n".encode()

    def client_text(self) -> str:
        """The client's hello, the value of :data:`HELLO_ENV`: ``session=.. summary=.. stream=.. want=A,B``."""
        return self._words("want")

    def _words(self, caps_key: str) -> str:
        versions = [f"{name}={value.encode()}" for name, value in
                    (("session", self.session), ("summary", self.summary), ("stream", self.stream)) if value]
        return " ".join([*versions, f"{caps_key}={','.join(sorted(self.caps))}"])

    @classmethod
    def parse_far(cls, line: bytes) -> Hello | None:
        """A far side's hello line, of any session version (``pallet-session 2`` said only its version); None
        when ``line`` is none."""
        if not line.startswith(HELLO_PREFIX) or not line.endswith(b"\n"):
            return None
        first, *words = line[len(HELLO_PREFIX):].decode(errors="replace").split()
        if not first.isdigit():
            return None
        return cls._parsed(words, "caps", int(first))

    @classmethod
    def parse_client(cls, text: str) -> Hello | None:
        """A client's hello (:meth:`client_text`); None when it says no session versions."""
        return cls._parsed(text.split(), "want", 0)

    @classmethod
    def _parsed(cls, words: list[str], caps_key: str, speaks: int) -> Hello | None:
        values = dict(word.partition("=")[::2] for word in words)       # words a later version adds are ignored
        session = Versions.parse(values.get("session", "")) or (Versions.one(speaks) if speaks else None)
        if session is None:
            return None
        caps = frozenset(filter(None, values.get(caps_key, "").split(",")))
        return cls(session, Versions.parse(values.get("summary", "")), Versions.parse(values.get("stream", "")),
                   caps, speaks)


FAR_HELLO = Hello(Versions(MIN_SESSION_VERSION, SESSION_VERSION), Versions.one(SUMMARY_VERSION),
                  Versions.one(STREAM_VERSION), SESSION_CAPS, SESSION_VERSION)
HELLO = FAR_HELLO.far_line()            # what a far side answers a client that sent no hello


def client_hello(wants: frozenset[str] | set[str]) -> Hello:
    """This pallet's hello as a client that will use the capabilities ``wants``."""
    return Hello(Versions(MIN_SESSION_VERSION, SESSION_VERSION), Versions(MIN_SUMMARY_VERSION, SUMMARY_VERSION),
                 Versions.one(STREAM_VERSION), frozenset(wants))


@dataclass(frozen=True)
class Agreement:
    """What a client's and a far side's hellos agree on: the session version both speak, or why there is none
    (``protocol``, with each side's versions) and whether the far side is only older (``far_older``: what it
    had before sessions of this version, its separate commands, still serves)."""

    session: int = 0
    protocol: str = ""
    client: str = ""
    far: str = ""
    far_older: bool = False

    @property
    def ok(self) -> bool:
        return not self.protocol

    def problem(self, client_side: bool) -> str:
        """One line naming the protocol and both sides' versions, said by the client or by the far side."""
        if self.protocol == "capabilities":
            return f"the far side's session lacks {self.far}, which the client wants"
        if client_side:
            return f"the far side's pallet speaks {self.protocol} protocol {self.far}; this pallet speaks {self.client}"
        return f"the client's pallet speaks {self.protocol} protocol {self.client}; this far side speaks {self.far}"


def agree(client: Hello, far: Hello) -> Agreement:
    """The session version ``client`` and ``far`` both speak, checked in order: session versions (a far side
    older than the client is ``far_older``), stream and summary versions (when the far side names them), then
    the capabilities the client wants."""
    session = client.session.common(far.session)
    if session is None:
        return Agreement(0, "session", str(client.session), str(far.session), far.session.high < client.session.low)
    for name, mine, theirs in (("bundle stream", client.stream, far.stream), ("summary", client.summary, far.summary)):
        if mine is not None and theirs is not None and mine.common(theirs) is None:
            return Agreement(session, name, str(mine), str(theirs))
    lacking = client.caps - far.caps
    if lacking:
        return Agreement(session, "capabilities", "", ", ".join(sorted(lacking)), True)
    return Agreement(session)


def far_hello_for(client: Hello | None) -> tuple[Hello, Agreement]:
    """The hello a far side answers ``client`` (None: a client that sent none) with, and their agreement."""
    if client is None:
        return FAR_HELLO, Agreement(SESSION_VERSION)
    agreed = agree(client, FAR_HELLO)
    return Hello(FAR_HELLO.session, FAR_HELLO.summary, FAR_HELLO.stream, FAR_HELLO.caps,
                 agreed.session or SESSION_VERSION), agreed


def hello_env(hello: Hello) -> list[str]:
    """The words that put the client's ``hello`` in a far-side command's environment: ``env PALLET_HELLO=...``
    (a far side before hellos ignores it)."""
    return ["env", f"{HELLO_ENV}={hello.client_text()}"]


def client_hello_in(environ: Mapping[str, str]) -> Hello | None:
    """The client's hello in a far-side command's environment; None when it sent none (or none readable)."""
    text = environ.get(HELLO_ENV)
    return Hello.parse_client(text) if text else None


# ---------------------------------------------------------------- the version report (docs/wire.md)

# Run by a far-side Python (``PYTHON -c VERSION_REPORT``) that `pallet remote install`, `pallet remote status` and
# the probe ask which pallet it imports: one line EXECUTABLE<TAB>PALLET VERSION<TAB>STREAM<TAB>SESSION, SESSION the
# session versions it speaks as the hello writes them (``N`` or ``LOW-HIGH``), 0 from a pallet before this module.
# The client sends the code, so it reads whatever pallet is there; it fails (no line) where pallet is not.
VERSION_REPORT = """\
import sys, mpi_stager, bundles.stream as s
from importlib.metadata import version
try:
    from mpi_stager import wire as w
except ImportError:
    session = "0"
else:
    low = getattr(w, "MIN_SESSION_VERSION", w.SESSION_VERSION)
    session = "%d-%d" % (low, w.SESSION_VERSION) if low != w.SESSION_VERSION else str(low)
print(sys.executable, version("pallet"), s.STREAM_VERSION, session, sep="\\t")
"""


@dataclass(frozen=True)
class VersionReport:
    """What :data:`VERSION_REPORT` printed: a far-side Python, the pallet it imports and the versions that
    pallet speaks (``session`` ``Versions(0, 0)``: a pallet from before mpi_stager.wire)."""

    python: str
    pallet_version: str
    stream: int
    session: Versions

    @classmethod
    def parse(cls, line: str) -> VersionReport | None:
        """The report in ``line``; None when it is none. A line without the session field (a report from
        before it had one) reads as session 0."""
        words = line.rstrip("\n").split("\t")
        session = Versions.parse(words[3]) if len(words) == 4 else Versions.one(0) if len(words) == 3 else None
        if session is None or not words[2].isdigit():
            return None
        return cls(words[0], words[1], int(words[2]), session)

    def hello(self) -> Hello:
        """The hello this far side's sessions would write (the report does not say its summary versions or
        capabilities)."""
        return Hello(self.session, stream=Versions.one(self.stream), speaks=self.session.high)

    def agreement(self) -> Agreement:
        """What this pallet's hello and that far side's would agree on (:func:`agree`): its session versions
        (0: none, so it is older) and stream version against this pallet's."""
        return agree(client_hello(frozenset()), self.hello())


# ---------------------------------------------------------------- session requests and answers

OK = b"ok\n"
DECLINED = b"declined\n"            # the answer to ``receive-new`` in a DEST that holds something
LISTING_TAG = b"listing"
NOT_COMPARABLE = b"INCOMPLETE"      # the listing of a DEST marked incomplete: it resumes from its journal
MAX_LISTING_HEADER = 64


@dataclass(frozen=True)
class SessionRequest:
    """One request line to a session: ``receive [noverify]`` (a bundle stream follows, up to its index frame),
    ``receive-new [noverify]`` (the same, received only into a DEST the session listed empty: else only the
    stream's prelude and skeleton follow, which are read and dropped), ``dirs N`` (N bytes of directory
    metadata follow, see :func:`encode_dirs`) or ``clear``."""

    op: str
    verify: bool = True
    size: int = 0

    def encode(self) -> bytes:
        receiving = [] if self.verify else ["noverify"]
        words = {"receive": ["receive", *receiving], "receive-new": ["receive-new", *receiving],
                 "dirs": ["dirs", str(self.size)], "clear": ["clear"]}[self.op]
        return " ".join(words).encode() + b"\n"

    @classmethod
    def decode(cls, line: bytes, source: str) -> SessionRequest:
        """The request on ``line``; StreamError for anything else."""
        op, *rest = line.decode(errors="replace").split() or [""]
        if op in ("receive", "receive-new") and rest in ([], ["noverify"]):
            return cls(op, verify=not rest)
        if op == "dirs" and len(rest) == 1 and rest[0].isdigit():
            return cls(op, size=int(rest[0]))
        if op == "clear" and not rest:
            return cls(op)
        raise StreamError(f"unknown session request {line[:80]!r}", source, install_hint(None))


def encode_dirs(entries: list[tuple[bytes, int, int]]) -> bytes:
    """``dirs`` payload: per directory, its relative path, mode (octal) and mtime in ns, each NUL-terminated."""
    return b"".join(b"%s\0%o\0%d\0" % (path, mode, mtime) for path, mode, mtime in entries)


def decode_dirs(payload: bytes) -> list[tuple[bytes, int, int]]:
    """The entries of a ``dirs`` payload (:func:`encode_dirs`)."""
    parts = payload.split(b"\0")
    return [(parts[i], int(parts[i + 1], 8), int(parts[i + 2])) for i in range(0, len(parts) - 2, 3)]


def listing_block(listed: bytes) -> bytes:
    """A session's listing as it goes on the wire: ``listing N\\n`` and N bytes, one zstd frame of ``listed``."""
    block = zstandard.ZstdCompressor(level=1).compress(listed)
    return b"%s %d\n" % (LISTING_TAG, len(block)) + block


def listing_size(header: bytes) -> int | None:
    """The N of a ``listing N`` header line; None when ``header`` is no such line."""
    tag, _, size = header.strip().partition(b" ")
    return int(size) if tag == LISTING_TAG and size.isdigit() else None


def decode_listing(block: bytes, source: str) -> bytes:
    """The listing a block's N bytes hold (decoded within a bound of their size; StreamError if damaged)."""
    return decode_zstd_bounded(block, source, "the session's listing", StreamError, "rerun the push")


# ---------------------------------------------------------------- summaries (docs/wire.md, "Summaries")

# Adding a field older readers may ignore keeps SUMMARY_VERSION; renaming, removing or changing the type or meaning
# of one, or adding one readers need, raises it (a field added later has a default, so that older versions still
# read). A summary with no "summary" field comes from a pallet before versioned summaries: it reads as version 0
# (MIN_SUMMARY_VERSION), the same fields.

@dataclass(frozen=True)
class ReceiveSummary:
    """What one ``mpi_stager receive`` did (alone or in a session); its JSON is the last line on stdout.

    ``stream_bytes`` counts every byte read from the stream, ``data_bytes``
    the compressed shard bytes among them (skipped shards send none);
    ``max_rss_bytes`` is this process's peak resident memory.
    """

    dest: str
    stream_id: str
    shards_total: int
    shards_received: int
    shards_skipped: int
    files: int
    file_bytes: int
    stream_bytes: int
    data_bytes: int
    verified: bool
    max_rss_bytes: int
    seconds: float


@dataclass(frozen=True)
class StagerSummary:
    """What one ``mpi_stager unpack`` did, the same on every rank; ``errors`` (every rank's) stay on this side of
    the wire: a summary is printed only after a success."""

    dest: str
    ranks: int
    shards_total: int
    shards_skipped: int
    shards_done: int
    files: int
    file_bytes: int
    seconds: float
    errors: list[str] = field(default_factory=list, metadata={"wire": False})

    @property
    def ok(self) -> bool:
        return not self.errors


@dataclass(frozen=True)
class PackSummary:
    """What one ``mpi_stager pack`` did, the same on every rank."""

    bundle: str
    ranks: int
    entries: int
    shards: int
    bundle_bytes: int
    seconds: float


Summary = ReceiveSummary | StagerSummary | PackSummary
KINDS: dict[str, type] = {"receive": ReceiveSummary, "unpack": StagerSummary, "pack": PackSummary}

_TYPES = {"str": (str,), "int": (int,), "bool": (bool,), "float": (int, float)}


def encode_summary(summary: Summary) -> str:
    """``summary`` as one JSON line (no newline): ``{"summary": SUMMARY_VERSION, "kind": KIND, FIELD: VALUE...}``,
    without the fields that stay local."""
    kind = next(name for name, cls in KINDS.items() if type(summary) is cls)
    values = asdict(summary)
    sent = {f.name: values[f.name] for f in fields(summary) if f.metadata.get("wire", True)}
    return json.dumps({"summary": SUMMARY_VERSION, "kind": kind, **sent})


@overload
def decode_summary(output: bytes | str, kind: Literal["receive"], where: str) -> ReceiveSummary: ...
@overload
def decode_summary(output: bytes | str, kind: Literal["unpack"], where: str) -> StagerSummary: ...
@overload
def decode_summary(output: bytes | str, kind: Literal["pack"], where: str) -> PackSummary: ...
@overload
def decode_summary(output: bytes | str, kind: str, where: str) -> Summary: ...


def decode_summary(output: bytes | str, kind: str, where: str) -> Summary:
    """The ``kind`` summary (a key of :data:`KINDS`) on the last non-blank line of a far side's ``output``.

    A line without a ``summary`` field reads as version 0 (a pallet before
    versioned summaries) and one with it must name ``kind``; fields this
    pallet does not know are ignored. SummaryError naming ``where`` (the
    far side) when there is no such line, it is not a JSON object, a field
    it needs is missing or of the wrong type, or its version is newer than
    :data:`SUMMARY_VERSION`.
    """
    cls = KINDS[kind]
    text = output.decode(errors="replace") if isinstance(output, bytes) else output
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    what = f"the far side's mpi_stager {kind}"
    same = install_hint(where)
    if not lines:
        raise SummaryError(f"{what} printed no summary", where, same)
    try:
        doc = json.loads(lines[-1])
    except (ValueError, RecursionError):
        doc = None
    if not isinstance(doc, dict):
        raise SummaryError(f"{what} printed no readable summary (its last line: {lines[-1][:80]!r})", where, same)
    version = doc.get("summary", MIN_SUMMARY_VERSION)
    if type(version) is not int or version < MIN_SUMMARY_VERSION:
        raise SummaryError(f"{what} printed a summary of no version ({version!r})", where, same)
    if version > SUMMARY_VERSION:
        raise SummaryError(f"{what} printed a summary of version {version}; this pallet reads summary versions "
                           f"up to {SUMMARY_VERSION}", where, same)
    if version >= 1 and doc.get("kind") != kind:
        raise SummaryError(f"{what} printed a summary of kind {doc.get('kind')!r}, not {kind!r}", where, same)
    return cls(**_fields(cls, doc, f"the far side's {kind} summary (version {version})", where, same))


def _fields(cls: type, doc: dict, what: str, where: str, hint: str) -> dict[str, object]:
    """The values of ``cls``'s wire fields in ``doc``, checked."""
    wired = [spec for spec in fields(cls) if spec.metadata.get("wire", True)]
    missing = [spec.name for spec in wired
               if spec.name not in doc and spec.default is MISSING and spec.default_factory is MISSING]
    if missing:
        raise SummaryError(f"{what} lacks {', '.join(missing)}", where, hint)
    values = {spec.name: _typed(doc[spec.name], str(spec.type)) for spec in wired if spec.name in doc}
    wrong = [f"{name} ({type(doc[name]).__name__}, not {spec.type})" for spec in wired
             if (name := spec.name) in values and values[name] is _WRONG]
    if wrong:
        raise SummaryError(f"{what} has fields of the wrong type: {', '.join(wrong)}", where, hint)
    return values


_WRONG = object()


def _typed(value: object, kind: str) -> object:
    """``value`` as a field of type ``kind`` (a key of _TYPES) holds it; _WRONG when it is of another type."""
    accepted = _TYPES[kind]
    if not isinstance(value, accepted) or (isinstance(value, bool) and bool not in accepted):
        return _WRONG
    return float(value) if kind == "float" and isinstance(value, int) else value


# ---------------------------------------------------------------- the listing record (docs/wire.md, "Listing")

# Every entry under DEST except DEST/.pallet as 8 NUL-terminated fields, as GNU find's -printf writes them. The
# session lists with it, and so does every tar-tools script and repair command that lists a far-side tree.
LISTING_FIELDS = ("type", "mode", "mtime", "size", "link target", "inode", "links", "path")
LISTING_ARGV = ("find", ".", "-mindepth", "1", "-path", "./" + STATE_DIR, "-prune", "-o",
                "-printf", r"%y\0%m\0%T@\0%s\0%l\0%i\0%n\0%P\0")
FIND_RECORDS = shlex.join(LISTING_ARGV)


@dataclass(frozen=True)
class FarEntry:
    """One entry of the far side's tree as a listing record reports it."""

    kind: str            # f, d, l (or another find %y letter)
    mode: int
    mtime_ns: int
    size: int
    target: bytes
    inode: int = 0
    links: int = 1


def parse_records(records: bytes) -> dict[bytes, FarEntry]:
    """Relative path -> FarEntry, from listing records (the NUL-terminated :data:`LISTING_FIELDS` each)."""
    parts, entries, width = records.split(b"\0"), {}, len(LISTING_FIELDS)
    for at in range(0, len(parts) - width + 1, width):
        kind, mode, mtime, size, target, inode, links, path = parts[at:at + width]
        entries[path] = FarEntry(kind.decode(), int(mode, 8), _mtime_ns(mtime), int(size), target, int(inode),
                                 int(links))
    return entries


def _mtime_ns(text: bytes) -> int:
    """find's ``%T@`` (seconds with a fraction) in ns; one int() for the usual, non-negative case."""
    seconds, _, fraction = text.partition(b".")
    if not seconds.startswith(b"-"):
        return int(seconds + fraction[:9].ljust(9, b"0"))
    return int(seconds) * 1_000_000_000 - int((fraction[:9] or b"0").ljust(9, b"0"))


# ---------------------------------------------------------------- the tar-tools scripts (docs/wire.md)

TAR_TOOLS_LINE = b"pallet-tar-tools %d\n" % TAR_TOOLS_VERSION     # each script's first output line
MANIFEST_END = b"E\0\0\0\0\0\0\0\0"     # ends the records of the "list" script: a record of its own

_SCRIPTS = {
    # $1 DEST; md5 of the NUL-separated ./names on stdin (none when stdin is empty). Prints listing records, an
    # "E" record, then md5sum lines. It holds a flock on DEST/.pallet, as the session script does: a far-side tar
    # outlives a push killed with -9 until its input ends.
    "list": r"""
cd -- "$1" 2>/dev/null || { printf 'E\0\0\0\0\0\0\0\0'; exit 0; }
if [ -d .pallet ] && [ ! -L .pallet ]; then     # wait for a tar of a killed push that is still writing
  exec 9<.pallet; flock -w 600 9 || { echo "pallet: an earlier transfer into $1 is still running" >&2; exit 6; }
fi
""" + FIND_RECORDS + r"""
printf 'E\0\0\0\0\0\0\0\0'
xargs -0 -r md5sum --
""",
    # $1 SRC, $2 compressor ("zstd -q -c", "gzip -c" or "cat"): the NUL-separated ./names on stdin, as one posix
    # tar (exit 3: no SRC).
    "send": r"""
cd -- "$1" || exit 3
tar -c --null --no-recursion -T - -f - --format=posix --numeric-owner | $2
""",
    # $1 DEST, $2 decoder, with the far side's own tools (GNU tar, coreutils, util-linux). It makes DEST, checks
    # DEST/.pallet is a directory of ours, waits on a flock of it (a tar of a killed push may still be writing),
    # and replies with the tree's listing records. Then one command per line on stdin:
    #   H N   hash the N bytes of NUL-separated ./names that follow; reply with md5sum lines
    #   T     mark DEST incomplete; extract one run of tar shards sent as frames "SIZE\n" + SIZE bytes, ended by
    #         "0\n"; the first T starts a background md5sum fed by V, so checking overlaps the next extraction
    #   V N   queue the N bytes of NUL-separated ./names that follow (files already extracted) for that md5sum
    #   W     wait for the queued md5sums; reply with their lines
    #   F C   done: remove the INCOMPLETE mark (C=1: all of DEST/.pallet, else only if that empties it); reply
    #         "done"
    # A reply is its length in bytes on one line, then the bytes. End of input before F: the pusher is gone
    # (exit 9). Exit 5, 6, 8: the script's own refusals (message on stderr).
    "session": (r"""
set -u
fail() { echo "pallet: $1" >&2; exit "$2"; }
mkdir -p -- "$1" 2>/dev/null && cd -- "$1" || fail "cannot create or enter $1" 5
if [ -L .pallet ] || { [ -e .pallet ] && { [ ! -d .pallet ] || [ ! -O .pallet ]; }; }; then
  fail "$1/.pallet is not a directory of yours; remove it" 5
fi
mkdir -p .pallet && exec 9<.pallet || fail "cannot create $1/.pallet" 5
flock -w 600 9 || fail "an earlier transfer into $1 is still running" 6
rm -f .pallet/list .pallet/sums .pallet/queue .pallet/checked
reply() { wc -c < "$1"; cat -- "$1"; }
""" + FIND_RECORDS + r""" > .pallet/list
reply .pallet/list
checker=
while read -r command size; do
  case $command in
  H) head -c "$size" | xargs -0 -r md5sum -- > .pallet/sums 2>/dev/null; reply .pallet/sums ;;
  T) if [ -z "$checker" ]; then
       rm -rf JOURNALS && : > .pallet/INCOMPLETE && mkfifo .pallet/queue \
         && exec 8<>.pallet/queue || fail "cannot write in $1" 5
       xargs -0 -r -n 2048 md5sum -- < .pallet/queue > .pallet/checked 2>/dev/null 8>&- &
       checker=$!
     fi
     while read -r frame && [ "$frame" != 0 ]; do head -c "$frame" || exit 1; done 8>&- \
       | $2 8>&- | tar -x -p --no-same-owner -f - 8>&- || exit 7 ;;
  V) head -c "$size" >&8 ;;
  W) exec 8>&-; wait "$checker"; checker=; rm -f .pallet/queue; reply .pallet/checked ;;
  F) rm -f .pallet/INCOMPLETE .pallet/list .pallet/sums .pallet/checked
     if [ "$size" = 1 ]; then rm -rf .pallet; else rmdir .pallet 2>/dev/null; fi
     printf '4\ndone'; exit 0 ;;
  *) fail "unexpected command from the pusher" 8 ;;
  esac
done
exit 9
""").replace("JOURNALS", " ".join(f".pallet/{kind}*" for kind in JOURNAL_KINDS)),
}


def tar_tools_script(name: str) -> str:
    """The tar-tools script ``name`` ("list", "send" or "session"), run as ``sh -c SCRIPT pallet-NAME ARGS``: it
    first prints :data:`TAR_TOOLS_LINE`, which the client checks (:func:`check_tar_tools_line`)."""
    return (f"# pallet tar-tools {name} script, version {TAR_TOOLS_VERSION}\n"
            f"printf 'pallet-tar-tools %s\\n' {TAR_TOOLS_VERSION}" + _SCRIPTS[name])


def check_tar_tools_line(line: bytes, where: str) -> None:
    """Raise StreamError unless ``line`` (not empty: an empty one is a far side that failed first, whose status
    says why) is this version's :data:`TAR_TOOLS_LINE`."""
    if line and line != TAR_TOOLS_LINE:
        said = line[:60].decode(errors="replace").strip()
        raise StreamError(f"the far side's tar-tools script answered {said!r}, not "
                          f"{TAR_TOOLS_LINE.decode().strip()!r}", where,
                          "check that nothing there prints to stdout in non-interactive shells, then rerun")


def strip_tar_tools_line(output: bytes, where: str) -> bytes:
    """A script's whole output without its version line (checked)."""
    line, _, rest = output.partition(b"\n")
    check_tar_tools_line(line + b"\n", where)
    return rest
