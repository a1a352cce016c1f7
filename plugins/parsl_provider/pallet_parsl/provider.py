"""PalletStaging: a Parsl staging provider that stages many files per transfer, in batches planned by pallet."""
from __future__ import annotations

import os
import posixpath
import shlex
import sys
import tempfile
import threading
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Future
from dataclasses import replace
from typing import Any, cast

import parsl
from parsl.app.futures import DataFuture
from parsl.data_provider.files import File
from parsl.data_provider.staging import Staging
from parsl.dataflow.dflow import DataFlowKernel
from parsl.dataflow.futures import AppFuture
from parsl.executors import ThreadPoolExecutor
from parsl.utils import RepresentationMixin

from staging_core import HostSessions, StagingOptions, UsageError, declarations, transport_settings

from .batches import Activity, Batch, Batcher, BatchKey, Member
from .kept import PackedBatch, ReadsKeptInputs, private_copy_path
from .tasks import UnpackPlan, move_batch, send_batch, unpack_batch

DEFAULT_SCHEMES = ("ssh", "gsiftp", "globus")
DEFAULT_OPTIONS = StagingOptions()
_SUBMIT = DataFlowKernel.submit.__code__       # a thread running this is submitting an app


class PalletStaging(Staging, RepresentationMixin):
    """Stage app inputs and outputs at pallet URLs in batches: one planned transfer per batch, not per file.

    List it first in an executor's ``storage_access`` (before Parsl's
    defaults, which it leaves ``file``, ``http(s)``, ``ftp`` and ``zip``):
    ``storage_access=[PalletStaging(), *default_staging]``.

    - ``schemes``: the URL schemes it claims (``ssh://[user@]host[:port]/abs``,
      ``gsiftp://``, ``globus://COLLECTION/abs``; ``ftp`` may be added).
    - ``local_root``: where local copies go; None: the executor's
      ``working_dir``, or the submitting process's current directory. A
      file at ``scheme://host[:port]/a/b`` is at ``ROOT/host[:port]/a/b``:
      the remote tree is kept, so equal names in different directories
      never collide. It must be visible to the workers (shared file system).
    - ``idle``: a batch closes when submission pauses — no app submitted,
      none being submitted and no file staged for ``idle`` seconds (longer,
      up to 10 × ``idle``, when its files have come more slowly: 4 × the
      longest gap between them) — so one wave of submissions is one batch,
      however long Parsl takes to submit it.
    - ``window``, ``max_files``, ``max_bytes``: a batch also closes that many
      seconds after its first file (None: no age limit), at that many
      files, or at that many bytes of known sizes (``size_hint``), whichever
      comes first; ``flush()`` closes every open batch now.
    - ``session_idle``: seconds a host's far-side session stays open without
      a request. A batch small enough (the planner decides) moves inline
      over it in one round trip; batches whose tasks run in this process
      (a ThreadPoolExecutor ``mover``) share this provider's sessions, and
      tasks elsewhere (HighThroughputExecutor workers) open their own for
      the task, over the ssh connection every process of the user shares
      (kept ``ssh_keep`` seconds, see docs/host-sessions.md).
    - ``size_hint(url)``: the size of a file when the workflow knows it
      without I/O (e.g. from a manifest), else None; with every size of a
      batch known, the plan needs no remote listing.
    - ``options``: the StagingOptions of every fetch and send (strategy,
      ``remote_python``, ``ssh_options``, ``pack_via`` for GridFTP/Globus
      sources, retries inside a task ...).
    - any other keyword: one of pallet's options, as :data:`STAGING_KEYWORDS`
      (StagingOptions fields, e.g. ``strategy="bundle"``,
      ``ssh_options=["-p", "2222"]``) and :data:`TRANSPORT_KEYWORDS`
      (``SCHEME_NAME`` for an option a transport declares, e.g.
      ``ssh_parallel=4``, ``globus_local_endpoint=UUID``) list them, both
      derived from pallet's option declarations; each replaces that value of
      ``options``.
    - ``mover``: label of the executor that runs the plan-and-move tasks;
      None: the app's executor (use a ThreadPoolExecutor on the submit host
      when compute nodes cannot reach the remote side).
    - ``unpack_executor``: label of the executor that runs the unpack tasks;
      None: the app's executor. An MPIExecutor runs ``mpi_stager unpack``
      under ``mpi_launcher`` (``{ranks}`` becomes ``$PARSL_NUM_RANKS``) with
      ``mpi_ranks`` ranks on one node; any other runs it as one process
      with ``unpack_workers`` worker processes. With ``unpack_executor``
      None and an app executor that is not an MPIExecutor, a bundle from
      an ssh source with pallet is streamed: the move task unpacks it as it
      arrives, and the unpack task only checks and marks the batch.
    - ``keep_packed``: each incoming batch is packed at the source and kept
      as one bundle under ``ROOT/.pallet/parsl/packed-ID/`` (one file on the
      shared file system instead of one per input); nothing is unpacked.
      Each app then copies just its own inputs out of the bundle, checked
      against the shard hashes, into a private directory below ``scratch``
      on its node, and that copy is removed when the app ends. ``inputs[0]``
      is that copy. Needs pallet at an ssh source (or ``pack_via`` for
      GridFTP/Globus); inputs that are upstream outputs are staged as usual.
      A rerun reads each file from the bundle kept before that holds it,
      however the runs were batched; only files none holds are brought.
    - ``scratch``: node-local directory for those copies (default: the
      system temporary directory's ``pallet-parsl-UID``); the same path on
      every worker node, a real directory only this user can write into.

    ``stage_in`` only records the file: it returns a DataFuture over the
    batch's unpack task (or, for a file that is an upstream app's output,
    over its own future, released when that app's output is ready).
    Each incoming batch is two Parsl tasks, plan-and-move then unpack;
    each outgoing batch one send task, run when every app writing into it
    has finished (outputs of failed apps are not sent). All carry
    ``_parsl_staging_inhibit=True``, are retried under ``Config.retries``
    and are idempotent. A failed batch fails every app reading its files
    with a DependencyError whose cause is a BatchError naming the batch
    and what went wrong.
    """

    def __init__(self, schemes: Sequence[str] = DEFAULT_SCHEMES, local_root: str | None = None,
                 window: float | None = 60.0, max_files: int = 10_000, max_bytes: int = 1 << 30,
                 size_hint: Callable[[str], int | None] | None = None, options: StagingOptions = DEFAULT_OPTIONS,
                 mover: str | None = None, unpack_executor: str | None = None, mpi_ranks: int = 2,
                 mpi_launcher: str = "mpiexec -n {ranks}", unpack_workers: int = 1, keep_packed: bool = False,
                 scratch: str | None = None, idle: float = 0.5, session_idle: float = 60.0, **pallet_options: Any):
        counts = (max_files, max_bytes, mpi_ranks, unpack_workers)
        if idle <= 0 or (window is not None and window <= 0) or min(counts) < 1:
            raise UsageError("idle, window, max_files, max_bytes, mpi_ranks and unpack_workers must be positive")
        options = with_keywords(options, pallet_options)
        self.schemes, self.local_root, self.size_hint = tuple(schemes), local_root, size_hint
        self.idle, self.window, self.max_files, self.max_bytes = idle, window, max_files, max_bytes
        self.options, self.mover, self.unpack_executor = options, mover, unpack_executor
        self.mpi_ranks, self.mpi_launcher, self.unpack_workers = mpi_ranks, mpi_launcher, unpack_workers
        self.keep_packed = keep_packed
        self.scratch = os.path.abspath(scratch or os.path.join(tempfile.gettempdir(), f"pallet-parsl-{os.getuid()}"))
        self._batcher = Batcher(idle, window, max_files, max_bytes, options)
        self._lock = threading.Lock()
        self._staged: dict[tuple[str, bool], tuple] = {}       # (local path, kept) -> what its DataFutures follow
        self._to_wrap: dict[str, tuple[PackedBatch, str]] = {}   # a kept input's copy -> its batch, remote path
        self._produced: set[str] = set()                       # local paths of outputs staged out here
        self._made_dirs: set[str] = set()
        self._apps: dict[tuple, object] = {}
        self._watches: dict[int, SubmitWatch] = {}             # id(dfk) -> its submissions, as batches see them
        self.sessions = HostSessions(session_idle)             # for the tasks that run in this process

    # ------------------------------------------------------------ the Staging interface

    def can_stage_in(self, file: File) -> bool:
        return file.scheme in self.schemes

    def can_stage_out(self, file: File) -> bool:
        return file.scheme in self.schemes

    def stage_in(self, dm, executor: str, file: File, parent_fut: Future | None) -> DataFuture:
        """Record ``file`` for the open batch and set its ``local_path``; no I/O, no waiting."""
        host_root = self._host_root(dm, executor, file)
        mirrored = _below(host_root, file.path)
        if mirrored in self._produced and parent_fut is not None:
            file.local_path = mirrored
            upstream = cast(AppFuture, parent_fut)                 # an app's future, written here by that app
            return DataFuture(upstream, file, tid=upstream.tid)
        gated = parent_fut is not None and not (parent_fut.done() and parent_fut.exception() is None)
        kept = self.keep_packed and not gated
        with self._lock:
            known = self._staged.get((mirrored, kept))
        if known is None:
            member = Member(file.path, mirrored, self._size(file), parent_fut if gated else None,
                            Future() if gated else None)
            key = BatchKey("in", executor, file.scheme, file.netloc, gated, kept)
            known = self._batcher.add(key, host_root, member, lambda batch: self._open_batch(dm.dfk, batch),
                                      self._activity(dm.dfk))
            self._remember((mirrored, kept), known)
        file.local_path = mirrored
        if kept:
            file.local_path = private_copy_path(self.scratch, file.path)
            with self._lock:
                self._to_wrap[file.local_path] = (known[2], file.path)
        return DataFuture(known[0], file, tid=known[1])

    def replace_task(self, dm, executor: str, file: File, func):
        """For a kept input (``keep_packed``): ``func`` wrapped to copy the input out of its batch's bundle
        before it runs, and to remove the copy after; otherwise None (``func`` runs as it is)."""
        if file.local_path is None:
            return None
        with self._lock:
            kept = self._to_wrap.pop(file.local_path, None)
        return None if kept is None else ReadsKeptInputs(func, kept[0], kept[1], file.local_path)

    def stage_out(self, dm, executor: str, file: File, app_fu: Future) -> Future:
        """Set ``local_path`` (its directory is created) and add the file to the open outgoing batch, which is
        sent once every app writing into it has finished; return the file's own future."""
        host_root = self._host_root(dm, executor, file)
        file.local_path = _below(host_root, file.path)
        self._make_parent(file.local_path)
        member = Member(file.path, file.local_path, self._size(file), app_fu, Future())
        key = BatchKey("out", executor, file.scheme, file.netloc, True)
        future, _, _ = self._batcher.add(key, host_root, member, lambda batch: self._open_batch(dm.dfk, batch),
                                         self._activity(dm.dfk))
        self._produced.add(file.local_path)
        return future

    def flush(self) -> None:
        """Close every open batch now (its tasks start as soon as their inputs allow)."""
        self._batcher.flush()

    def batches(self) -> list[Future]:
        """The future of every batch opened so far, in order; each resolves to a BatchDone."""
        return [batch.done for batch in self._batcher.batches]

    # ------------------------------------------------------------ batches become tasks

    def _open_batch(self, dfk, batch: Batch) -> Future:
        """Submit the tasks of a new batch, waiting for its manifest; return the future of the last."""
        mover = self.mover or batch.key.executor
        shared = {"sessions": self.sessions} if _in_this_process(dfk, mover) else {}
        if batch.key.direction == "out":
            return self._app(dfk, send_batch, mover)(batch.manifest, _parsl_staging_inhibit=True,
                                                     **_resources(dfk, mover, 1), **shared)
        if batch.key.packed:             # kept as it came: its check is light, and runs where it was moved
            moved = self._app(dfk, move_batch, mover)(batch.manifest, False, _parsl_staging_inhibit=True,
                                                      **_resources(dfk, mover, 1))
            return self._app(dfk, unpack_batch, mover)(moved, UnpackPlan(), _parsl_staging_inhibit=True,
                                                       **_resources(dfk, mover, 1))
        unpacker = self.unpack_executor or batch.key.executor
        stream = self.unpack_executor is None and not _is_mpi(dfk, unpacker)      # no unpack asked for elsewhere
        moved = self._app(dfk, move_batch, mover)(batch.manifest, stream, _parsl_staging_inhibit=True,
                                                  **_resources(dfk, mover, 1), **shared)
        how = UnpackPlan(self.mpi_launcher if _is_mpi(dfk, unpacker) else None, self.unpack_workers)
        return self._app(dfk, unpack_batch, unpacker)(moved, how, _parsl_staging_inhibit=True,
                                                      **_resources(dfk, unpacker, self.mpi_ranks))

    def _activity(self, dfk) -> Activity:
        """How ``dfk``'s submissions look to a batch; notes the calling thread (the submitting one)."""
        with self._lock:
            watch = self._watches.get(id(dfk))
            if watch is None or watch.dfk is not dfk:
                watch = self._watches[id(dfk)] = SubmitWatch(dfk)
        watch.note(threading.get_ident())
        return watch.activity

    def _app(self, dfk, function, label: str):
        key = (id(dfk), function.__name__, label)
        if key not in self._apps:
            if label not in dfk.executors:
                raise UsageError(f"PalletStaging: no executor labelled {label!r}",
                                 hint=f"executors: {', '.join(sorted(dfk.executors))}")
            self._apps[key] = parsl.python_app(executors=[label], data_flow_kernel=dfk)(function)
        return self._apps[key]

    # ------------------------------------------------------------ paths

    def _host_root(self, dm, executor: str, file: File) -> str:
        root = self.local_root or getattr(dm.dfk.executors[executor], "working_dir", None) or os.getcwd()
        return os.path.join(os.path.abspath(root), file.netloc.rpartition("@")[2])

    def _size(self, file: File) -> int | None:
        return self.size_hint(file.url) if self.size_hint else None

    def _remember(self, local: tuple[str, bool], known: tuple) -> None:
        """De-duplicate by local path; forget a file whose batch failed, so a later app tries again."""
        with self._lock:
            self._staged[local] = known

        def forget(done: Future) -> None:
            if done.exception() is not None:
                with self._lock:
                    if self._staged.get(local) is known:
                        del self._staged[local]
        known[0].add_done_callback(forget)

    def _make_parent(self, path: str) -> None:
        parent = os.path.dirname(path)
        if parent not in self._made_dirs:
            os.makedirs(parent, exist_ok=True)
            self._made_dirs.add(parent)


