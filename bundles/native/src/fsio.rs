//! Thin, checked wrappers over the system calls the engine uses, with errno kept for the caller.

use std::ffi::CString;
use std::io;

/// An open file descriptor, closed on drop.
pub struct Fd(pub libc::c_int);

impl Drop for Fd {
    fn drop(&mut self) {
        // SAFETY: the descriptor was returned by open(2), is owned by this value alone and closed once.
        unsafe {
            libc::close(self.0);
        }
    }
}

/// Close a descriptor and report the error close(2) gives (a write-back failure on NFS, for one).
pub fn close(fd: Fd) -> io::Result<()> {
    let raw = fd.0;
    std::mem::forget(fd);
    // SAFETY: `raw` came from the owned `Fd`, which was forgotten, so it is closed exactly once, here.
    check(unsafe { libc::close(raw) }).map(|_| ())
}

fn c_path(path: &[u8]) -> io::Result<CString> {
    CString::new(path).map_err(|_| io::Error::from_raw_os_error(libc::EINVAL))
}

fn check(result: libc::c_int) -> io::Result<libc::c_int> {
    if result < 0 {
        Err(io::Error::last_os_error())
    } else {
        Ok(result)
    }
}

/// open(2) with `flags` and `mode`.
pub fn open(path: &[u8], flags: libc::c_int, mode: u32) -> io::Result<Fd> {
    let c = c_path(path)?;
    // SAFETY: `c` is a valid NUL-terminated string that outlives the call.
    let fd = check(unsafe { libc::open(c.as_ptr(), flags, mode as libc::c_uint) })?;
    Ok(Fd(fd))
}

/// fstat(2) of an open descriptor.
pub fn fstat(fd: &Fd) -> io::Result<libc::stat> {
    // SAFETY: an all-zero `stat` is a valid value of this plain C struct; fstat fills it.
    let mut st: libc::stat = unsafe { std::mem::zeroed() };
    // SAFETY: `st` is a valid, writable `stat` for the duration of the call.
    check(unsafe { libc::fstat(fd.0, &mut st) })?;
    Ok(st)
}

/// lstat(2) of a path.
pub fn lstat(path: &[u8]) -> io::Result<libc::stat> {
    let c = c_path(path)?;
    // SAFETY: as in `fstat`, an all-zero `stat` is valid and filled by the call.
    let mut st: libc::stat = unsafe { std::mem::zeroed() };
    // SAFETY: `c` is NUL-terminated and `st` writable for the duration of the call.
    check(unsafe { libc::lstat(c.as_ptr(), &mut st) })?;
    Ok(st)
}

/// unlink(2) of a path.
pub fn unlink(path: &[u8]) -> io::Result<()> {
    let c = c_path(path)?;
    // SAFETY: `c` is a valid NUL-terminated string.
    check(unsafe { libc::unlink(c.as_ptr()) }).map(|_| ())
}

/// Read into `buf` until it is full or the file ends; return the bytes read.
pub fn read_full(fd: &Fd, buf: &mut [u8]) -> io::Result<usize> {
    let mut done = 0;
    while done < buf.len() {
        let rest = &mut buf[done..];
        // SAFETY: `rest` is a valid writable region of `rest.len()` bytes.
        let n = unsafe { libc::read(fd.0, rest.as_mut_ptr().cast(), rest.len()) };
        if n < 0 {
            let err = io::Error::last_os_error();
            if err.kind() == io::ErrorKind::Interrupted {
                continue;
            }
            return Err(err);
        }
        if n == 0 {
            break;
        }
        done += n as usize;
    }
    Ok(done)
}

/// Write all of `data` to `fd`.
pub fn write_all(fd: &Fd, data: &[u8]) -> io::Result<()> {
    let mut done = 0;
    while done < data.len() {
        let rest = &data[done..];
        // SAFETY: `rest` is a valid readable region of `rest.len()` bytes.
        let n = unsafe { libc::write(fd.0, rest.as_ptr().cast(), rest.len()) };
        if n < 0 {
            let err = io::Error::last_os_error();
            if err.kind() == io::ErrorKind::Interrupted {
                continue;
            }
            return Err(err);
        }
        done += n as usize;
    }
    Ok(())
}

