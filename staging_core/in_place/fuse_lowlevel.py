"""A small ctypes binding to libfuse 3's low-level API: what a read-only file system that fills the page cache needs."""
from __future__ import annotations

import ctypes
import errno
import os
import signal
from ctypes import CFUNCTYPE, POINTER, c_char_p, c_double, c_int, c_size_t, c_uint64, c_void_p

ROOT = 1                                   # the kernel's node id of the mount's root directory
CAP_AUTO_INVAL_DATA = 1 << 12
CAP_READDIRPLUS = 1 << 13
CAP_READDIRPLUS_AUTO = 1 << 14
CAP_NO_OPEN = 1 << 17
CAP_CACHE_SYMLINKS = 1 << 23
CAP_NO_OPENDIR = 1 << 24


class FuseError(Exception):
    """Raised by a handler: the request is answered with this errno."""

    def __init__(self, code: int):
        super().__init__(code)
        self.errno = code


def load():
    """mfusepy, which finds libfuse (FUSE_LIBRARY_PATH names another) and lays out struct stat and fuse_file_info for
    this platform and libfuse version. Raises ModuleNotFoundError or OSError as importing mfusepy does, and OSError
    when the library found is not libfuse 3."""
    if not os.environ.get("FUSE_LIBRARY_PATH"):
        os.environ.setdefault("FUSE_LIBRARY_NAME", "fuse3")     # mfusepy looks for libfuse 2 first
    import mfusepy
    if mfusepy.fuse_version_major != 3 or not hasattr(mfusepy._libfuse, "fuse_lowlevel_notify_store"):
        raise OSError(f"libfuse 3 is needed; found libfuse {mfusepy.fuse_version_major}.{mfusepy.fuse_version_minor}")
    return mfusepy


class _Args(ctypes.Structure):
    _fields_ = [("argc", c_int), ("argv", POINTER(c_char_p)), ("allocated", c_int)]


class _Buf(ctypes.Structure):
    _fields_ = [("size", c_size_t), ("flags", c_int), ("mem", c_void_p), ("fd", c_int), ("pos", ctypes.c_longlong)]


class _BufVec(ctypes.Structure):
    _fields_ = [("count", c_size_t), ("idx", c_size_t), ("off", c_size_t), ("buf", _Buf * 1)]


_REQ, _INO, _OFF = c_void_p, c_uint64, ctypes.c_longlong
# The slots of struct fuse_lowlevel_ops, in order (libfuse 3.0 to 3.17 only appended to it); None: not handled.
_SLOTS = ["init", "destroy", "lookup", "forget", "getattr", "setattr", "readlink", "mknod", "mkdir", "unlink",
          "rmdir", "symlink", "rename", "link", "open", "read", "write", "flush", "release", "fsync", "opendir",
          "readdir", "releasedir", "fsyncdir", "statfs", "setxattr", "getxattr", "listxattr", "removexattr",
          "access", "create", "getlk", "setlk", "bmap", "ioctl", "poll", "write_buf", "retrieve_reply",
          "forget_multi", "flock", "fallocate", "readdirplus", "copy_file_range", "lseek"]


