"""`pallet mount`: a bundle as a read-only FUSE file system, built from its index, read shard by shard."""
from __future__ import annotations

import contextlib
import errno
import os
import queue
import stat
import subprocess
import sys
import threading
import time
from typing import TYPE_CHECKING

from bundles.errors import PalletError, SetupError, UsageError
from bundles.tarformat import Kind
from bundles.view import BundleView, Node

from staging_core.in_place.fuse_lowlevel import FuseError
from staging_core.in_place.remote_bytes import open_view

if TYPE_CHECKING:
    from staging_core.in_place.fuse_lowlevel import Session

_READY_TIMEOUT_S = 60
_CACHE_S = 3600              # seconds the kernel may trust attributes and names
_HEAD_START_FILES = 128      # files of a shard stored ahead of a reader before its READ is answered ...
_HEAD_START_S = 0.005        # ... or at most this long
_READ_AHEAD_SHARDS = 4       # then, while no READ waits, shards this far past the one read are decoded and stored
_STAT_TYPE = {Kind.FILE: stat.S_IFREG, Kind.DIR: stat.S_IFDIR, Kind.SYMLINK: stat.S_IFLNK}
_FUSE_HINT = "install FUSE (Debian/Ubuntu: apt install fuse3; RHEL: dnf install fuse3) and check /dev/fuse exists"


def add_parser(commands) -> None:
    p = commands.add_parser(
        "mount", help="mount a bundle read-only, without unpacking it (FUSE)",
        description="Show the files of BUNDLE under MOUNTPOINT, read in place: listings come from the index, "
                    "a read decompresses only the shard that holds the file and checks its hash first. "
                    "BUNDLE may be a local file or ssh://HOST/PATH (read by byte ranges). A damaged shard "
                    "gives I/O errors on its files only, and is named in the log. Unmount with "
                    "`fusermount3 -u MOUNTPOINT`, or Ctrl-C with --foreground. Needs FUSE 3.",
        epilog="example: pallet mount data.tar.zst /tmp/data && python train.py /tmp/data && "
               "fusermount3 -u /tmp/data")
    p.add_argument("bundle", metavar="BUNDLE", help="a bundle made by `pallet pack`: a local path or ssh://HOST/PATH")
    p.add_argument("mountpoint", metavar="MOUNTPOINT", help="an existing empty directory")
    p.add_argument("--foreground", "-f", action="store_true",
                   help="stay in the foreground until unmounted (log on stderr)")
    p.add_argument("--cache-mib", type=int, default=256, metavar="MIB",
                   help="decoded shards kept in memory (default 256 MiB)")
    p.add_argument("--log", metavar="FILE",
                   help="where a background mount logs damaged shards (default: "
                        "~/.local/state/pallet/mount-PID.log)")
    p.add_argument("--ssh-option", action="append", default=[], metavar="OPT",
                   help="extra ssh argument for an ssh:// BUNDLE (repeatable)")
    p.set_defaults(run=run)


def run(args) -> int:
    """Mount in the foreground, or start a background mount and return once it is ready."""
    _check_mountpoint(args.mountpoint)
    if args.cache_mib < 1:
        raise UsageError("--cache-mib must be at least 1", None, "give the memory for decoded shards in MiB")
    fuse = fuse_module()
    if not args.foreground:
        return _mount_in_background(args)
    view = open_view(args.bundle, args.cache_mib << 20, tuple(args.ssh_option))
    try:
        _log(f"pallet mount: {view.name} at {args.mountpoint} ({len(view.index)} entries, "
             f"{len(view.hidden)} unsafe hidden)")
        # One thread: the GIL serialises the requests anyway. The bundle does not change while mounted, so the
        # kernel may keep attributes, names and pages for an hour.
        options = f"ro,default_permissions,fsname={_fsname(view.name)},subtype=pallet"
        try:
            session = fuse.Session(BundleFileSystem(view), args.mountpoint, options, _CACHE_S)
            session.fs.session = session
            session.run()
        except OSError as exc:              # libfuse refused the mount; it said why on stderr
            raise PalletError(f"FUSE could not mount it here ({exc.strerror})", args.mountpoint,
                              "see libfuse's message above; check that the mount point is yours and empty") from None
    finally:
        view.close()
    return 0


