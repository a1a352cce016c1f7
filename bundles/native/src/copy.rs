//! Copy regular files from one local tree to another on several threads (`copy_file_range`, falling back
//! to read/write), keeping mode and times; each target is created from its parent directory's descriptor,
//! reached from the target root one `O_NOFOLLOW` step at a time, and a stale file or planted link at its
//! name is unlinked first: nothing is ever written through a link, even one swapped in while the copy runs.

use crate::fsio::{self, Fd};
use std::io;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Mutex;

const SOURCE_FLAGS: libc::c_int =
    libc::O_RDONLY | libc::O_NOFOLLOW | libc::O_CLOEXEC | libc::O_NONBLOCK;
const TARGET_FLAGS: libc::c_int =
    libc::O_WRONLY | libc::O_CREAT | libc::O_EXCL | libc::O_NOFOLLOW | libc::O_CLOEXEC;
const DIRECTORY_FLAGS: libc::c_int =
    libc::O_RDONLY | libc::O_DIRECTORY | libc::O_NOFOLLOW | libc::O_CLOEXEC;
const CHUNK: usize = 1 << 20;

/// How one file's copy failed: the error, and whether it concerned the target (else the source).
pub struct CopyFailure {
    pub entry: usize,
    pub error: io::Error,
    pub on_target: bool,
}

/// Copy `items` (relative names of regular files) from `src_root` to `dst_root` (both with a trailing
/// slash) on `threads` threads; the targets' parent directories exist. Returns the bytes copied and the
/// failures, in entry order.
pub fn copy_files(
    src_root: &[u8],
    dst_root: &[u8],
    items: &[&[u8]],
    threads: usize,
) -> (u64, Vec<CopyFailure>) {
    let next = AtomicUsize::new(0);
    let copied = AtomicUsize::new(0);
    let failures = Mutex::new(Vec::new());
    std::thread::scope(|scope| {
        for _ in 0..threads.clamp(1, items.len().max(1)) {
            scope.spawn(|| {
                let mut buffer = Vec::new();
                let mut parent = Parent::default();
                loop {
                    let entry = next.fetch_add(1, Ordering::Relaxed);
                    let Some(item) = items.get(entry) else { break };
                    let source = [src_root, item].concat();
                    match copy_one(&source, dst_root, item, &mut parent, &mut buffer) {
                        Ok(bytes) => {
                            copied.fetch_add(bytes as usize, Ordering::Relaxed);
                        }
                        Err((error, on_target)) => {
                            let failure = CopyFailure {
                                entry,
                                error,
                                on_target,
                            };
                            failures
                                .lock()
                                .unwrap_or_else(|poisoned| poisoned.into_inner())
                                .push(failure);
                        }
                    }
                }
            });
        }
    });
    let mut failures = failures
        .into_inner()
        .unwrap_or_else(|poisoned| poisoned.into_inner());
    failures.sort_by_key(|failure| failure.entry);
    (copied.into_inner() as u64, failures)
}

type Failed = (io::Error, bool);

fn copy_one(
    source: &[u8],
    dst_root: &[u8],
    item: &[u8],
    parent: &mut Parent,
    buffer: &mut Vec<u8>,
) -> Result<u64, Failed> {
    let from = fsio::open(source, SOURCE_FLAGS, 0).map_err(|e| (e, false))?;
    let st = fsio::fstat(&from).map_err(|e| (e, false))?;
    if st.st_mode & libc::S_IFMT != libc::S_IFREG {
        return Err((io::Error::from_raw_os_error(libc::EINVAL), false));
    }
    let (dir, name) = parent.of(dst_root, item).map_err(|e| (e, true))?;
    let to = create(dir, name).map_err(|e| (e, true))?;
    let size = st.st_size as u64;
    copy_data(&from, &to, size, buffer)?;
    fsio::fchmod(&to, st.st_mode & 0o7777).map_err(|e| (e, true))?;
    let atime = st.st_atime * 1_000_000_000 + st.st_atime_nsec;
    fsio::set_times(&to, atime, fsio::mtime_ns(&st)).map_err(|e| (e, true))?;
    fsio::close(to).map_err(|e| (e, true))?;
    Ok(size)
}

/// The directory a thread last created a file in, kept open: items come sorted, so most share it.
#[derive(Default)]
struct Parent {
    path: Vec<u8>,
    dir: Option<Fd>,
}