/// Move the file offset back to the start.
pub fn rewind(fd: &Fd) -> io::Result<()> {
    // SAFETY: lseek on an owned descriptor has no memory effects.
    let at = unsafe { libc::lseek(fd.0, 0, libc::SEEK_SET) };
    if at < 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}

/// fchmod(2).
pub fn fchmod(fd: &Fd, mode: u32) -> io::Result<()> {
    // SAFETY: fchmod on an owned descriptor has no memory effects.
    check(unsafe { libc::fchmod(fd.0, mode as libc::mode_t) }).map(|_| ())
}

/// Set access and modification time of an open file to `mtime_ns`.
pub fn set_mtime(fd: &Fd, mtime_ns: i64) -> io::Result<()> {
    set_times(fd, mtime_ns, mtime_ns)
}

/// Set the access time of an open file to `atime_ns` and its modification time to `mtime_ns`.
pub fn set_times(fd: &Fd, atime_ns: i64, mtime_ns: i64) -> io::Result<()> {
    let stamp = |ns: i64| libc::timespec {
        tv_sec: ns.div_euclid(1_000_000_000) as libc::time_t,
        tv_nsec: ns.rem_euclid(1_000_000_000) as libc::c_long,
    };
    let times = [stamp(atime_ns), stamp(mtime_ns)];
    // SAFETY: `times` points to two valid timespec values for the duration of the call.
    check(unsafe { libc::futimens(fd.0, times.as_ptr()) }).map(|_| ())
}

/// The nanosecond form of a stat's mtime.
pub fn mtime_ns(st: &libc::stat) -> i64 {
    st.st_mtime * 1_000_000_000 + st.st_mtime_nsec
}

/// The nanosecond form of a stat's ctime.
pub fn ctime_ns(st: &libc::stat) -> i64 {
    st.st_ctime * 1_000_000_000 + st.st_ctime_nsec
}

/// mkdir(2) of a path with `mode` (less the umask).
pub fn mkdir(path: &[u8], mode: u32) -> io::Result<()> {
    let c = c_path(path)?;
    // SAFETY: `c` is a valid NUL-terminated string that outlives the call.
    check(unsafe { libc::mkdir(c.as_ptr(), mode as libc::mode_t) }).map(|_| ())
}

/// openat(2) of `name` relative to the directory `dir`, with `flags` and `mode`.
pub fn openat(dir: &Fd, name: &[u8], flags: libc::c_int, mode: u32) -> io::Result<Fd> {
    let c = c_path(name)?;
    // SAFETY: `dir` is an open descriptor and `c` a valid NUL-terminated string for the call.
    let fd = check(unsafe { libc::openat(dir.0, c.as_ptr(), flags, mode as libc::c_uint) })?;
    Ok(Fd(fd))
}

/// fstatat(2) of `name` in the directory `dir`, not following a link at `name`.
pub fn lstatat(dir: &Fd, name: &[u8]) -> io::Result<libc::stat> {
    let c = c_path(name)?;
    // SAFETY: as in `fstat`, an all-zero `stat` is valid and filled by the call.
    let mut st: libc::stat = unsafe { std::mem::zeroed() };
    // SAFETY: `dir` is open, `c` NUL-terminated and `st` writable for the duration of the call.
    check(unsafe { libc::fstatat(dir.0, c.as_ptr(), &mut st, libc::AT_SYMLINK_NOFOLLOW) })?;
    Ok(st)
}

/// unlinkat(2) of the non-directory `name` in the directory `dir`.
pub fn unlinkat(dir: &Fd, name: &[u8]) -> io::Result<()> {
    let c = c_path(name)?;
    // SAFETY: `dir` is an open descriptor and `c` a valid NUL-terminated string for the call.
    check(unsafe { libc::unlinkat(dir.0, c.as_ptr(), 0) }).map(|_| ())
}
