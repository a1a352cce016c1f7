"""The unpack journal: one record per finished shard and a log per run, kept until the unpack succeeds.

Also the rules that say when a journal in DEST/.pallet may be trusted.
"""
from __future__ import annotations

import os
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

from .extract_common import destination_error
from .index import Index, content_hash
from .reserved import STATE_DIR
from .state_fd import append_text, open_private_dir, read_text, remove_entry, state_dir_fd, write_new

JOURNAL_KINDS = ("journal-", "stream-")     # journals in DEST/.pallet: a bundle's unpack, a stream's receive


def bundle_id(index: Index) -> str:
    """A short identity of a bundle's content: the hash of its shard hashes."""
    return content_hash(b"".join(s.hash for s in index.shards)).hex()[:24]


def untrusted_journals(names: list[str], journal: str | None, marked: bool) -> list[str]:
    """Of ``names`` (the entries of DEST/.pallet), the journals (``journal-ID``, ``stream-ID``) that a writer
    about to write into DEST must not trust; ``marked``: DEST/.pallet holds the INCOMPLETE marker. A journal
    vouches for the files it lists only until another operation writes into DEST. With no marker, one has
    finished since: all are stale. A writer that keeps no journal there (``journal`` None), or journals of
    two kinds, mean that some writer's files may differ from what another's journal says: all go. Otherwise
    the writer's kind stay: its own (``journal``, its name there), to resume, and an interrupted run's,
    which it may adopt (:meth:`Journal.take_over`)."""
    journals = sorted(n for n in names if n.startswith(JOURNAL_KINDS))
    kind = journal.split("-", 1)[0] + "-" if journal else None
    if not marked:
        return journals
    return [] if kind and all(n.startswith(kind) for n in journals) else journals


