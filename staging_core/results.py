"""What a push or pull did (StagingResult): the record the library returns and ``--json`` prints."""
from __future__ import annotations

from dataclasses import dataclass, field

from staging_core.planning.planner import Candidate, Plan


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
    ``would_delete`` what it would do. ``shard_levels``: a pushed stream's
    shards compressed at each level (level -> shards; its level is fitted
    to the link, staging_core.planning.level), in ``--json`` only then.
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
    shard_levels: dict[int, int] = field(default_factory=dict)

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
                **({"shard_levels": {str(k): v for k, v in self.shard_levels.items()}} if self.shard_levels else {}),
                **({} if self.would_send is None else {"would_send": list(self.would_send),
                                                       "would_delete": list(self.would_delete)})}
