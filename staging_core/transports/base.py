"""The transport interface: URLs, capabilities, transfer items and results, and the Transport contract."""
from __future__ import annotations

import enum
import os
import posixpath
import re
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import ClassVar, Sequence

from bundles.errors import UsageError

from .errors import NotSupportedError, TransportError

_SCP_STYLE = re.compile(r"^(?:(?P<user>[^@/:]+)@)?(?P<host>[A-Za-z0-9._-]+):(?P<path>.*)$")
_URL = re.compile(r"^(?P<scheme>[a-z][a-z0-9+.-]*)://(?:(?P<user>[^@/]+)@)?(?P<host>[^/:]*)(?::(?P<port>\d+))?"
                  r"(?P<path>/.*)?$")


@dataclass(frozen=True)
class Endpoint:
    """A parsed pallet URL: where a path lives. ``path`` is absolute and normalised."""

    scheme: str
    path: str
    host: str | None = None
    port: int | None = None
    user: str | None = None

    @property
    def is_local(self) -> bool:
        return self.scheme == "file"

    def url(self) -> str:
        if self.is_local:
            return self.path
        user = f"{self.user}@" if self.user else ""
        port = f":{self.port}" if self.port else ""
        return f"{self.scheme}://{user}{self.host}{port}{self.path}"

    def join(self, *parts: str) -> "Endpoint":
        return Endpoint(self.scheme, posixpath.normpath(posixpath.join(self.path, *parts)),
                        self.host, self.port, self.user)


def local_or_url(text: str) -> str:
    """A location as a command line gives it: a URL or ``host:path`` stays as it is; anything else is a
    local path, made absolute (``pallet push data/ backup/`` reads as rsync and cp read it)."""
    if _URL.match(text) or _SCP_STYLE.match(text):
        return text
    return os.path.abspath(text)


def parse_url(text: str) -> Endpoint:
    """Parse '/abs', 'file:///abs', 'ssh://[user@]host[:port]/abs', '[user@]host:/abs',
    'gsiftp://host:port/abs', 'ftp://host:port/abs' or 'globus://ENDPOINT_UUID/abs'.

    Any other scheme registered in staging_core.transports.registry (the
    only list of schemes) parses as ``scheme://[user@]host[:port]/abs``.
    Raises UsageError naming the URL for anything else (relative remote
    paths, unknown schemes, missing hosts). Performs no I/O.
    """
    from .registry import schemes          # the registry imports this module
    if text.startswith("/"):
        return Endpoint("file", posixpath.normpath(text))
    match = _URL.match(text)
    if match:
        scheme = match["scheme"]
        if scheme not in schemes():
            raise UsageError(f"unknown URL scheme {scheme!r} in {text!r}",
                             hint=f"use /path, host:/path or one of {', '.join(s + '://' for s in schemes())}")
        if scheme != "file" and not match["host"]:
            raise UsageError(f"{text!r} has no host", hint=f"write {scheme}://HOST/absolute/path")
        path = match["path"] or "/"
        return Endpoint(scheme, posixpath.normpath(path), match["host"] or None,
                        int(match["port"]) if match["port"] else None, match["user"])
    scp = _SCP_STYLE.match(text)
    if scp and scp["path"].startswith("/"):
        return Endpoint("ssh", posixpath.normpath(scp["path"]), scp["host"], None, scp["user"])
    if scp:
        raise UsageError(f"remote path in {text!r} must be absolute", hint=f"write {scp['host']}:/absolute/path")
    raise UsageError(f"not a pallet URL or absolute path: {text!r}",
                     hint="use /abs/path, file:///abs, ssh://[user@]host[:port]/abs, host:/abs, "
                          "gsiftp://host:port/abs, ftp://host:port/abs or globus://ENDPOINT/abs")


@dataclass(frozen=True)
class Capabilities:
    """What a transport can do; the planner and the conformance suite read it.

    ``per_file_overhead_s`` is the typical extra seconds one more file costs
    in a batch (measured by benchmarks/bench_transports.py), ``concurrency``
    the parallel streams/processes it uses by default. ``names`` says which
    names can cross: 'any', 'no-line-breaks' or 'printable-ascii' (items
    with other names fail with NotSupportedError, they are never renamed).
    """

    batch: bool = True
    streaming: bool = False
    remote_exec: bool = False
    parallel_streams: bool = False
    checksums: tuple[str, ...] = ()
    preserves_mtime: bool = True
    preserves_mode: bool = True
    symlinks: bool = True
    hardlinks: bool = False
    per_file_overhead_s: float = 0.0
    concurrency: int = 1
    names: str = "any"


