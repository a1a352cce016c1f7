"""The far side's JSON summaries (receive, unpack, pack): their typed records, one encoder, one versioned decoder."""
from __future__ import annotations

import json
from dataclasses import MISSING, asdict, dataclass, field, fields
from typing import Union
from urllib.parse import urlsplit

from bundles.errors import SummaryError

SOURCE_MISSING = 3                # exit status of `mpi_stager send` when SRC does not exist
RECEIVER_GONE = 5                 # exit status of `mpi_stager send` (and receive, session) when its peer went away

# The summary format's version (docs/bundle-format.md §9). Adding a field older readers may ignore keeps it;
# renaming, removing or changing the type or meaning of one, or adding one readers need, raises it (a field
# added later has a default, so that older versions still read). A summary with no "summary" field comes from
# a pallet before versioned summaries: it reads as version 0, the same fields.
SUMMARY_VERSION = 1

_SAME_PALLET = "install the same pallet version at the far side: `pallet remote install {host}`"


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


Summary = Union[ReceiveSummary, StagerSummary, PackSummary]
KINDS: dict[str, type] = {"receive": ReceiveSummary, "unpack": StagerSummary, "pack": PackSummary}

_TYPES = {"str": (str,), "int": (int,), "bool": (bool,), "float": (int, float)}


def encode(summary: Summary) -> str:
    """``summary`` as one JSON line (no newline): ``{"summary": SUMMARY_VERSION, "kind": KIND, FIELD: VALUE...}``,
    without the fields that stay local."""
    kind = next(name for name, cls in KINDS.items() if type(summary) is cls)
    values = asdict(summary)
    wire = {f.name: values[f.name] for f in fields(summary) if f.metadata.get("wire", True)}
    return json.dumps({"summary": SUMMARY_VERSION, "kind": kind, **wire})


def decode(output: bytes | str, kind: str, where: str) -> Summary:
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
    same = _SAME_PALLET.format(host=_host(where))
    if not lines:
        raise SummaryError(f"{what} printed no summary", where, same)
    try:
        doc = json.loads(lines[-1])
    except (ValueError, RecursionError):
        doc = None
    if not isinstance(doc, dict):
        raise SummaryError(f"{what} printed no readable summary (its last line: {lines[-1][:80]!r})", where, same)
    version = doc.get("summary", 0)
    if type(version) is not int or version < 0:
        raise SummaryError(f"{what} printed a summary of no version ({version!r})", where, same)
    if version > SUMMARY_VERSION:
        raise SummaryError(f"{what} printed a summary of version {version}; this pallet reads summary versions "
                           f"up to {SUMMARY_VERSION}", where, same)
    if version >= 1 and doc.get("kind") != kind:
        raise SummaryError(f"{what} printed a summary of kind {doc.get('kind')!r}, not {kind!r}", where, same)
    return cls(**_fields(cls, doc, f"the far side's {kind} summary (version {version})", where, same))


def _fields(cls: type, doc: dict, what: str, where: str, hint: str) -> dict:
    """The values of ``cls``'s wire fields in ``doc``, checked."""
    values, missing, wrong = {}, [], []
    for spec in fields(cls):
        if not spec.metadata.get("wire", True):
            continue
        if spec.name not in doc:
            if spec.default is MISSING and spec.default_factory is MISSING:
                missing.append(spec.name)
            continue
        value = doc[spec.name]
        accepted = _TYPES[spec.type]
        if not isinstance(value, accepted) or (isinstance(value, bool) and bool not in accepted):
            wrong.append(f"{spec.name} ({type(value).__name__}, not {spec.type})")
        else:
            values[spec.name] = float(value) if spec.type == "float" else value
    if missing:
        raise SummaryError(f"{what} lacks {', '.join(missing)}", where, hint)
    if wrong:
        raise SummaryError(f"{what} has fields of the wrong type: {', '.join(wrong)}", where, hint)
    return values


def _host(where: str) -> str:
    """What `pallet remote install` takes to reach ``where`` (an ssh URL's ``ssh://[user@]host[:port]``), else
    HOST."""
    parts = urlsplit(where) if "://" in where else None
    return f"ssh://{parts.netloc}" if parts is not None and parts.scheme == "ssh" and parts.netloc else "HOST"
