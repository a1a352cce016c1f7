"""The hello: the versions and capabilities each side speaks, their agreement, and the version report."""
from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from .versions import MIN_SESSION_VERSION, MIN_SUMMARY_VERSION, SESSION_VERSION, STREAM_VERSION, SUMMARY_VERSION


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
