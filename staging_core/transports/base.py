"""The transport interface: URLs, capabilities, transfer items and results, and the Transport contract."""
from __future__ import annotations

import builtins
import enum
import os
import posixpath
import re
from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar, Protocol

from bundles.errors import UsageError

from .catalog import schemes
from .errors import ItemError, NotSupportedError

_SCP_STYLE = re.compile(r"^(?:(?P<user>[^@/:-][^@/:]*)@)?(?P<host>[A-Za-z0-9_][A-Za-z0-9._-]*):(?P<path>.*)$")
_URL_START = re.compile(r"^[A-Za-z][A-Za-z0-9+.-]*://")
_URL = re.compile(r"^(?P<scheme>[A-Za-z][A-Za-z0-9+.-]*)://(?P<authority>[^/]*)(?P<path>/.*)?$", re.DOTALL)
_AUTHORITY = re.compile(r"^(?:(?P<user>[^@]*)@)?(?P<host>[^@:]*)(?::(?P<port>[^@]*))?$", re.DOTALL)
_HOST = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9._-]*$")
_PORT = re.compile(r"^[0-9]{1,5}$")
_FORMS = ("use /abs/path, file:///abs, ssh://[user@]host[:port]/abs, host:/abs, gsiftp://host:port/abs, "
          "ftp://host:port/abs or globus://ENDPOINT/abs")
_HOMES = re.compile(r"^/(?:root|home|Users)(?:/[^/]+)?$")    # /root, /home, /home/NAME, /Users, /Users/NAME


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

    def join(self, *parts: str) -> Endpoint:
        return Endpoint(self.scheme, posixpath.normpath(posixpath.join(self.path, *parts)),
                        self.host, self.port, self.user)


def local_or_url(text: str) -> str:
    """A location as a command line gives it: a URL (anything that starts ``scheme://``) or ``host:path`` stays as
    it is, for :func:`parse_url` to check; anything else is a local path, made absolute (``pallet push data/
    backup/`` reads as rsync and cp read it)."""
    if _URL_START.match(text) or _SCP_STYLE.match(text):
        return text
    return os.path.abspath(text)


def parse_url(text: str, path_required: bool = True) -> Endpoint:
    """Parse '/abs', 'file:///abs', 'ssh://[user@]host[:port]/abs', '[user@]host:/abs',
    'gsiftp://host:port/abs', 'ftp://host:port/abs' or 'globus://ENDPOINT_UUID/abs'.

    Any other scheme registered in staging_core.transports.catalog (the
    only list of schemes, opened by staging_core.transports.registry) parses as ``scheme://[user@]host[:port]/abs``.
    A remote URL names its path: ``ssh://host`` never means the far side's
    root (``path_required=False`` lets a URL that names only a host, as
    ``--unpack-via ssh://host`` does, stand for its '/'). Raises UsageError
    naming the URL and the fix for anything else: relative or missing
    paths, ``file://`` with a host (``file://relative/x``), unknown schemes,
    missing or malformed hosts and users, ports that are not 1..65535.
    Performs no I/O.
    """
    if text.startswith("/"):
        return Endpoint("file", _normal(text))
    match = _URL.match(text)
    if match:
        return _scheme_url(text, match["scheme"].lower(), match["authority"], match["path"], path_required)
    if text.lower().startswith("file:"):        # not a host named "file" reached by ssh
        raise UsageError(f"{text!r} is not a file URL",
                         hint="write file:///absolute/path (three slashes) or a plain path")
    scp = _SCP_STYLE.match(text)
    if scp and scp["path"].startswith("/"):
        return Endpoint("ssh", _normal(scp["path"]), scp["host"], None, scp["user"])
    if scp:
        raise UsageError(f"remote path in {text!r} must be absolute", hint=f"write {scp['host']}:/absolute/path")
    raise UsageError(f"not a pallet URL or absolute path: {text!r}", hint=_FORMS)


