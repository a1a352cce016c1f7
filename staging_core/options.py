"""What push and pull are asked to do (StagingOptions) and what they did (StagingResult)."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Mapping

from staging_core.planning.planner import LARGE_FILE_BYTES, Candidate, Plan

STRATEGIES = ("auto", "individual", "bundle", "hybrid")
STREAM_MODES = ("auto", "on", "off")


class _GroupView:
    """A read-only attribute of StagingOptions: the group named ``kind`` (a dataclass of this module) with the
    option's values."""

    def __init__(self, kind: str):
        self.kind = kind

    def __get__(self, options, owner=None):
        return self if options is None else _group(options, globals()[self.kind])


@dataclass(frozen=True)
class StagingOptions:
    """How to push or pull: one flat record, as callers build it, whose fields fall into five groups, each
    also a typed view (``planning``, ``routing``, ``far_side``, ``transports``, ``policy``; see
    :data:`OPTION_GROUPS`) and each a section of ``pallet push --help``. ``from_groups`` builds one from
    groups.

    strategy      'auto' asks the planner; 'individual', 'bundle', 'hybrid' override it.
    codec         bundle codec (None: the plan's choice, zstd for pulls).
    shard_size    target uncompressed shard size (None: automatic, see bundles.shards.auto_shard_size).
    large_file_bytes  files at least this big travel individually in a hybrid plan.
    jobs          local worker processes (0: automatic, one per CPU, or none for small work).
    ranks         unpack/pack processes at the far side (``--workers N``, or ``-n N`` for the launcher).
    launcher      command prefix that starts mpi_stager there, e.g. ``mpirun -n 4`` or ``srun -n 64``.
    remote_python Python with pallet installed at the far side.
    ssh_options   extra ssh arguments for every ssh connection pallet opens.
    verify        check every file against the index hash when unpacking.
    profile       link profile name for the planner (None: documented defaults).
    stream        'auto' streams bundles when the transport can, 'on' insists, 'off' stores and forwards.
    unpack_via    ssh URL of a host that sees the destination's file system and unpacks there
                  (for GridFTP and Globus destinations).
    unpack_job    'slurm': submit the unpack as a batch job through ``unpack_via`` and wait for it.
    job_options   extra ``#SBATCH`` lines for the ``unpack.sbatch`` of ``unpack_job`` and ``keep_packed``.
    keep_packed   leave the bundle, its index and an ``unpack.sbatch`` in DEST/.pallet/incoming instead of unpacking.
    pack_via      ssh URL of a host that sees a pull source's file system and packs there.
    retries       attempts after the first for errors marked retryable (network trouble).
    progress      draw per-stage progress on stderr (None: only on a terminal).
    reprobe       probe an ssh far side again instead of using its cached findings (staging_core.far_side.probe).
    delete        after a whole-tree push, remove what DEST holds that the source lacks.
    dry_run       push and pull: list what would be sent or fetched (and deleted), change nothing.
    checksum      when comparing with DEST, also compare by md5 the files whose size, mtime and mode match.
    allow_root_dest  let a whole-tree push's or pull's DEST be '/' or a home directory itself (see
                  ``transports.base.broad_destination``); refused by default (``--allow-root-dest``).
    transport_options  per scheme, keyword arguments for that scheme's transport (see
                  ``Transport.options_from``): how a transport pallet does not know gets its own options.
    """

    strategy: str = "auto"
    codec: str | None = None
    shard_size: int | None = None
    large_file_bytes: int = LARGE_FILE_BYTES
    jobs: int = 0
    ranks: int = 1
    launcher: str | None = None
    remote_python: str = "python3"
    ssh_options: tuple[str, ...] = ()
    verify: bool = True
    profile: str | None = None
    stream: str = "auto"
    unpack_via: str | None = None
    unpack_job: str | None = None
    job_options: tuple[str, ...] = ()
    keep_packed: bool = False
    pack_via: str | None = None
    retries: int = 2
    progress: bool | None = None
    reprobe: bool = False
    delete: bool = False
    dry_run: bool = False
    checksum: bool = False
    allow_root_dest: bool = False
    transport_options: Mapping[str, Mapping[str, Any]] = field(default_factory=dict, hash=False)

    # the groups, each as its own typed record (read-only views; see OPTION_GROUPS)
    planning = _GroupView("PlanningOptions")
    routing = _GroupView("RoutingOptions")
    far_side = _GroupView("FarSideOptions")
    transports = _GroupView("TransportOptions")
    policy = _GroupView("PolicyOptions")

    @classmethod
    def from_groups(cls, *groups) -> "StagingOptions":
        """StagingOptions made of option groups (any of PlanningOptions, RoutingOptions, FarSideOptions,
        TransportOptions, PolicyOptions; the defaults for a group not given)."""
        values: dict[str, Any] = {}
        for group in groups:
            values.update({name: getattr(group, name) for name in _names(type(group))})
        return cls(**values)


