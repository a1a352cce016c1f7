"""The ssh transport: system ssh and rsync over one ControlMaster connection per host."""
from __future__ import annotations

import builtins
import os
import re
import stat
import subprocess
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor

from bundles.errors import UsageError
from bundles.reserved import PARTIAL_DIR

from ..scratch import scratch
from .base import Capabilities, Direction, EarlyConnection, Endpoint, RemoteEntry, Transport, TransferResult
from .declarations import KEEP_S, SSH_OPTIONS
from .errors import MissingDependencyError, RemotePathMissingError, SourceReadError, classify, source_read_error
from .login_output import FILTER_TAG, LoginOutput
from .ssh_master import LoginOutputError, SSHMaster, login_error, ssh_options_for

_FIND_FORMAT = r"%P\0%y\0%s\0%m\0%T@\0%l\0"
_FAILED_PATH = re.compile(r'"([^"]+)" failed: (.*)$')
RSYNC_IDLE_S = 300            # rsync gives up (status 30) when no data has moved for this long: a stuck far side
_PARTIAL = (23, 24)          # rsync: partial transfer due to error / vanished source files
_UNREADABLE = re.compile(r'\[sender\] (?:send_files failed to open|opendir|read errors mapping) "([^"]+)"'
                         r'(?: failed)?: (.*?)(?: \(\d+\))?$')


