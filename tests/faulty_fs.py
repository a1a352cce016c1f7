"""A FUSE pass-through file system that fails writes with EIO: the tests' disk that breaks mid-operation.

    python tests/faulty_fs.py BACKING MOUNTPOINT --fail-after N [--errno EACCES]

Every call that changes data or names (write, create, mkdir, rename, link, symlink, truncate, chmod, utimens,
unlink, rmdir) is passed to BACKING until N of them have succeeded; from then on each one fails with EIO (or the
errno named), as a dying disk or a broken network file system does, or, with EACCES, as a directory whose
permissions changed under the operation (which root cannot otherwise meet). Reads keep working. Runs in the
foreground until unmounted.
"""
from __future__ import annotations

import argparse
import errno
import os
import threading

import mfusepy as fuse


class FaultyPassThrough(fuse.Operations):
    """Pass every call to the backing directory; fail changes with ``error`` after ``fail_after`` of them."""

    use_ns = True

    def __init__(self, backing: str, fail_after: int, error: int = errno.EIO):
        self.backing, self.fail_after, self.error = backing, fail_after, error
        self.changes = 0
        self.guard = threading.Lock()

    def _path(self, path: str) -> str:
        return os.path.join(self.backing, path.lstrip("/"))

    def _change(self) -> None:
        with self.guard:
            if self.changes >= self.fail_after:
                raise fuse.FuseOSError(self.error)
            self.changes += 1

    # reads
    def getattr(self, path, fh=None):
        st = os.lstat(self._path(path))
        return {key: getattr(st, key) for key in ("st_mode", "st_nlink", "st_size", "st_uid", "st_gid", "st_ino")} | {
            "st_atime": st.st_atime_ns, "st_mtime": st.st_mtime_ns, "st_ctime": st.st_ctime_ns}

    def readdir(self, path, fh):
        return [".", "..", *os.listdir(self._path(path))]

    def readlink(self, path):
        return os.readlink(self._path(path))

    def open(self, path, flags):
        if flags & (os.O_WRONLY | os.O_RDWR | os.O_TRUNC):
            self._change()
        return os.open(self._path(path), flags)

    def read(self, path, size, offset, fh):
        return os.pread(fh, size, offset)

    def release(self, path, fh):
        os.close(fh)
        return 0

    def statfs(self, path):
        st = os.statvfs(self._path(path))
        return {key: getattr(st, key) for key in ("f_bsize", "f_frsize", "f_blocks", "f_bfree", "f_bavail",
                                                   "f_files", "f_ffree", "f_namemax")}

    # changes
    def create(self, path, mode, fi=None):
        self._change()
        return os.open(self._path(path), os.O_WRONLY | os.O_CREAT | os.O_TRUNC, mode)

    def write(self, path, data, offset, fh):
        self._change()
        return os.pwrite(fh, data, offset)

    def truncate(self, path, length, fh=None):
        self._change()
        os.truncate(self._path(path), length)

    def fsync(self, path, datasync, fh):
        os.fsync(fh)
        return 0

    def mkdir(self, path, mode):
        self._change()
        os.mkdir(self._path(path), mode)

    def rmdir(self, path):
        self._change()
        os.rmdir(self._path(path))

    def unlink(self, path):
        self._change()
        os.unlink(self._path(path))

    def rename(self, old, new):
        self._change()
        os.rename(self._path(old), self._path(new))

    def symlink(self, target, source):
        self._change()
        os.symlink(source, self._path(target))

    def link(self, target, source):
        self._change()
        os.link(self._path(source), self._path(target))

    def chmod(self, path, mode):
        self._change()
        os.chmod(self._path(path), mode, follow_symlinks=False)

    def utimens(self, path, times=None):
        self._change()
        os.utime(self._path(path), ns=times, follow_symlinks=False)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("backing")
    parser.add_argument("mountpoint")
    parser.add_argument("--fail-after", type=int, required=True)
    parser.add_argument("--errno", default="EIO", choices=("EIO", "EACCES"))
    args = parser.parse_args()
    error = getattr(errno, args.errno)
    fuse.FUSE(FaultyPassThrough(os.path.abspath(args.backing), args.fail_after, error), args.mountpoint,
              foreground=True, nothreads=True, default_permissions=True)


if __name__ == "__main__":
    main()