def _group_class(name: str, doc: str, names: tuple[str, ...]) -> type:
    """A frozen dataclass holding the fields ``names`` of StagingOptions, with their types and defaults."""
    declared = {f.name: f for f in dataclasses.fields(StagingOptions)}
    spec = []
    for option in names:
        own = declared[option]
        default = (dataclasses.field(default_factory=own.default_factory, hash=own.hash)
                   if own.default is dataclasses.MISSING else dataclasses.field(default=own.default))
        spec.append((option, own.type, default))
    kind = dataclasses.make_dataclass(name, spec, frozen=True)
    kind.__module__, kind.__doc__ = __name__, doc          # found by pickle (Parsl ships options to workers)
    return kind


PlanningOptions = _group_class(
    "PlanningOptions", "What the planner decides with, and the bundle it makes (see StagingOptions).",
    ("strategy", "codec", "shard_size", "large_file_bytes", "profile", "jobs"))
RoutingOptions = _group_class(
    "RoutingOptions", "Where and how a bundle is unpacked or packed; each route checks its own "
                      "(staging_core.routes.registry).",
    ("stream", "unpack_via", "unpack_job", "job_options", "keep_packed", "pack_via"))
FarSideOptions = _group_class(
    "FarSideOptions", "How pallet runs at the far side.", ("remote_python", "ranks", "launcher", "reprobe"))
TransportOptions = _group_class(
    "TransportOptions", "What the transports are given: the ssh transport's options, and per scheme what each "
                        "transport declares in Transport.options_from.", ("ssh_options", "transport_options"))
PolicyOptions = _group_class(
    "PolicyOptions", "What an operation guarantees and shows.",
    ("verify", "retries", "progress", "delete", "dry_run", "checksum", "allow_root_dest"))
OPTION_GROUPS = (PlanningOptions, RoutingOptions, FarSideOptions, TransportOptions, PolicyOptions)


def _names(kind: type) -> list[str]:
    return list(kind.__dataclass_fields__)


def _group(options: StagingOptions, kind: type):
    return kind(**{name: getattr(options, name) for name in _names(kind)})


@dataclass(frozen=True)
class StagingResult:
    """What a push or pull did.

    ``strategy`` is what ran (the plan may have proposed another when
    overridden), ``route`` how the bundle was packed/unpacked (e.g.
    'stream', 'in-place', 'via ssh://host', 'slurm job 123', 'kept packed';
    'already in place' when DEST needed nothing; 'dry run'), ``transfers``
    the number of transport transfers made, ``stage_seconds`` wall seconds
    per stage, ``skipped_shards`` shards found finished by an earlier run and
    not sent or unpacked again. One rule on every route: ``files`` (of
    ``file_bytes``) are the source's regular files sent, ``in_place`` those
    found at DEST as they are (together, the source's regular files; links
    and directories are entries, not files), ``deleted`` DEST entries removed
    by ``delete``; ``offered_bytes`` what a
    push's far-side session was offered and declined (the skeleton of the
    whole tree, sent before DEST's listing came back and found DEST not
    empty; not in ``bytes_sent``); a dry run lists in ``would_send`` and
    ``would_delete`` what it would do.
    """

    dest: str
    plan: Plan
    strategy: str
    route: str
    files: int
    file_bytes: int
    transfers: int
    seconds: float
    stage_seconds: dict[str, float] = field(default_factory=dict)
    skipped_shards: int = 0
    attempts: int = 1
    bytes_sent: int | None = None
    in_place: int = 0
    deleted: int = 0
    offered_bytes: int = 0
    would_send: tuple[str, ...] | None = None
    would_delete: tuple[str, ...] = ()

    @property
    def sent_nothing(self) -> bool:
        """True when no file was sent and no transfer made: DEST held the source's files already."""
        return self.files == 0 and self.transfers == 0 and self.would_send is None

    @property
    def predicted(self) -> Candidate | None:
        """The plan's candidate for the strategy that ran (its predicted range), None when nothing was sent."""
        if self.sent_nothing or self.would_send is not None:
            return None
        return next((c for c in self.plan.candidates if c.strategy == self.strategy), None)

    def to_json(self) -> dict:
        """The ``--json`` summary."""
        predicted = self.predicted
        return {"dest": self.dest, "strategy": self.strategy, "planned": self.plan.strategy, "route": self.route,
                "predicted_range": None if predicted is None else [round(predicted.low_seconds, 3),
                                                                   round(predicted.high_seconds, 3)],
                "files": self.files, "file_bytes": self.file_bytes, "transfers": self.transfers,
                "seconds": round(self.seconds, 3),
                "stage_seconds": {k: round(v, 3) for k, v in self.stage_seconds.items()},
                "skipped_shards": self.skipped_shards, "attempts": self.attempts, "bytes_sent": self.bytes_sent,
                "in_place": self.in_place, "deleted": self.deleted, "offered_bytes": self.offered_bytes,
                **({} if self.would_send is None else {"would_send": list(self.would_send),
                                                       "would_delete": list(self.would_delete)})}