def _scheme_url(text: str, scheme: str, authority: str, path: str | None, path_required: bool) -> Endpoint:
    """The Endpoint of ``scheme://AUTHORITY[/PATH]`` (see :func:`parse_url`)."""
    if scheme not in schemes():
        raise UsageError(f"unknown URL scheme {scheme!r} in {text!r}",
                         hint=f"use /path, host:/path or one of {', '.join(s + '://' for s in schemes())}")
    parts = _AUTHORITY.match(authority)
    if scheme == "file":
        return _file_url(text, parts, path)
    if parts is None or not parts["host"]:
        raise UsageError(f"{text!r} has no host" if parts else f"malformed host part {authority!r} in {text!r}",
                         hint=f"write {scheme}://[user@]HOST[:PORT]/absolute/path")
    user, host, port = parts["user"], parts["host"], parts["port"]
    if not _HOST.match(host):
        raise UsageError(f"{host!r} in {text!r} is not a host name",
                         hint=f"write {scheme}://[user@]HOST[:PORT]/absolute/path (letters, digits, . _ -)")
    if user is not None and (not user or user.startswith("-") or any(ch.isspace() for ch in user)):
        raise UsageError(f"{user!r} in {text!r} is not a user name", hint=f"write {scheme}://USER@{host}/absolute/path")
    if path is None and path_required:
        raise UsageError(f"{text!r} names no path: a remote URL needs an absolute path",
                         hint=f"write {scheme}://{authority}/absolute/path (the far side's root is never implied)")
    return Endpoint(scheme, _normal(path or "/"), host, _port(port, text), user or None)


def _file_url(text: str, parts, path: str | None) -> Endpoint:
    """The Endpoint of a ``file://`` URL: ``file:///abs`` (or ``file://localhost/abs``), nothing else."""
    if parts is None or parts["user"] is not None or parts["port"] is not None \
            or parts["host"] not in ("", "localhost"):
        raise UsageError(f"{text!r}: a file URL takes no host (file://relative/x would mean /x)",
                         hint="write file:///absolute/path (three slashes) or a plain path")
    if path is None:
        raise UsageError(f"{text!r} names no path", hint="write file:///absolute/path or a plain path")
    return Endpoint("file", _normal(path))


def _port(text: str | None, url: str) -> int | None:
    """The port written after ``host:`` (None when none is); UsageError naming it unless it is 1..65535."""
    if text is None:
        return None
    if not _PORT.match(text) or not 1 <= int(text) <= 65535:
        raise UsageError(f"bad port {text!r} in {url!r}: a port is a number from 1 to 65535",
                         hint="write HOST:PORT with a number, e.g. ssh://login.hpc:2222/absolute/path")
    return int(text)


def _normal(path: str) -> str:
    """``path`` normalised, with a leading '//' made '/' (POSIX keeps it, and then '//' would not be '/')."""
    normal = posixpath.normpath(path)
    return "/" + normal.lstrip("/") if normal.startswith("//") else normal


def broad_destination(endpoint: Endpoint) -> str | None:
    """Why ``endpoint`` is too broad to be a push's or pull's DEST (None when it is not): the root directory,
    or a home directory itself — '/root', '/home', '/home/NAME', '/Users', '/Users/NAME' anywhere, and, for a
    local path, also $HOME and the user's home in the password database (the path and where it leads)."""
    paths = {endpoint.path}
    homes: set[str] = set()
    if endpoint.is_local:
        paths.add(os.path.realpath(endpoint.path))
        homes = {_normal(home) for home in (os.environ.get("HOME", ""), _password_home()) if home.startswith("/")}
    for path in sorted(paths):
        where = "" if path == endpoint.path else f" (it leads to {path})"
        if path == "/":
            return f"the root directory{where}"
        if path in homes or _HOMES.match(path):
            return f"a home directory itself{where}"
    return None


def check_destination(endpoint: Endpoint, allow_broad: bool) -> None:
    """UsageError when ``endpoint`` is the root or a home directory itself (:func:`broad_destination`), unless
    ``allow_broad`` (``--allow-root-dest``) says the user means it."""
    why = broad_destination(endpoint)
    if why is not None and not allow_broad:
        raise UsageError(f"DEST {endpoint.url()} is {why}; pallet refuses it unless told",
                         hint="name a directory below it (e.g. .../data), or pass --allow-root-dest if you mean "
                              "it (--delete would then remove everything else there)")


def _password_home() -> str:
    try:
        import pwd
        return pwd.getpwuid(os.getuid()).pw_dir
    except (ImportError, KeyError):
        return ""