STAGING_KEYWORDS = {declared.name: declared for declared in declarations(parsl=True)}
TRANSPORT_KEYWORDS = {setting.name: setting for setting in transport_settings()}


def with_keywords(options: StagingOptions, given: Mapping[str, Any]) -> StagingOptions:
    """``options`` with the keyword arguments of PalletStaging that are pallet's options (:data:`STAGING_KEYWORDS`,
    :data:`TRANSPORT_KEYWORDS`) put in: TypeError for a keyword that is neither, UsageError naming each value
    pallet cannot use. A ``multiple`` option takes a sequence (``ssh_options`` also one string, split like a
    shell line)."""
    unknown = sorted(set(given) - set(STAGING_KEYWORDS) - set(TRANSPORT_KEYWORDS))
    if unknown:
        raise TypeError(f"PalletStaging() got unexpected keyword argument(s): {', '.join(unknown)} (pallet's "
                        f"options: {', '.join(sorted(STAGING_KEYWORDS))}, and SCHEME_NAME for a transport's: "
                        f"{', '.join(sorted(TRANSPORT_KEYWORDS))})")
    fields: dict[str, Any] = {}
    transport = []
    problems = []
    for name, value in given.items():
        declared = STAGING_KEYWORDS.get(name)
        multiple = declared.multiple if declared is not None else TRANSPORT_KEYWORDS[name].option.multiple
        if multiple:
            value = tuple(shlex.split(value) if declared is not None and declared.shell_split else (value,)) \
                if isinstance(value, str) else tuple(value)
        problem = (declared or TRANSPORT_KEYWORDS[name]).problem(value, name)
        if problem:
            problems.append(problem)
        elif declared is not None:
            fields[name] = value
        else:
            transport.append((TRANSPORT_KEYWORDS[name], value))
    if problems:
        raise UsageError("PalletStaging: " + "; ".join(problems))
    return replace(options, **fields).with_transport_values(transport) if given else options