impl Parent {
    /// The open parent directory of `item` under `root` (a path with a trailing slash, the caller's word),
    /// and the item's own name. Each directory below the root is opened from the one above it with
    /// `O_NOFOLLOW`, so a symbolic link there (one swapped in meanwhile too) fails with ELOOP or ENOTDIR.
    fn of<'a>(&mut self, root: &[u8], item: &'a [u8]) -> io::Result<(&Fd, &'a [u8])> {
        let (path, name) = match item.iter().rposition(|&b| b == b'/') {
            Some(at) => (&item[..at], &item[at + 1..]),
            None => (&item[..0], item),
        };
        if self.dir.is_none() || self.path != path {
            self.dir = None;
            let mut dir = fsio::open(root, DIRECTORY_FLAGS & !libc::O_NOFOLLOW, 0)?;
            for part in path.split(|&b| b == b'/').filter(|part| !part.is_empty()) {
                dir = fsio::openat(&dir, part, DIRECTORY_FLAGS, 0)?;
            }
            self.path = path.to_vec();
            self.dir = Some(dir);
        }
        match &self.dir {
            Some(dir) => Ok((dir, name)),
            None => Err(io::Error::from_raw_os_error(libc::EBADF)),
        }
    }
}

/// Create `name` in `dir` anew: whatever non-directory stands there (a stale file, a link) is unlinked first.
fn create(dir: &Fd, name: &[u8]) -> io::Result<Fd> {
    match fsio::openat(dir, name, TARGET_FLAGS, 0o600) {
        Err(err) if err.raw_os_error() == Some(libc::EEXIST) => {}
        other => return other,
    }
    if fsio::lstatat(dir, name)?.st_mode & libc::S_IFMT == libc::S_IFDIR {
        return Err(io::Error::from_raw_os_error(libc::EISDIR));
    }
    match fsio::unlinkat(dir, name) {
        Err(err) if err.raw_os_error() != Some(libc::ENOENT) => return Err(err),
        _ => {}
    }
    fsio::openat(dir, name, TARGET_FLAGS, 0o600)
}

/// Copy `size` bytes in the kernel where it can; read and write through `buffer` where it cannot.
fn copy_data(from: &Fd, to: &Fd, size: u64, buffer: &mut Vec<u8>) -> Result<(), Failed> {
    let mut done = 0u64;
    while done < size {
        let want = (size - done).min(1 << 30) as usize;
        // SAFETY: both descriptors are open and owned by the caller; null offsets use the file positions.
        let n = unsafe {
            libc::copy_file_range(
                from.0,
                std::ptr::null_mut(),
                to.0,
                std::ptr::null_mut(),
                want,
                0,
            )
        };
        if n > 0 {
            done += n as u64;
            continue;
        }
        if n == 0 {
            return Err((io::Error::from_raw_os_error(libc::ENODATA), false)); // the source shrank
        }
        let err = io::Error::last_os_error();
        match err.raw_os_error() {
            Some(libc::EINTR) => continue,
            Some(libc::ENOSYS | libc::EXDEV | libc::EINVAL | libc::EOPNOTSUPP) => break,
            _ => return Err((err, true)),
        }
    }
    if buffer.is_empty() && done < size {
        buffer.resize(CHUNK, 0);
    }
    while done < size {
        let want = (size - done).min(CHUNK as u64) as usize;
        let got = fsio::read_full(from, &mut buffer[..want]).map_err(|e| (e, false))?;
        if got == 0 {
            return Err((io::Error::from_raw_os_error(libc::ENODATA), false));
        }
        fsio::write_all(to, &buffer[..got]).map_err(|e| (e, true))?;
        done += got as u64;
    }
    Ok(())
}

/// What `kinds_of` reports for each item.
pub const KIND_FILE: u8 = 0;
pub const KIND_DIR: u8 = 1;
pub const KIND_OTHER: u8 = 2; // a symlink, a special file, or an lstat that failed: the caller looks itself
pub const KIND_LINKED_FILE: u8 = 3; // a regular file with more than one hard link

/// lstat every item under `root` (with a trailing slash) on `threads` threads and classify it.
pub fn kinds_of(root: &[u8], items: &[&[u8]], threads: usize) -> Vec<u8> {
    let chunk = items.len().div_ceil(threads.max(1)).max(1);
    std::thread::scope(|scope| {
        let parts: Vec<_> = items
            .chunks(chunk)
            .map(|part| {
                scope.spawn(move || {
                    part.iter()
                        .map(|item| kind_of(&[root, item].concat()))
                        .collect::<Vec<u8>>()
                })
            })
            .collect();
        parts
            .into_iter()
            .flat_map(|part| part.join().unwrap_or_default())
            .collect()
    })
}

fn kind_of(path: &[u8]) -> u8 {
    match fsio::lstat(path) {
        Ok(st) if st.st_mode & libc::S_IFMT == libc::S_IFDIR => KIND_DIR,
        Ok(st) if st.st_mode & libc::S_IFMT == libc::S_IFREG && st.st_nlink > 1 => KIND_LINKED_FILE,
        Ok(st) if st.st_mode & libc::S_IFMT == libc::S_IFREG => KIND_FILE,
        _ => KIND_OTHER,
    }
}