class SSHTransport(Transport):
    """rsync/ssh to ``[user@]host[:port]``; the user's ~/.ssh/config, keys and agent apply.

    ``ssh_options`` (and ``$PALLET_SSH_OPTIONS``) are extra ssh arguments;
    ``master`` a connection already started for this host and these options
    (:class:`SSHMaster`; `pallet push` starts it before loading the rest of
    pallet), which the transport takes over and ends; without it, or for
    another host, the transport makes its own on first use;
    ``parallel`` > 1 splits each batch over that many rsync processes,
    balanced by bytes and file count, sharing the one connection; ``keep``
    > 0 keeps the connection for that many idle seconds after this
    transport is done, for later operations and later `pallet` commands
    (see :class:`SSHMaster`).
    """

    scheme = "ssh"
    capabilities = Capabilities(batch=True, streaming=True, remote_exec=True, parallel_streams=False,
                                checksums=("md5",), preserves_mtime=True, preserves_mode=True, symlinks=True,
                                hardlinks=True, per_file_overhead_s=9e-5, concurrency=1,
                                exact_listing=True, posix_shell=True, byte_ranges=True, shared_connection=True)
    declared_options = SSH_OPTIONS

    def __init__(self, endpoint: Endpoint, ssh_options: Sequence[str] = (), parallel: int = 1,
                 master: SSHMaster | None = None, keep: float = KEEP_S):
        super().__init__(endpoint)
        self.ssh_options = ssh_options_for(ssh_options)
        self.parallel = max(1, parallel)
        if master is not None and master.adopt(endpoint, self.ssh_options):
            self._master = master
        else:
            self._master = SSHMaster(endpoint, self.ssh_options, keep_s=keep)
        if self.parallel > 1:       # a pull's hard links may land in different parts (their inodes are unknown here)
            self.capabilities = Capabilities(**{**self.capabilities.__dict__, "parallel_streams": True,
                                                "concurrency": self.parallel, "hardlinks": False})

    @classmethod
    def connect_early(cls, endpoint: Endpoint, options) -> EarlyConnection:
        """The ControlMaster to ``endpoint``'s host, started now with the ssh options a transport made from
        ``options`` (a StagingOptions) will have, so that the transport takes it over (option ``master``)."""
        given = cls.options_from(options)
        master = SSHMaster(endpoint, ssh_options_for(given.get("ssh_options", ())), keep_s=given.get("keep", KEEP_S))
        return EarlyConnection("master", master.start())

    # ------------------------------------------------------------ connection

    @property
    def destination(self) -> str:
        return self._master.destination

    def _connect(self) -> None:
        self._master.ready()

    def close(self) -> None:
        self._master.release()

    def _ssh(self, remote_argv: list[str], stdin: bytes | None = None) -> subprocess.CompletedProcess:
        """Run ``remote_argv`` there to its end: its output after what the login printed (see SSHMaster.command);
        LoginOutputError when the login did not run it."""
        self._connect()
        process = self._master.command(remote_argv, subprocess.PIPE if stdin is not None else subprocess.DEVNULL)
        stdout, stderr = process.communicate(stdin)
        if process.returncode == 0 and not process.marked:
            raise login_error(LoginOutput(b"", 0, False, 0.0), self.endpoint.url(), remote_argv)
        return subprocess.CompletedProcess(process.args, process.returncode, stdout, stderr)

    # ------------------------------------------------------------ remote commands

    def run(self, argv: list[str], stdin: bytes | None = None) -> bytes:
        done = self._ssh(argv, stdin)
        if done.returncode == 127 and argv:
            raise MissingDependencyError(f"`{argv[0]}` is not installed on {self.endpoint.host}", self.endpoint.url(),
                                         "install it there, or put it on the login shell's PATH", argv, 127,
                                         done.stderr.decode(errors="replace"))
        if done.returncode != 0:
            raise classify(done.stderr.decode(errors="replace"), done.returncode, argv, self.endpoint.url(),
                           f"remote command failed with status {done.returncode}")
        return done.stdout

    def stream_into(self, argv: list[str]) -> subprocess.Popen:
        """Start ``argv`` on the far side reading our pipe; the caller writes to ``.stdin`` and waits. Its
        ``.stdout`` and ``.stderr`` begin after what the login printed; a login that does not run it is a
        LoginOutputError at the first read of ``.stdout`` (see SSHMaster.command)."""
        self._connect()
        return self._master.command(argv)

    # ------------------------------------------------------------ listing

    def list(self, path: str) -> list[RemoteEntry]:
        done = self._ssh(["find", path, "-mindepth", "1", "-printf", _FIND_FORMAT])
        if done.returncode != 0:
            raise classify(done.stderr.decode(errors="replace"), done.returncode, None,
                           f"{self.endpoint.url()}", f"cannot list {path}")
        return _parse_find(done.stdout)

    def stat(self, path: str) -> RemoteEntry | None:
        done = self._ssh(["find", path, "-maxdepth", "0", "-printf", _FIND_FORMAT])
        if done.returncode != 0:
            error = classify(done.stderr.decode(errors="replace"), done.returncode, None, path, f"cannot stat {path}")
            if isinstance(error, RemotePathMissingError):
                return None
            raise error
        entries = _parse_find(done.stdout)
        return entries[0] if entries else None

    def mkdir(self, path: str) -> None:
        self.run(["mkdir", "-p", "--", path])

    # ------------------------------------------------------------ transfers

    def transfer(self, direction: Direction, local_root: str, remote_root: str,
                 items: Sequence[str] | None = None, temp_dir: str | None = None) -> TransferResult:
        self._connect()
        if items is None and self.parallel == 1:
            return self._rsync(direction, local_root, remote_root, None, temp_dir)
        items = list(items) if items is not None else self.all_items(direction, local_root, remote_root)
        if self.parallel > 1 and len(items) > 1:
            return self._transfer_parallel(direction, local_root, remote_root, items, temp_dir)
        return self._rsync(direction, local_root, remote_root, items, temp_dir)

    # builtins.list: in this class, ``list`` is a method
    def _rsync(self, direction: Direction, local_root: str, remote_root: str,
               items: builtins.list[str] | None, temp_dir: str | None = None) -> TransferResult:
        """One rsync: of the listed items (--files-from), or of the whole tree when ``items`` is None; its
        temporaries in ``temp_dir`` (relative to the destination root) when given."""
        if not os.path.isabs(local_root):
            raise UsageError("the local side of a transfer must be an absolute path", local_root or "(empty)",
                             "pass an absolute directory")
        remote = f"{self.destination}:{remote_root.rstrip('/')}/"
        local = local_root.rstrip("/") + "/"
        if direction is Direction.PULL:
            os.makedirs(local, exist_ok=True)
        source, target = (local, remote) if direction is Direction.PUSH else (remote, local)
        base = ["rsync", "-a", "-H", "-s", "--modify-window=-1", f"--partial-dir={PARTIAL_DIR}", "--stats",
                f"--timeout={RSYNC_IDLE_S}",
                *self._master.rsync_shell()]
        if temp_dir is not None:
            base.append(f"--temp-dir={temp_dir}")
        with scratch("pallet-ssh-files-") as private:        # a killed pallet's is swept by the next one's
            if items is not None:
                listing = os.path.join(private, "files")
                with open(listing, "wb") as handle:
                    handle.write(b"\0".join(os.fsencode(i) for i in items))
                base += ["--from0", f"--files-from={listing}"]
            command = [*base, source, target]
            done = subprocess.run(command, capture_output=True, stdin=subprocess.DEVNULL)
        source_root = local_root if direction is Direction.PUSH else remote_root
        return self._result(items, done, command, source_root)

    def _result(self, items: builtins.list[str] | None, done, command: builtins.list[str],
                source_root: str) -> TransferResult:
        stderr = done.stderr.decode(errors="replace")
        _raise_login_output(stderr, self.endpoint.url(), command)
        if done.returncode == 0:
            return TransferResult(done=items if items is not None else ["."], bytes_sent=_literal_bytes(done.stdout))
        failures = _failed_items(stderr, source_root, set(items or ()))
        unreadable = _unreadable_sources(stderr, source_root, command, done.returncode)
        if done.returncode not in _PARTIAL or not (failures or unreadable):
            raise classify(stderr, done.returncode, command, self.endpoint.url(),
                           f"rsync failed with status {done.returncode}")
        result = TransferResult(done=[i for i in items or [] if i not in failures and i not in unreadable])
        for item, reason in failures.items():
            result.failed[item] = classify(reason, done.returncode, command, item, f"cannot transfer {item}")
        result.failed.update(unreadable)       # the sender could not read them: the source's fault (exit 1)
        return result

    def _transfer_parallel(self, direction, local_root, remote_root, items, temp_dir) -> TransferResult:
        if direction is Direction.PUSH:
            sizes, links = _sizes_and_link_keys(local_root, items)
        else:
            sizes, links = [0] * len(items), None
        parts = partition(items, sizes, self.parallel, link_keys=links)
        with ThreadPoolExecutor(len(parts)) as pool:
            results = list(pool.map(lambda part: self._rsync(direction, local_root, remote_root, part, temp_dir),
                                    parts))
        merged = TransferResult()
        for result in results:
            merged.done += result.done
            merged.failed.update(result.failed)
        counts = [r.bytes_sent for r in results if r.bytes_sent is not None]
        merged.bytes_sent = sum(counts) if len(counts) == len(results) else None
        return merged