@dataclass(frozen=True)
class Journal:
    """Files under ``root`` (default DEST/.pallet/journal-ID; DEST/.pallet/stream-SID for a bundle
    stream) recording progress of one bundle into one DEST.

    ``shard-NNNNNN`` exists once shard N is completely written (its content
    is the shard's hash, so a record from another bundle never counts, and
    for a stream the shard's key, see bundles.stream.shard_key);
    ``runs/RUN.rankR`` lists the shards rank R extracted in run RUN. The
    directories appear with the first record. The unpack removes the journal
    when it succeeds (see bundles.state.finish): it only ever serves a rerun
    after a failure.
    """

    root: str

    @classmethod
    def for_destination(cls, dest: str, index: Index, journal_dir: str | None = None) -> Journal:
        return cls(journal_dir or os.path.join(dest, STATE_DIR, f"journal-{bundle_id(index)}"))

    @classmethod
    def for_stream(cls, dest: str, stream_id: str) -> Journal:
        """The journal of a bundle stream (see bundles.stream): keyed by its stream id, since the shard
        hashes are not known before the shards arrive."""
        return cls(os.path.join(dest, STATE_DIR, f"stream-{stream_id}"))

    def name_in(self, dest: str) -> str | None:
        """This journal's name in DEST/.pallet; None when it is kept elsewhere (``--journal DIR``)."""
        parent, name = os.path.split(os.path.abspath(self.root))
        return name if parent == os.path.abspath(os.path.join(dest, STATE_DIR)) else None

    def others(self, dest: str) -> list[Journal]:
        """The other journals of its kind (streams' or bundles') DEST/.pallet holds: interrupted earlier runs.
        None of them for a journal kept elsewhere (``--journal DIR``)."""
        name = self.name_in(dest)
        if name is None:
            return []
        parent, kind = os.path.dirname(os.path.abspath(self.root)), name.split("-", 1)[0] + "-"
        try:
            with state_dir_fd(dest, create=False) as state:
                names = os.listdir(state)
        except FileNotFoundError:
            return []
        return [Journal(os.path.join(parent, other)) for other in sorted(names)
                if other.startswith(kind) and other != name]

    def take_over(self, dest: str, run: str, matching: Callable[[Journal], dict[int, tuple[bytes, bytes]]]) -> None:
        """Take over what one interrupted run of another bundle or stream (the source changed since) finished
        at DEST: ``matching(other)`` gives that journal's records that answer for shards of this one (number
        -> hash, key), and those this journal lacks become its records in ``run``. Then the other journals go.
        Only a single other journal is trusted (each run takes over and removes its predecessor's); with more,
        none is."""
        others = self.others(dest)
        if len(others) == 1:
            own = self.recorded_shards()
            self.adopt({n: record for n, record in matching(others[0]).items() if n not in own}, run)
        for other in others:
            other.remove(dest)

    def remove(self, dest: str) -> None:
        """Remove this journal, kept in ``dest``'s DEST/.pallet (relative to that directory's descriptor)."""
        try:
            with state_dir_fd(dest, create=False) as state:
                remove_entry(state, os.path.basename(self.root))
        except FileNotFoundError:
            pass
        except OSError as exc:
            raise destination_error(exc, os.fsencode(self.root)) from None

    def create(self, dest: str) -> None:
        """Make the journal's directories (DEST/.pallet checked first when the journal lives there);
        DestinationError naming the journal if they cannot be made or trusted."""
        try:
            with self._directories(make=True):
                pass
        except OSError as exc:
            raise destination_error(exc, os.fsencode(self.root)) from None

    def check(self) -> None:
        """Check the journal's directories if they exist, as :meth:`create` would (a link or another user's
        directory there: DestinationError naming it), without making them."""
        try:
            with self._directories():
                pass
        except FileNotFoundError:
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
        return {number: digest for number, (digest, _) in self.records().items()}

    def recorded_keys(self) -> dict[bytes, bytes]:
        """The keys of the shards recorded with one (a stream's), each with the hash it was recorded with."""
        return {key: digest for digest, key in self.records().values() if key}

    def records(self) -> dict[int, tuple[bytes, bytes]]:
        """Every record: shard number -> (hash, key; empty for a record without one)."""
        records = {}
        try:
            with self._directories() as (journal, _):
                for name in os.listdir(journal):
                    if name.startswith("shard-") and name[6:].isdigit():
                        try:
                            digest, _, key = read_text(journal, name, os.path.join(self.root, name)).partition(" ")
                            records[int(name[6:])] = bytes.fromhex(digest), bytes.fromhex(key)
                        except ValueError:
                            continue
        except FileNotFoundError:
            return {}
        return records

    def record_shard(self, index: Index, number: int, run: str, rank: int, key: bytes = b"") -> None:
        """Record shard ``number`` as finished by ``rank`` in ``run`` (with a stream's shard ``key``), relative
        to the journal's descriptor; DestinationError naming the record if the destination's file system fails."""
        self._write_record(number, index.shards[number].hash, key, run, rank)

    def adopt(self, records: dict[int, tuple[bytes, bytes]], run: str) -> None:
        """Record the shards of ``records`` (number -> hash, key) as finished here: another journal's records
        of shards that hold the same entries (the caller matched their keys)."""
        for number, (digest, key) in records.items():
            self._write_record(number, digest, key, run, 0)

    def forget_all(self) -> None:
        """Remove every record of this journal (and its run logs), leaving its directories."""
        try:
            with self._directories() as (journal, runs):
                for directory, names in ((journal, os.listdir(journal)), (runs, os.listdir(runs))):
                    for name in names:
                        if directory == runs or name.startswith("shard-"):
                            os.unlink(name, dir_fd=directory)
        except FileNotFoundError:
            pass
        except OSError as exc:
            raise destination_error(exc, os.fsencode(self.root)) from None

    def forget_shard(self, number: int) -> None:
        """Remove shard ``number``'s record (it is about to be written again)."""
        try:
            with self._directories() as (journal, _):
                os.unlink(f"shard-{number:06d}", dir_fd=journal)
        except FileNotFoundError:
            pass
        except OSError as exc:
            raise destination_error(exc, os.fsencode(os.path.join(self.root, f"shard-{number:06d}"))) from None

    def _write_record(self, number: int, digest: bytes, key: bytes, run: str, rank: int) -> None:
        name = f"shard-{number:06d}"
        text = f"{digest.hex()} {key.hex()}" if key else digest.hex()
        try:
            with self._directories(make=True) as (journal, runs):
                write_new(journal, f"{name}.tmp{rank}", text)
                os.replace(f"{name}.tmp{rank}", name, src_dir_fd=journal, dst_dir_fd=journal)
                log = f"{run}.rank{rank}"
                append_text(runs, log, f"{number}\n", os.path.join(self.root, "runs", log))
        except OSError as exc:
            raise destination_error(exc, os.fsencode(os.path.join(self.root, name))) from None


def new_run_name() -> str:
    """A sortable name for one unpack run."""
    return time.strftime("%Y%m%dT%H%M%S") + f"-{os.getpid()}"