def _fsname(name: str) -> str:
    """The name the mount table shows; libfuse splits its options at commas, so those are replaced."""
    return "pallet:" + name.replace("\\", "_").replace(",", "_")


def fuse_module():
    """The low-level FUSE binding, once libfuse 3 is found, or SetupError saying what to install."""
    from staging_core.in_place import fuse_lowlevel
    try:
        fuse_lowlevel.load()
    except ModuleNotFoundError:
        raise SetupError("the FUSE binding (mfusepy) is not installed", None,
                         "pip install 'pallet[mount]'") from None
    except (OSError, AttributeError) as exc:     # mfusepy raises these when libfuse cannot be found or is too old
        raise SetupError(f"FUSE is not available: {exc}", None, _FUSE_HINT) from None
    if not os.path.exists("/dev/fuse"):
        raise SetupError("FUSE is not available: /dev/fuse does not exist", None, _FUSE_HINT)
    return fuse_lowlevel


def _check_mountpoint(path: str) -> None:
    if not os.path.lexists(path):
        raise UsageError("the mount point does not exist", path, f"create it first: mkdir -p {path}")
    if not os.path.isdir(path):
        raise UsageError("the mount point is not a directory", path, "mount on an empty directory")
    if os.path.ismount(path):
        raise UsageError("something is already mounted here", path, f"unmount it first: fusermount3 -u {path}")
    if os.listdir(path):
        raise UsageError("the mount point is not empty", path, "mount on an empty directory")


def _mount_in_background(args) -> int:
    """Start `pallet mount --foreground` detached, and return once MOUNTPOINT is mounted."""
    log_path = args.log or _default_log()
    command = [sys.executable, "-m", "staging_core.cli.main", "mount", "--foreground",
               "--cache-mib", str(args.cache_mib), *[f"--ssh-option={opt}" for opt in args.ssh_option],
               "--", args.bundle, args.mountpoint]
    try:
        os.makedirs(os.path.dirname(os.path.abspath(log_path)), exist_ok=True)
        log = open(log_path, "ab")      # noqa: SIM115 (its OSError is a UsageError here; the with below closes it)
    except OSError as exc:
        raise UsageError(f"cannot write the mount's log ({exc.strerror})", log_path,
                         "give a writable file with --log FILE") from None
    with log:
        child = subprocess.Popen(command, stdin=subprocess.DEVNULL, stdout=log, stderr=log, start_new_session=True)
    deadline = time.monotonic() + _READY_TIMEOUT_S
    while not os.path.ismount(args.mountpoint):
        if child.poll() is not None:
            raise PalletError(f"the mount did not start (log {log_path}): {_child_error(log_path)}")
        if time.monotonic() > deadline:
            child.kill()
            raise PalletError(f"the mount was not ready after {_READY_TIMEOUT_S} s", args.bundle, f"see {log_path}")
        time.sleep(0.05)
    print(f"mounted {args.bundle} at {args.mountpoint} (pid {child.pid}, log {log_path}); "
          f"unmount with: fusermount3 -u {args.mountpoint}")
    return 0


def _default_log() -> str:
    state = os.environ.get("XDG_STATE_HOME") or os.path.join(os.path.expanduser("~"), ".local", "state")
    return os.path.join(state, "pallet", f"mount-{os.getpid()}.log")


def _child_error(path: str) -> str:
    """The last error the background mount wrote to its log (with its hint), or a note that there is none."""
    with open(path, "rb") as handle:
        handle.seek(max(0, os.fstat(handle.fileno()).st_size - 4000))
        text = handle.read().decode(errors="replace")
    starts = [(text.rfind(marker), marker) for marker in ("pallet mount: error: ", "pallet mount: internal error: ")]
    start, marker = max(starts)
    return text[start + len(marker):].strip() if start >= 0 else "it exited without a message"


def _log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