def partition(items: list[str], sizes: list[int], parts: int, per_file_bytes: int = 64 * 1024,
              link_keys: list[object] | None = None) -> list[list[str]]:
    """Split items into ``parts`` lists of about equal bytes + per-file cost, keeping parents first.

    Directory items (size 0 and a prefix of others) go to every part that
    needs them, so each rsync can create its own parents. Items with the
    same key in ``link_keys`` (a file's device and inode when it has more
    than one link; None otherwise) go to the same part, so that its rsync
    (``-H``) links them.
    """
    parts = max(1, min(parts, len(items)))
    units: dict[object, list[int]] = {}
    for n, key in enumerate(link_keys or [None] * len(items)):
        units.setdefault(n if key is None else key, []).append(n)
    loads = [0] * parts
    buckets: list[list[str]] = [[] for _ in range(parts)]
    for members in sorted(units.values(), key=lambda unit: -sum(sizes[n] for n in unit)):
        target = loads.index(min(loads))
        buckets[target] += [items[n] for n in members]
        loads[target] += sum(sizes[n] + per_file_bytes for n in members)
    order = {item: n for n, item in enumerate(items)}
    return [sorted(bucket, key=order.__getitem__) for bucket in buckets if bucket]


def _sizes_and_link_keys(root: str, items: list[str]) -> tuple[list[int], list[object]]:
    """Each item's size, and its hard-link key: (device, inode) for a file with more than one link, else None."""
    sizes: list[int] = []
    keys: list[object] = []
    for item in items:
        try:
            info = os.lstat(os.path.join(root, item))
        except OSError:
            sizes.append(0)
            keys.append(None)
            continue
        sizes.append(info.st_size)
        keys.append((info.st_dev, info.st_ino) if stat.S_ISREG(info.st_mode) and info.st_nlink > 1 else None)
    return sizes, keys


def _failed_items(stderr: str, source_root: str, items: set[str]) -> dict[str, str]:
    failures = {}
    root = source_root.rstrip("/") + "/"
    for line in stderr.splitlines():
        match = _FAILED_PATH.search(line)
        if not match:
            continue
        path = match[1]
        rel = path[len(root):] if path.startswith(root) else path
        if rel in items:
            failures[rel] = f"{match[2]} ({rel})"
    return failures


def _unreadable_sources(stderr: str, source_root: str, command: list[str],
                        status: int) -> dict[str, SourceReadError]:
    """The source files and directories rsync's sender could not read, by path relative to ``source_root``."""
    root = source_root.rstrip("/") + "/"
    found: dict[str, SourceReadError] = {}
    for line in stderr.splitlines():
        match = _UNREADABLE.search(line)
        if match:
            path = match[1]
            found[path[len(root):] if path.startswith(root) else path] = source_read_error(path, match[2], command,
                                                                                            status)
    return found


def _raise_login_output(stderr: str, url: str, command: list[str]) -> None:
    """Raise the LoginOutputError that rsync's -e filter reported on stderr (login_output.filter_line), if any."""
    for line in stderr.splitlines():
        kind, tab, message = line.removeprefix(FILTER_TAG).strip().partition("\t")
        if line.startswith(FILTER_TAG) and tab:
            hint = LoginOutput(b"", 0, kind == "timeout", 0.0).hint()
            raise LoginOutputError(message, url, hint, command)


def _literal_bytes(stats: bytes) -> int | None:
    """rsync --stats' "Literal data" (file bytes really sent), or None if absent."""
    found = re.search(rb"Literal data: ([\d,.]+) bytes", stats)
    return int(found.group(1).replace(b",", b"").replace(b".", b"")) if found else None


def _parse_find(raw: bytes) -> list[RemoteEntry]:
    fields = raw.split(b"\0")
    entries = []
    for n in range(0, len(fields) - 5, 6):
        path, kind, size, mode, mtime, link = fields[n:n + 6]
        seconds, _, fraction = mtime.decode().partition(".")
        mtime_ns = int(seconds) * 1_000_000_000 + int((fraction + "000000000")[:9])
        entries.append(RemoteEntry(os.fsdecode(path), kind.decode(), int(size) if kind == b"f" else 0,
                                   int(mode, 8), mtime_ns, os.fsdecode(link)))
    return entries
