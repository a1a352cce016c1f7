"""The unpack journal: one record per finished shard and a log per run, kept until the unpack succeeds."""
from __future__ import annotations

import os
import time
from dataclasses import dataclass

from bundles.extract import destination_error
from bundles.index import Index, content_hash
from bundles.state import ensure_state_dir, state_path


def bundle_id(index: Index) -> str:
    """A short identity of a bundle's content: the hash of its shard hashes."""
    return content_hash(b"".join(s.hash for s in index.shards)).hex()[:24]


@dataclass(frozen=True)
class Journal:
    """Files under ``root`` (default DEST/.pallet/journal-ID; DEST/.pallet/stream-SID for a bundle
    stream) recording progress of one bundle into one DEST.

    ``shard-NNNNNN`` exists once shard N is completely written (its content
    is the shard's hash, so a record from another bundle never counts);
    ``runs/RUN.rankR`` lists the shards rank R extracted in run RUN. The
    unpack removes the journal when it succeeds (see bundles.state.finish):
    it only ever serves a rerun after a failure.
    """

    root: str

    @classmethod
    def for_destination(cls, dest: str, index: Index, journal_dir: str | None = None) -> "Journal":
        return cls(journal_dir or state_path(dest, f"journal-{bundle_id(index)}"))

    @classmethod
    def for_stream(cls, dest: str, stream_id: str) -> "Journal":
        """The journal of a bundle stream (see bundles.stream): keyed by its stream id, since the shard
        hashes are not known before the shards arrive."""
        return cls(state_path(dest, f"stream-{stream_id}"))

    def create(self, dest: str) -> None:
        """Make the journal's directories (checking DEST/.pallet first when the journal lives there);
        DestinationError naming the journal if they cannot be made."""
        if os.path.dirname(os.path.abspath(self.root)) == os.path.abspath(state_path(dest)):
            ensure_state_dir(dest)
        try:
            os.makedirs(os.path.join(self.root, "runs"), exist_ok=True)
        except OSError as exc:
            raise destination_error(exc, os.fsencode(self.root)) from None

    def finished_shards(self, index: Index) -> set[int]:
        """Shards recorded as finished with a hash that matches ``index``."""
        return {number for number, digest in self.recorded_shards().items()
                if number < len(index.shards) and digest == index.shards[number].hash}

    def recorded_shards(self) -> dict[int, bytes]:
        """Every shard recorded as finished, with the hash it was recorded with."""
        try:
            names = os.listdir(self.root)
        except FileNotFoundError:
            return {}
        recorded = {}
        for name in names:
            if name.startswith("shard-") and name[6:].isdigit():
                try:
                    recorded[int(name[6:])] = bytes.fromhex(_read(os.path.join(self.root, name)))
                except ValueError:
                    continue
        return recorded

    def record_shard(self, index: Index, number: int, run: str, rank: int) -> None:
        """Record shard ``number`` as finished by ``rank`` in ``run``; DestinationError naming the record if
        the destination's file system fails."""
        path = os.path.join(self.root, f"shard-{number:06d}")
        try:
            with open(path + f".tmp{rank}", "w") as handle:
                handle.write(index.shards[number].hash.hex())
            os.replace(path + f".tmp{rank}", path)
            with open(os.path.join(self.root, "runs", f"{run}.rank{rank}"), "a") as handle:
                handle.write(f"{number}\n")
        except OSError as exc:
            raise destination_error(exc, os.fsencode(path)) from None

    def run_log(self) -> dict[str, list[int]]:
        """Shards extracted per run (all ranks merged), for inspection and tests."""
        runs: dict[str, list[int]] = {}
        directory = os.path.join(self.root, "runs")
        for name in sorted(os.listdir(directory)) if os.path.isdir(directory) else []:
            run = name.rsplit(".rank", 1)[0]
            runs.setdefault(run, []).extend(int(line) for line in _read(os.path.join(directory, name)).split())
        return runs


def new_run_name() -> str:
    """A sortable name for one unpack run."""
    return time.strftime("%Y%m%dT%H%M%S") + f"-{os.getpid()}"


def _read(path: str) -> str:
    try:
        with open(path) as handle:
            return handle.read().strip()
    except OSError:
        return ""