class Session:
    """One mount: ``fs`` answers the requests (BundleFileSystem in mount.py); run() serves until unmounted.

    Requests are served on the calling thread, one at a time. A handler returns its answer or raises FuseError;
    any other exception answers EIO and goes to ``fs.internal_error`` (no traceback reaches the console). Names and
    attributes are answered with ``timeout`` seconds of validity; an unknown name is cached as absent as long.
    """

    def __init__(self, fs, mountpoint: str, options: str, timeout: float):
        self.fuse = fuse = load()
        self.lib, self.fs, self.timeout = fuse._libfuse, fs, timeout
        self.capable = 0
        self.uid, self.gid = os.getuid(), os.getgid()
        self._declare()
        self._entry_type = type("_Entry", (ctypes.Structure,), {"_fields_": [
            ("ino", c_uint64), ("generation", c_uint64), ("attr", fuse.c_stat), ("attr_timeout", c_double),
            ("entry_timeout", c_double)]})
        fi = POINTER(fuse.fuse_file_info)
        kinds = {"init": CFUNCTYPE(None, c_void_p, POINTER(fuse.fuse_conn_info)),
                 "lookup": CFUNCTYPE(None, _REQ, _INO, c_char_p), "getattr": CFUNCTYPE(None, _REQ, _INO, fi),
                 "readlink": CFUNCTYPE(None, _REQ, _INO), "open": CFUNCTYPE(None, _REQ, _INO, fi),
                 "read": CFUNCTYPE(None, _REQ, _INO, c_size_t, _OFF, fi), "opendir": CFUNCTYPE(None, _REQ, _INO, fi),
                 "statfs": CFUNCTYPE(None, _REQ, _INO), "readdirplus": CFUNCTYPE(None, _REQ, _INO, c_size_t, _OFF, fi)}
        self._callbacks = {name: kind(getattr(self, "_" + name)) for name, kind in kinds.items()}   # kept alive
        self._ops = type("_Ops", (ctypes.Structure,), {"_fields_": [(name, kinds.get(name, c_void_p))
                                                                     for name in _SLOTS]})()
        for name, callback in self._callbacks.items():
            setattr(self._ops, name, callback)
        argv = [b"pallet", b"-o", options.encode()]
        self._argv = (c_char_p * len(argv))(*argv)
        self._args = _Args(len(argv), self._argv, 0)
        self.session = self.lib.fuse_session_new(ctypes.byref(self._args), ctypes.byref(self._ops),
                                                 ctypes.sizeof(self._ops), None)
        if not self.session:
            raise OSError(errno.EINVAL, "libfuse refused the mount options (it said why above)")
        self.mountpoint = os.fsencode(mountpoint)

    def _declare(self) -> None:
        for name, restype, argtypes in [
                ("fuse_session_new", c_void_p, [c_void_p, c_void_p, c_size_t, c_void_p]),
                ("fuse_session_mount", c_int, [c_void_p, c_char_p]), ("fuse_session_loop", c_int, [c_void_p]),
                ("fuse_session_unmount", None, [c_void_p]), ("fuse_session_destroy", None, [c_void_p]),
                ("fuse_set_signal_handlers", c_int, [c_void_p]), ("fuse_remove_signal_handlers", None, [c_void_p]),
                ("fuse_reply_err", c_int, [_REQ, c_int]), ("fuse_reply_entry", c_int, [_REQ, c_void_p]),
                ("fuse_reply_attr", c_int, [_REQ, c_void_p, c_double]),
                ("fuse_reply_readlink", c_int, [_REQ, c_char_p]),
                ("fuse_reply_buf", c_int, [_REQ, c_char_p, c_size_t]), ("fuse_reply_open", c_int, [_REQ, c_void_p]),
                ("fuse_reply_statfs", c_int, [_REQ, c_void_p]),
                ("fuse_add_direntry_plus", c_size_t, [_REQ, c_void_p, c_size_t, c_char_p, c_void_p, _OFF]),
                ("fuse_lowlevel_notify_store", c_int, [c_void_p, _INO, _OFF, c_void_p, c_int])]:
            function = getattr(self.lib, name)
            function.restype, function.argtypes = restype, argtypes

    # ------------------------------------------------------------ running

    def run(self) -> None:
        """Mount, serve until unmounted (or SIGINT, SIGTERM, SIGHUP), and release the session."""
        lib, session = self.lib, self.session
        try:
            if lib.fuse_session_mount(session, self.mountpoint) != 0:
                raise OSError(errno.EIO, "libfuse could not mount it (it said why above)")
            # libfuse installs its handlers (which end the loop) only where none is set: Python has one for SIGINT,
            # and the command line one for SIGTERM too
            previous = {signum: signal.signal(signum, signal.SIG_DFL) for signum in (signal.SIGINT, signal.SIGTERM)}
            try:
                if lib.fuse_set_signal_handlers(session) != 0:
                    raise OSError(errno.EIO, "libfuse could not set its signal handlers")
                try:
                    lib.fuse_session_loop(session)
                finally:
                    lib.fuse_remove_signal_handlers(session)
                    self.fs.destroy()
            finally:
                for signum, handler in previous.items():
                    signal.signal(signum, handler)
                lib.fuse_session_unmount(session)
        finally:
            lib.fuse_session_destroy(session)

    def notify_store(self, data: bytes, files, going=lambda: True) -> int:
        """Put each ``(inode, start, size)`` of ``files`` in the kernel's page cache: ``data[start:start + size]``
        as that file from offset 0, with no copy on this side, while ``going()``. Returns 0, or the first negative
        errno other than -ENOENT (the kernel does not hold that node now: skipped). Never call it from a request's
        handler: a store waits for the page's lock, which a reader holds until its READ is answered."""
        vector = _BufVec(1, 0, 0)
        buf, pointer = vector.buf[0], ctypes.byref(vector)
        # ctypes.cast takes bytes (as a pointer to its buffer, no copy) at run time; typeshed does not list bytes
        base = ctypes.cast(data, c_void_p).value  # type: ignore[arg-type]
        store, session, missing = self.lib.fuse_lowlevel_notify_store, self.session, -errno.ENOENT
        for inode, start, size in files:
            if not going():
                break
            buf.size, buf.mem = size, base + start
            status = store(session, inode, 0, pointer, 0)
            if status and status != missing:
                return status
        return 0

    # ------------------------------------------------------------ answers

    def _fill(self, st, attr) -> None:
        ino, mode, nlink, size, mtime_ns = attr
        st.st_ino, st.st_mode, st.st_nlink, st.st_size = ino, mode, nlink, size
        st.st_uid, st.st_gid, st.st_blksize, st.st_blocks = self.uid, self.gid, 4096, (size + 511) // 512
        seconds, nanoseconds = divmod(mtime_ns, 1_000_000_000)
        for stamp in (st.st_atimespec, st.st_mtimespec, st.st_ctimespec):
            stamp.tv_sec, stamp.tv_nsec = seconds, nanoseconds

    def _entry(self, attr):
        entry = self._entry_type()
        entry.attr_timeout = entry.entry_timeout = self.timeout
        if attr is not None:               # else ino 0: the kernel keeps the name as absent for entry_timeout
            entry.ino = attr[0]
            self._fill(entry.attr, attr)
        return entry

    def _serve(self, req, name: str, answer) -> None:
        """Run ``answer()``, which replies; a FuseError or any other exception replies an error instead."""
        try:
            answer()
        except FuseError as exc:
            self.lib.fuse_reply_err(req, exc.errno)
        except Exception as exc:           # a bug must not leave the request unanswered, nor print a traceback
            self.fs.internal_error(name, exc)
            self.lib.fuse_reply_err(req, errno.EIO)

    def _init(self, userdata, conn) -> None:
        try:
            conn = conn.contents
            self.capable = conn.capable
            # Every listing carries attributes (find walks, then every name is known); the bundle never changes
            # under the mount, so nothing is invalidated on a read, and symlink targets may be cached.
            want = conn.want & ~(CAP_READDIRPLUS_AUTO | CAP_AUTO_INVAL_DATA)
            conn.want = want | (conn.capable & (CAP_READDIRPLUS | CAP_CACHE_SYMLINKS))
        except Exception as exc:
            self.fs.internal_error("init", exc)

    def _lookup(self, req, parent, name) -> None:
        self._serve(req, "lookup", lambda: self.lib.fuse_reply_entry(
            req, ctypes.byref(self._entry(self.fs.lookup(parent, name)))))

    def _getattr(self, req, ino, fi) -> None:
        def answer():
            st = self.fuse.c_stat()
            self._fill(st, self.fs.getattr(ino))
            self.lib.fuse_reply_attr(req, ctypes.byref(st), self.timeout)
        self._serve(req, "getattr", answer)

    def _readlink(self, req, ino) -> None:
        self._serve(req, "readlink", lambda: self.lib.fuse_reply_readlink(req, self.fs.readlink(ino)))

    def _open(self, req, ino, fi) -> None:
        def answer():
            self.fs.open(ino, fi.contents.flags)
            if self.capable & CAP_NO_OPEN:    # "opens need no call": the kernel opens every later file itself,
                raise FuseError(errno.ENOSYS)  # keeping the pages it has
            fi.contents.keep_cache = 1
            self.lib.fuse_reply_open(req, fi)
        self._serve(req, "open", answer)

    def _opendir(self, req, ino, fi) -> None:
        def answer():
            if self.capable & CAP_NO_OPENDIR:
                raise FuseError(errno.ENOSYS)
            self.lib.fuse_reply_open(req, fi)
        self._serve(req, "opendir", answer)

    def _read(self, req, ino, size, offset, fi) -> None:
        def answer():
            data = self.fs.read(ino, size, offset)
            self.lib.fuse_reply_buf(req, data, len(data))
        self._serve(req, "read", answer)

    def _readdirplus(self, req, ino, size, offset, fi) -> None:
        def answer():
            buf, used = ctypes.create_string_buffer(size), 0
            base = ctypes.addressof(buf)
            for name, attr, following in self.fs.readdir(ino, offset):
                entry = self._entry(attr)
                needed = self.lib.fuse_add_direntry_plus(req, base + used, size - used, name, ctypes.byref(entry),
                                                         following)
                if needed > size - used:
                    break
                used += needed
                self.fs.listed(attr[0])
            self.lib.fuse_reply_buf(req, buf, used)
        self._serve(req, "readdirplus", answer)

    def _statfs(self, req, ino) -> None:
        def answer():
            st = self.fuse.c_statvfs()
            for key, value in self.fs.statfs().items():
                setattr(st, key, value)
            self.lib.fuse_reply_statfs(req, ctypes.byref(st))
        self._serve(req, "statfs", answer)
