"""The far side's JSON summaries: typed records, one encoder, one versioned decoder."""
from __future__ import annotations

import json
from dataclasses import MISSING, asdict, dataclass, field, fields
from typing import Literal, overload


from bundles.errors import SummaryError

from .versions import MIN_SUMMARY_VERSION, SUMMARY_VERSION, install_hint


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