class SubmitWatch:
    """Whether apps are being submitted to ``dfk``: ``count()`` moves with each app submitted, and ``ongoing()``
    is true while a thread that staged a file here is inside ``DataFlowKernel.submit`` (Parsl's own per-File
    work there can outlast any fixed pause). Thread-safe; it only reads."""

    def __init__(self, dfk):
        self.dfk = dfk
        self.activity = Activity(self.count, self.ongoing)
        self._threads: set[int] = set()
        self._lock = threading.Lock()

    def note(self, thread: int) -> None:
        with self._lock:
            self._threads.add(thread)

    def count(self) -> int:
        return self.dfk.task_count

    def ongoing(self) -> bool:
        with self._lock:
            threads = tuple(self._threads)
        frames = sys._current_frames()
        return any(_submitting(frames.get(thread)) for thread in threads)


def _submitting(frame) -> bool:
    """Whether the stack ending at ``frame`` runs DataFlowKernel.submit."""
    while frame is not None:
        if frame.f_code is _SUBMIT:
            return True
        frame = frame.f_back
    return False


def _below(host_root: str, remote_path: str) -> str:
    """The local copy of ``remote_path``: the same absolute path, re-rooted at ``host_root``."""
    return os.path.join(host_root, posixpath.normpath("/" + remote_path).lstrip("/"))


def _in_this_process(dfk, label: str) -> bool:
    """Whether the executor ``label`` runs tasks in this process's threads (their arguments are not copied)."""
    return isinstance(dfk.executors.get(label), ThreadPoolExecutor)


def _is_mpi(dfk, label: str) -> bool:
    return bool(getattr(dfk.executors.get(label), "enable_mpi_mode", False))


def _resources(dfk, label: str, ranks: int) -> dict:
    """An MPIExecutor needs a resource specification on every task (one node, ``ranks`` ranks); others none."""
    if not _is_mpi(dfk, label):
        return {}
    return {"parsl_resource_specification": {"num_nodes": 1, "ranks_per_node": ranks, "num_ranks": ranks}}