class BundleFileSystem:
    """The answers of a read-only FUSE file system over a BundleView, by inode number (the view's own).

    After a file's READ is answered, the other files of its shard whose names the kernel holds (listed by
    READDIRPLUS or looked up since that shard was last read) are stored into the kernel's page cache from the
    decoded shard, by a thread of its own: their later reads need no request at all. Only a shard just decoded and
    verified is stored from, so a damaged shard's files still read as I/O errors; one shard is stored at a time.
    """

    def __init__(self, view: BundleView):
        self.view = view
        self.session: Session | None = None     # the fuse_lowlevel.Session serving this, for notify_store
        self._pending: dict[int, set[int]] = {}     # by shard: file inodes the kernel knows, not stored yet
        self._pending_lock = threading.Lock()        # the request thread and the storing thread share _pending
        self._reported: set[int] = set()
        self._lock = threading.Lock()
        self._store = True
        self._jobs: queue.Queue = queue.Queue(maxsize=1)     # (decoded shard, [(inode, start, size)]) to store
        self._storer: threading.Thread | None = None

    def _node(self, inode: int) -> Node:
        node = self.view.by_inode(inode)
        if node is None:
            raise FuseError(errno.ENOENT)
        return node

    def _attr(self, node: Node) -> tuple:
        return node.inode, _STAT_TYPE[node.kind] | node.mode, node.nlink, node.size, node.mtime_ns

    def _known(self, node: Node) -> None:
        """The kernel now holds ``node``: a file of a shard that is read later is stored into its page cache."""
        if node.kind == Kind.FILE and node.size and self._store:
            with self._pending_lock:
                self._pending.setdefault(self.view.index.shard_of[node.entry], set()).add(node.inode)

    def lookup(self, parent: int, name: bytes):
        node = self.view.child(self._node(parent), name)
        if node is None:
            return None
        self._known(node)
        return self._attr(node)

    def getattr(self, inode: int):
        return self._attr(self._node(inode))

    def readdir(self, inode: int, offset: int):
        """(name, attributes, offset of the next) from ``offset`` on; "." and ".." first."""
        here = self._node(inode)
        if here.kind != Kind.DIR:
            raise FuseError(errno.ENOTDIR)
        names = self.view.children(here)
        for position in range(offset, len(names) + 2):
            if position < 2:
                yield (b".", b"..")[position], self._attr(here), position + 1
            else:
                child = self.view.child(here, names[position - 2])
                assert child is not None            # a name children() just gave
                yield names[position - 2], self._attr(child), position + 1

    def listed(self, inode: int) -> None:
        self._known(self._node(inode))

    def readlink(self, inode: int) -> bytes:
        node = self._node(inode)
        if node.kind != Kind.SYMLINK:
            raise FuseError(errno.EINVAL)
        return node.link

    def open(self, inode: int, flags: int) -> None:
        if flags & os.O_ACCMODE != os.O_RDONLY:
            raise FuseError(errno.EROFS)
        if self._node(inode).kind == Kind.DIR:
            raise FuseError(errno.EISDIR)

    def read(self, inode: int, size: int, offset: int) -> bytes:
        node = self._node(inode)
        try:
            data = self.view.read(node, offset, size)
        except (PalletError, OSError) as exc:      # a damaged shard, a dead ssh session, a failing disk
            self._report(node, exc)
            raise FuseError(errno.EIO) from None
        if self._pending:
            self._prefetch(node)
        return data

    def _prefetch(self, node: Node) -> None:
        """Hand the pending files of ``node``'s shard, just read, to the storing thread (see the class), and give it
        a head start before this READ is answered: a reader going through the shard in order then finds each next
        file stored. Not stored here: a store waits for the page's lock, which a reader holds until its READ is
        answered, by this thread."""
        number, data = self.view.cached_shard(node)
        with self._pending_lock:
            pending = self._pending.pop(number, None)
        if not pending or data is None:
            return
        pending.discard(node.inode)
        files = self._files(pending)
        started = threading.Event()
        if self._storer is None:
            self._storer = threading.Thread(target=self._store_all, name="pallet-page-cache", daemon=True)
            self._storer.start()
        try:
            self._jobs.put_nowait((number, data, files, started))
        except queue.Full:                  # one shard at a time: these wait for the next read of their shard
            self._put_back(number, pending)
            return
        started.wait(_HEAD_START_S)         # bounded: the storer may wait for a page whose READ is queued here

    def _files(self, inodes: set[int]) -> list[tuple[int, int, int]]:
        index = self.view.index
        return [(inode, index.data_offsets[inode - 2], index.sizes[inode - 2]) for inode in sorted(inodes)]

    def _put_back(self, number: int, inodes: set[int]) -> None:
        with self._pending_lock:
            self._pending.setdefault(number, set()).update(inodes)

    def _store_all(self) -> None:
        while (job := self._jobs.get()) is not None:
            number, data, files, started = job
            status = self._notify_store(data, files[:_HEAD_START_FILES])
            started.set()
            if not status:
                status = self._notify_store(data, files[_HEAD_START_FILES:])
            limit = number + _READ_AHEAD_SHARDS
            while not status and self._store and self._jobs.empty():     # no READ waits: read the next shard ahead
                ahead = self._store_next(number, limit)
                if ahead is None:
                    break
                number, status = ahead
            self._check(status)

    def _store_next(self, after: int, limit: int) -> tuple[int, int] | None:
        """Decode (and verify) the next shard after ``after``, up to ``limit``, holding files the kernel knows,
        and store them; return its number and the store's status. None when there is none, or when that shard
        cannot be read: its files are then left to their own READs, which report the error."""
        with self._pending_lock:
            ahead = min((n for n in self._pending if after < n <= limit), default=None)
            inodes = self._pending.pop(ahead) if ahead is not None else None
        if ahead is None or not inodes:
            return None
        node = self.view.by_inode(min(inodes))
        assert node is not None                     # a file inode the kernel was given
        try:
            self.view.read(node, 0, 1)
        except (PalletError, OSError):
            self._put_back(ahead, inodes)
            return None
        _, data = self.view.cached_shard(node)
        if data is None:
            self._put_back(ahead, inodes)
            return None
        return ahead, self._notify_store(data, self._files(inodes))

    def _notify_store(self, data: bytes, files: list[tuple[int, int, int]]) -> int:
        """Store ``files`` of the decoded shard ``data`` into the kernel's page cache while storing goes on."""
        session = self.session
        assert session is not None                  # set by run() before the session serves a request
        return session.notify_store(data, files, lambda: self._store)

    def _check(self, status: int) -> None:
        """Stop storing after the kernel refused a store (or the mount went)."""
        if status in (-errno.ENODEV, -errno.ENOTCONN, -errno.EBADF):     # unmounted meanwhile
            self._store = False
        elif status:
            self._store = False
            _log(f"pallet mount: the kernel refused to cache files ahead of reads ({os.strerror(-status)});"
                 " every file is read on request")

    def destroy(self) -> None:
        """The mount has ended: stop the storing thread before the session goes."""
        self._store = False
        if self._storer is not None:
            while True:
                with contextlib.suppress(queue.Empty):
                    self._jobs.get_nowait()
                with contextlib.suppress(queue.Full):
                    self._jobs.put_nowait(None)
                    break
            self._storer.join()

    def statfs(self) -> dict:
        size = self.view.source.size
        return {"f_bsize": 4096, "f_frsize": 4096, "f_blocks": (size + 4095) // 4096, "f_bfree": 0,
                "f_bavail": 0, "f_files": len(self.view.index), "f_ffree": 0, "f_namemax": 4096}

    def internal_error(self, where: str, exc: Exception) -> None:
        _log(f"pallet mount: internal error: {where}: {type(exc).__name__}: {exc} (answered EIO)")

    def _report(self, node: Node, exc: Exception) -> None:
        shard = self.view.index.shard_of[node.entry]
        with self._lock:
            if shard in self._reported:
                return
            self._reported.add(shard)
        _log(f"pallet mount: error: {str(exc).splitlines()[0]} (its files read as I/O errors)")