def name_crosses(name: str, names: str) -> bool:
    """Whether ``name`` can cross a transport whose ``Capabilities.names`` is ``names``."""
    if names == "printable-ascii":
        return all(" " <= ch <= "~" for ch in name)
    return names == "any" or "\n" not in name and "\r" not in name


class Direction(enum.Enum):
    """PUSH copies local files to the transport's endpoint, PULL the other way."""

    PUSH = "push"
    PULL = "pull"


@dataclass(frozen=True)
class RemoteEntry:
    """One listed entry: path relative to the listed root, type ('f', 'd', 'l'), size, mode, mtime, link."""

    path: str
    kind: str
    size: int
    mode: int
    mtime_ns: int
    link: str = ""


@dataclass
class TransferResult:
    """Per-item outcome of a batch: relative paths done, and failures with their error.

    A whole-tree transfer (``items=None``) done in one native operation
    reports ``done == ["."]``. ``bytes_sent`` is the file data the transport
    actually moved (rsync's literal data: a file already there, or the part
    of an interrupted one kept as partial, is not counted), or None when the
    transport cannot tell.
    """

    done: list[str] = field(default_factory=list)
    failed: dict[str, TransportError] = field(default_factory=dict)
    bytes_sent: int | None = None

    @property
    def ok(self) -> bool:
        return not self.failed


def local_tree_items(root: str) -> list[str]:
    """Relative paths of every entry under local ``root`` (directories included), parents first."""
    items = []
    for current, dirs, files in os.walk(root):
        dirs.sort()
        for name in dirs + sorted(files):
            items.append(os.path.relpath(os.path.join(current, name), root))
    return items


class Transport(ABC):
    """A way to move files between this host and one endpoint (the rclone ``Fs`` analogue).

    Contract, for every implementation:

    - ``transfer(direction, local_root, remote_root, items)`` copies each
      relative path in ``items`` (files, symlinks or directories — a
      directory item creates the directory, not its contents; parents are
      created) from ``local_root`` to ``remote_root`` (PUSH) or back (PULL),
      in one batch operation, never one connection per file. ``items=None``
      means the whole tree under the source root (see ``all_items``). Existing
      destination files are replaced. It returns a TransferResult naming
      every item that failed; it raises only when the whole batch cannot
      run (unreachable host, authentication). Mode and mtime are preserved
      when the capabilities say so.
    - ``list(path)`` returns every entry under ``path`` recursively, paths
      relative to it; ``stat(path)`` one entry (path '') or None if missing.
    - ``mkdir(path)`` creates a directory and its parents; existing is fine.
    - ``run(argv)`` runs a command on the far side and returns its stdout;
      ``stream_into(argv)`` starts one that reads our pipe. Both raise
      NotSupportedError unless ``capabilities`` has remote_exec/streaming.
    - Errors are TransportError subclasses saying the cause, with the
      command, exit code and stderr; ``retryable`` is set only for causes
      that may pass (network). Policy — retry, resume, verification — lives
      above, in staging_core.operations, never here.
    """

    scheme: ClassVar[str]
    capabilities: ClassVar[Capabilities]

    def __init__(self, endpoint: Endpoint):
        self.endpoint = endpoint

    @classmethod
    def options_from(cls, options) -> dict:
        """The keyword arguments this transport's constructor takes from a push's or pull's StagingOptions
        (``options``): by default those given for its scheme in ``options.transport_options``. A transport
        whose options have flags of their own (ssh's ``--ssh-option``) adds them by overriding this, as
        rclone's backends declare theirs; :func:`staging_core.transports.registry.open_endpoint` applies
        them, so no caller needs to know which scheme has which."""
        return dict(options.transport_options.get(cls.scheme, {}))

    @abstractmethod
    def transfer(self, direction: Direction, local_root: str, remote_root: str,
                 items: Sequence[str] | None = None) -> TransferResult: ...

    def all_items(self, direction: Direction, local_root: str, remote_root: str) -> list[str]:
        """Every entry under the source root, parents first: what ``items=None`` stands for."""
        if direction is Direction.PUSH:
            return local_tree_items(local_root)
        return [entry.path for entry in sorted(self.list(remote_root), key=lambda e: e.path.split("/"))]

    @abstractmethod
    def list(self, path: str) -> list[RemoteEntry]: ...

    @abstractmethod
    def stat(self, path: str) -> RemoteEntry | None: ...

    @abstractmethod
    def mkdir(self, path: str) -> None: ...

    def run(self, argv: list[str], stdin: bytes | None = None) -> bytes:
        raise NotSupportedError(f"{self.scheme} cannot run remote commands", self.endpoint.url())

    def stream_into(self, argv: list[str]):
        raise NotSupportedError(f"{self.scheme} cannot stream into a remote command", self.endpoint.url())

    def close(self) -> None:
        """Release connections (ControlMaster, sessions); safe to call twice."""

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()
