"""The unpack journal: one record per finished shard and a log per run, kept until the unpack succeeds."""
from __future__ import annotations

import os
import time
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Iterator

from bundles.extract import destination_error
from bundles.index import Index, content_hash
from bundles.reserved import STATE_DIR
from bundles.state import state_path
from bundles.state_fd import append_text, open_private_dir, read_text, state_dir_fd, write_new


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
        """Make the journal's directories (DEST/.pallet checked first when the journal lives there);
        DestinationError naming the journal if they cannot be made or trusted."""
        try:
            with self._directories(make=True):
                pass
        except OSError as exc:
            raise destination_error(exc, os.fsencode(self.root)) from None

    @contextmanager
    def _directories(self, make: bool = False) -> Iterator[tuple[int, int]]:
        """The journal's directory and its ``runs`` as descriptors, for the block. They are reached without
        following a link: from a descriptor of DEST through DEST/.pallet when the journal lives there, else
        (``--journal DIR``) from the directory's path, whose last step is not followed either. Each must be
        this user's and writable only by them (DestinationError). FileNotFoundError without ``make`` when
        the journal does not exist."""
        parent, name = os.path.split(os.path.abspath(self.root))
        if os.path.basename(parent) == STATE_DIR:
            with state_dir_fd(os.path.dirname(parent), create=make) as state:
                journal = open_private_dir(name, state, self.root, make)
        else:
            if make:
                os.makedirs(parent, exist_ok=True)
            journal = open_private_dir(self.root, None, self.root, make)
        try:
            runs = open_private_dir("runs", journal, os.path.join(self.root, "runs"), make)
            try:
                yield journal, runs
            finally:
                os.close(runs)
        finally:
            os.close(journal)

    def finished_shards(self, index: Index) -> set[int]:
        """Shards recorded as finished with a hash that matches ``index``."""
        return {number for number, digest in self.recorded_shards().items()
                if number < len(index.shards) and digest == index.shards[number].hash}

    def recorded_shards(self) -> dict[int, bytes]:
        """Every shard recorded as finished, with the hash it was recorded with."""
        recorded = {}
        try:
            with self._directories() as (journal, _):
                for name in os.listdir(journal):
                    if name.startswith("shard-") and name[6:].isdigit():
                        try:
                            recorded[int(name[6:])] = bytes.fromhex(read_text(journal, name))
                        except ValueError:
                            continue
        except FileNotFoundError:
            return {}
        return recorded

    def record_shard(self, index: Index, number: int, run: str, rank: int) -> None:
        """Record shard ``number`` as finished by ``rank`` in ``run``, relative to the journal's descriptor;
        DestinationError naming the record if the destination's file system fails."""
        name = f"shard-{number:06d}"
        try:
            with self._directories(make=True) as (journal, runs):
                write_new(journal, f"{name}.tmp{rank}", index.shards[number].hash.hex())
                os.replace(f"{name}.tmp{rank}", name, src_dir_fd=journal, dst_dir_fd=journal)
                append_text(runs, f"{run}.rank{rank}", f"{number}\n")
        except OSError as exc:
            raise destination_error(exc, os.fsencode(os.path.join(self.root, name))) from None

    def run_log(self) -> dict[str, list[int]]:
        """Shards extracted per run (all ranks merged), for inspection and tests."""
        runs: dict[str, list[int]] = {}
        try:
            with self._directories() as (_, directory):
                for name in sorted(os.listdir(directory)):
                    run = name.rsplit(".rank", 1)[0]
                    runs.setdefault(run, []).extend(int(line) for line in read_text(directory, name).split())
        except FileNotFoundError:
            return {}
        return runs


def new_run_name() -> str:
    """A sortable name for one unpack run."""
    return time.strftime("%Y%m%dT%H%M%S") + f"-{os.getpid()}"