@dataclass(frozen=True)
class Capabilities:
    """What a transport can do; the planner, the policy above the transports and the conformance suite read it,
    never the URL scheme.

    ``per_file_overhead_s`` is the typical extra seconds one more file costs
    in a batch (measured by benchmarks/bench_transports.py), ``concurrency``
    the parallel streams/processes it uses by default. ``names`` says which
    names can cross: 'any', 'no-line-breaks' or 'printable-ascii' (items
    with other names fail with NotSupportedError, they are never renamed).

    The flags below say what the policy above may count on. Every one
    defaults to False, so a transport that does not declare one is never
    asked for more than the core contract (``Transport``):

    ``remote_exec``
        ``run(argv)`` runs a command on the far side and returns its stdout.
    ``streaming``
        ``stream_into(argv)`` starts a far-side command that reads our pipe.
    ``exact_listing``
        ``list()`` and ``stat()`` give each entry's type, size, permission
        bits, link target and mtime to the nanosecond, as the far file system
        holds them (not rounded to seconds, not a service's view): a tree
        there can be compared with another entry by entry, so a pull from
        it, or a push into it, can skip what is already the same, and
        ``--delete``/``--dry-run`` can say what differs.
    ``posix_shell``
        ``run``/``stream_into`` execute their argv on a host with a POSIX
        ``sh`` and the GNU tools pallet's far-side scripts use (``find
        -printf``, ``touch -d``, ``md5sum``, ``dd``), as the user's login
        there would: pallet may run its listing, delete and stamp scripts
        there, and probe for (and run) a far-side Python with pallet. Needs
        ``remote_exec``.
    ``local_copy``
        The endpoint's paths are this host's file system and a transfer is a
        copy between local paths (no wire): the native parallel copy and the
        measured local-copy profile apply, and pallet may read and write the
        far side directly.
    ``byte_ranges``
        ``stream_into`` gives a two-way channel (its stdin and stdout are both
        live while it runs) to a ``posix_shell`` command, over which byte
        ranges of a far file are read on request (reading a bundle in place,
        staging_core.in_place.remote_bytes). Needs ``streaming`` and
        ``posix_shell``.
    ``shared_connection``
        The transport's connection to a host can be started before the
        transport is made (``Transport.connect_early``), overlapping its
        round trips with other work, and is then handed to the transport
        through a declared option, which takes it over (an ssh ControlMaster).
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
    exact_listing: bool = False
    posix_shell: bool = False
    local_copy: bool = False
    byte_ranges: bool = False
    shared_connection: bool = False

    def __post_init__(self) -> None:
        needs = {"posix_shell": ("remote_exec",), "byte_ranges": ("streaming", "posix_shell")}
        for flag, required in needs.items():
            missing = [name for name in required if getattr(self, flag) and not getattr(self, name)]
            if missing:
                raise ValueError(f"Capabilities: {flag} needs {' and '.join(missing)}")


@dataclass(frozen=True)
class TransportOption:
    """One keyword argument of a transport's constructor, declared (as rclone's backends declare theirs):
    what front ends (the CLI, the Snakemake and Parsl plugins) offer as that transport's settings.

    ``name``
        the constructor's keyword, and the key in ``StagingOptions.transport_options[scheme]``.
    ``type``
        the type of one value: ``str``, ``int``, ``float`` or ``bool`` for a setting; ``object`` for a
        live Python object (``settable`` False).
    ``default``
        the constructor's default (None: the transport chooses, see ``help``); a ``multiple`` option's
        default is a tuple.
    ``help``
        one line for ``--help`` and settings documentation.
    ``multiple``
        the option takes a list of ``type`` values (a repeatable flag).
    ``choices``
        the values allowed, when they are few (empty: any value of ``type``).
    ``staging_field``
        the field of StagingOptions that also gives it (``ssh_options``): ``Transport.options_from``
        adds that field's values after those of ``transport_options[scheme]`` for a ``multiple`` option, and
        uses the field's value when ``transport_options[scheme]`` does not name it for another.
    ``flag``
        the ``pallet push``/``pull`` flag that sets it today, when there is one (``--ssh-option``).
    ``env``
        an environment variable the transport also reads for it (e.g. extra arguments appended).
    ``settable``
        False for a live object (a client, a started connection) that a caller passes in Python; front
        ends do not offer it as a setting.
    """

    name: str
    type: type
    default: Any
    help: str
    multiple: bool = False
    choices: tuple[Any, ...] = ()
    staging_field: str | None = None
    flag: str | None = None
    env: str | None = None
    settable: bool = True


class _Closable(Protocol):
    def close(self) -> None: ...


@dataclass
class EarlyConnection:
    """A connection started before its transport (``Transport.connect_early``): the caller hands it to the
    operation (``push(..., early_connection=...)``), which opens the transport with
    ``registry.open_endpoint(url, options, early=...)``; that passes ``connection`` as the transport's declared
    option ``option`` (never through ``StagingOptions.transport_options``, which holds only data), so the
    transport opened for that endpoint takes it over. The caller calls
    :meth:`close` when the operation is over, which ends it unless the transport has taken it over (then the
    transport ends it; closing twice is safe)."""

    option: str
    connection: _Closable

    def close(self) -> None:
        self.connection.close()


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
    failed: dict[str, ItemError] = field(default_factory=dict)
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
      when the capabilities say so. ``temp_dir`` (optional) names a directory,
      relative to the destination root, that the caller has made and will
      remove: a transport that writes a file under a temporary name first
      (rsync) keeps that temporary there, so none outlives an interrupted
      run in the destination tree; others ignore it.
    - ``list(path)`` returns every entry under ``path`` recursively, paths
      relative to it; ``stat(path)`` one entry (path '') or None if missing.
    - ``mkdir(path)`` creates a directory and its parents; existing is fine.
    - ``run(argv)`` runs a command on the far side and returns its stdout;
      ``stream_into(argv)`` starts one that reads our pipe. Both raise
      NotSupportedError unless ``capabilities`` has remote_exec/streaming.
    - ``capabilities`` says what the class can do (policy reads it, never the
      scheme); an instance may replace it with one adjusted to its options
      (more streams, fewer names), never claiming a flag its class lacks.
    - ``declared_options`` lists every keyword argument the constructor
      takes (``TransportOption``), and ``options_from`` builds them from a
      StagingOptions; see there.
    - Errors are TransportError subclasses saying the cause, with the
      command, exit code and stderr; ``retryable`` is set only for causes
      that may pass (network). Policy — retry, resume, verification — lives
      above, in staging_core.operations, never here.
    """

    # Set by every class; an instance may set its own (a transport serving two schemes names the one it
    # serves; capabilities adjusted to the instance's options), hence not ClassVar.
    scheme: str
    capabilities: Capabilities
    declared_options: ClassVar[tuple[TransportOption, ...]] = ()

    def __init__(self, endpoint: Endpoint):
        self.endpoint = endpoint

    @classmethod
    def options_from(cls, options) -> dict[str, Any]:
        """The keyword arguments this transport's constructor takes from a push's or pull's StagingOptions
        (``options``), following ``declared_options``: those given for its scheme in
        ``options.transport_options`` (every key, declared or not: the constructor checks them), then, for a
        declared option with a ``staging_field``, that field's values appended (``multiple``) or used when
        not given. :func:`staging_core.transports.registry.open_endpoint` applies them, so no caller needs to
        know which scheme has which option."""
        given: dict[str, Any] = dict(options.transport_options.get(cls.scheme, {}))
        for option in cls.declared_options:
            if option.staging_field is None:
                continue
            value = getattr(options, option.staging_field)
            if option.multiple:
                given[option.name] = [*given.get(option.name, ()), *value]
            elif option.name not in given:
                given[option.name] = value
        return given

    @classmethod
    def connect_early(cls, endpoint: Endpoint, options) -> EarlyConnection | None:
        """Start the connection to ``endpoint`` that a transport made later with ``options_from(options)``
        would use, without waiting for it (``capabilities.shared_connection``), or None when the transport
        has no such connection (the default). See :class:`EarlyConnection` for what the caller does next."""
        return None

    @abstractmethod
    def transfer(self, direction: Direction, local_root: str, remote_root: str,
                 items: Sequence[str] | None = None, temp_dir: str | None = None) -> TransferResult: ...

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

    # builtins.list: in this class, ``list`` is the method above
    def run(self, argv: builtins.list[str], stdin: bytes | None = None) -> bytes:
        raise NotSupportedError(f"{self.scheme} cannot run remote commands", self.endpoint.url())

    def stream_into(self, argv: builtins.list[str]):
        raise NotSupportedError(f"{self.scheme} cannot stream into a remote command", self.endpoint.url())

    def close(self) -> None:  # noqa: B027 - a hook: transports without connections have nothing to release
        """Release connections (ControlMaster, sessions); safe to call twice."""

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()
