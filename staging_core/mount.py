"""`pallet mount`: a bundle as a read-only FUSE file system, built from its index, read shard by shard."""
from __future__ import annotations

import errno
import os
import stat
import subprocess
import sys
import threading
import time

from bundles.errors import PalletError, SetupError, UsageError
from bundles.tarformat import Kind
from bundles.view import BundleView, Node

from .remote_bytes import open_view

_READY_TIMEOUT_S = 60
_CACHE_S = 3600              # seconds the kernel may trust attributes and names
_NO_OPEN_SUPPORT = 1 << 17    # libfuse 3: FUSE_CAP_NO_OPEN_SUPPORT
_STAT_TYPE = {Kind.FILE: stat.S_IFREG, Kind.DIR: stat.S_IFDIR, Kind.SYMLINK: stat.S_IFLNK}
_FUSE_HINT = "install FUSE (Debian/Ubuntu: apt install fuse3; RHEL: dnf install fuse3) and check /dev/fuse exists"


def add_parser(commands) -> None:
    p = commands.add_parser(
        "mount", help="mount a bundle read-only, without unpacking it (FUSE)",
        description="Show the files of BUNDLE under MOUNTPOINT, read in place: listings come from the index, "
                    "a read decompresses only the shard that holds the file and checks its hash first. "
                    "BUNDLE may be a local file or ssh://HOST/PATH (read by byte ranges). A damaged shard "
                    "gives I/O errors on its files only, and is named in the log. Unmount with "
                    "`fusermount3 -u MOUNTPOINT` (or `fusermount -u`), or Ctrl-C with --foreground.",
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
        # One thread: a callback from libfuse's worker threads pays for a new interpreter thread state each
        # time (3x slower for small files); the GIL serialises the callbacks anyway. The bundle does not
        # change while mounted, so the kernel may keep attributes, names and pages (kernel_cache).
        try:
            fuse.FUSE(operations_for(view, fuse), args.mountpoint, foreground=True, ro=True, nothreads=True,
                      use_ino=True, default_permissions=True, kernel_cache=True, attr_timeout=_CACHE_S,
                      entry_timeout=_CACHE_S, negative_timeout=_CACHE_S, fsname=_fsname(view.name),
                      subtype="pallet")
        except RuntimeError as exc:         # mfusepy: libfuse refused the mount; it said why on stderr
            raise PalletError(f"FUSE could not mount it here (libfuse status {exc})", args.mountpoint,
                              "see libfuse's message above; check that the mount point is yours and empty") from None
    finally:
        view.close()
    return 0


def _fsname(name: str) -> str:
    """The name the mount table shows; libfuse splits its options at commas, so those are replaced."""
    return "pallet:" + name.replace("\\", "_").replace(",", "_")


def fuse_module():
    """The mfusepy module, or SetupError saying what to install."""
    try:
        import mfusepy
    except ModuleNotFoundError:
        raise SetupError("the FUSE binding (mfusepy) is not installed", None,
                         "pip install 'pallet[mount]'") from None
    except OSError as exc:                # mfusepy raises OSError when libfuse cannot be found
        raise SetupError(f"FUSE is not available: {exc}", None, _FUSE_HINT) from None
    if not os.path.exists("/dev/fuse"):
        raise SetupError("FUSE is not available: /dev/fuse does not exist", None, _FUSE_HINT)
    return mfusepy


def _check_mountpoint(path: str) -> None:
    if not os.path.isdir(path):
        raise UsageError("the mount point is not a directory", path, f"create it first: mkdir -p {path}")
    if os.path.ismount(path):
        raise UsageError("something is already mounted here", path, f"unmount it first: fusermount3 -u {path}")
    if os.listdir(path):
        raise UsageError("the mount point is not empty", path, "mount on an empty directory")


def _mount_in_background(args) -> int:
    """Start `pallet mount --foreground` detached, and return once MOUNTPOINT is mounted."""
    log_path = args.log or _default_log()
    command = [sys.executable, "-m", "staging_core.cli", "mount", "--foreground", "--cache-mib", str(args.cache_mib),
               *[f"--ssh-option={opt}" for opt in args.ssh_option], "--", args.bundle, args.mountpoint]
    try:
        os.makedirs(os.path.dirname(os.path.abspath(log_path)), exist_ok=True)
        log = open(log_path, "ab")
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


def operations_for(view: BundleView, fuse):
    """BundleOperations joined with the binding's Operations base (imported late: libfuse may be absent)."""
    return type("PalletOperations", (BundleOperations, fuse.Operations), {})(view, fuse)


class BundleOperations:
    """FUSE operations over a BundleView (read-only; every call is safe from libfuse's threads)."""

    use_ns = True

    def __init__(self, view: BundleView, fuse):
        self.view, self.fuse = view, fuse
        self.uid, self.gid = os.getuid(), os.getgid()
        self._reported: set[int] = set()
        self._lock = threading.Lock()
        self.skip_open = False

    def init_with_config(self, conn, config):
        """Note whether the kernel can stop sending OPEN (libfuse 3's no_open): a bundle's files need no state
        per open, and each OPEN is one more round trip to this process for every file read."""
        self.skip_open = bool(conn is not None and self.fuse.fuse_version_major >= 3
                              and conn.capable & _NO_OPEN_SUPPORT)

    def _node(self, path: str) -> Node:
        node = self.view.lookup(path)
        if node is None:
            raise self.fuse.FuseOSError(errno.ENOENT)
        return node

    def getattr(self, path, fh=None):
        node = self._node(path)
        return {"st_mode": _STAT_TYPE[node.kind] | node.mode, "st_nlink": node.nlink, "st_size": node.size,
                "st_uid": self.uid, "st_gid": self.gid, "st_ino": node.inode, "st_blocks": (node.size + 511) // 512,
                "st_mtime": node.mtime_ns, "st_ctime": node.mtime_ns, "st_atime": node.mtime_ns}

    def readdir(self, path, fh):
        # (name, attributes, 0): with use_ino the kernel drops directory entries whose inode is 0
        try:
            names = self.view.listdir(path)
        except (FileNotFoundError, NotADirectoryError) as exc:
            raise self.fuse.FuseOSError(errno.ENOENT if isinstance(exc, FileNotFoundError) else errno.ENOTDIR)
        here = self._node(path)
        prefix = path.rstrip("/") + "/"
        return [(".", _dirent(here), 0), ("..", _dirent(here), 0),
                *((name, _dirent(self._node(prefix + name)), 0) for name in names)]

    def readlink(self, path):
        node = self._node(path)
        if node.kind != Kind.SYMLINK:
            raise self.fuse.FuseOSError(errno.EINVAL)
        return os.fsdecode(node.link)

    def open(self, path, flags):
        if flags & os.O_ACCMODE != os.O_RDONLY:
            raise self.fuse.FuseOSError(errno.EROFS)
        if self._node(path).kind == Kind.DIR:
            raise self.fuse.FuseOSError(errno.EISDIR)
        if self.skip_open:      # ENOSYS here means "opens need no call": the kernel opens every later file itself
            raise self.fuse.FuseOSError(errno.ENOSYS)
        return 0

    def read(self, path, size, offset, fh):
        node = self._node(path)
        try:
            return self.view.read(node, offset, size)
        except (PalletError, OSError) as exc:      # a damaged shard, a dead ssh session, a failing disk
            self._report(node, exc)
            raise self.fuse.FuseOSError(errno.EIO) from None

    def statfs(self, path):
        size = self.view.source.size
        return {"f_bsize": 4096, "f_frsize": 4096, "f_blocks": (size + 4095) // 4096, "f_bfree": 0,
                "f_bavail": 0, "f_files": len(self.view.index), "f_ffree": 0, "f_namemax": 4096}

    def _report(self, node: Node, exc: Exception) -> None:
        shard = self.view.index.shard_of[node.entry]
        with self._lock:
            if shard in self._reported:
                return
            self._reported.add(shard)
        _log(f"pallet mount: error: {str(exc).splitlines()[0]} (its files read as I/O errors)")


def _dirent(node: Node) -> dict:
    return {"st_mode": _STAT_TYPE[node.kind] | node.mode, "st_ino": node.inode}
