//! Check a shard's tar bytes against the index and write its regular files under the destination.

use crate::columns::{u64_at, Columns};
use crate::fsio::{self, Fd};
use crate::header::{member_header, FILE, HARDLINK};
use std::io;
use xxhash_rust::xxh3::xxh3_128;

const BLOCK: u64 = 512;
const END_OF_ARCHIVE: usize = 1024;
const OPEN_FLAGS: libc::c_int =
    libc::O_WRONLY | libc::O_CREAT | libc::O_EXCL | libc::O_NOFOLLOW | libc::O_CLOEXEC;
const STRIPPED_MODE_BITS: u32 = 0o6000;

/// Where each entry sits in the shard's tar bytes (native-endian `array("Q")` bytes).
pub struct Layout<'a> {
    pub offsets: &'a [u8],
    pub data_offsets: &'a [u8],
}

/// Return None when `data` holds exactly the members of `entries`, each header byte for byte as pallet
/// writes it at its offset, followed only by zero padding and the end-of-archive blocks; otherwise the
/// number of the first entry that differs, or `entries.len()` when the bytes after the last one are wrong.
pub fn check_members(data: &[u8], entries: &Columns, layout: &Layout) -> Option<usize> {
    let mut position: u64 = 0;
    let mut header = Vec::with_capacity(1536);
    for i in 0..entries.len() {
        let start = u64_at(layout.offsets, i);
        let data_start = u64_at(layout.data_offsets, i);
        if start != position
            || data_start < start
            || data_start > data.len() as u64
            || entries.kind(i) > HARDLINK
        {
            return Some(i);
        }
        header.clear();
        member_header(&mut header, &entries.member(i));
        if data[start as usize..data_start as usize] != header[..] {
            return Some(i);
        }
        position = data_start;
        if entries.kind(i) == FILE {
            let size = entries.size(i);
            let padded = size.checked_add((BLOCK - size % BLOCK) % BLOCK);
            match padded.and_then(|padded| position.checked_add(padded)) {
                Some(end) => position = end,
                None => return Some(i),
            }
        }
    }
    // `entries.len()` stands for "after the last entry": extra or missing bytes at the end
    if position > data.len() as u64 {
        return Some(entries.len());
    }
    let rest = &data[position as usize..];
    let only_end =
        (rest.is_empty() || rest.len() == END_OF_ARCHIVE) && rest.iter().all(|&b| b == 0);
    (!only_end).then_some(entries.len())
}

/// The regular files of `entries` whose content in `data` (at their data offsets) is missing or does not
/// match their xxh3-128 in `hashes`, in entry order.
pub fn content_mismatches(
    data: &[u8],
    entries: &Columns,
    layout: &Layout,
    hashes: &[u8],
) -> Vec<usize> {
    (0..entries.len())
        .filter(|&i| entries.kind(i) == FILE)
        .filter(|&i| {
            let start = u64_at(layout.data_offsets, i);
            match file_content(data, start, entries.size(i)) {
                Some(content) => xxh3_128(content).to_be_bytes()[..] != hashes[16 * i..16 * i + 16],
                None => true,
            }
        })
        .collect()
}

/// The `size` bytes at `start` in `data`, if they are all there (an empty file always is).
fn file_content(data: &[u8], start: u64, size: u64) -> Option<&[u8]> {
    match start.checked_add(size) {
        _ if size == 0 => Some(&data[..0]),
        Some(end) if end <= data.len() as u64 => Some(&data[start as usize..end as usize]),
        _ => None,
    }
}

/// What extracting a shard's files did, or the entry whose write failed.
pub enum ExtractFailure {
    /// A system call failed at entry `.0` with the error `.1`.
    Write(usize, io::Error),
    /// Entry `.0` is a directory in the destination but a file in the bundle.
    IsDirectory(usize),
}

/// Counts of what `extract_files` wrote, and the entries whose content was missing or did not verify.
pub struct Extracted {
    pub files: u64,
    pub bytes: u64,
    pub bad: Vec<usize>,
}

/// Write every regular file of `entries` under `root` (with a trailing slash) from `data`, where each file's
/// content starts at its data offset; with `verify`, a file whose xxh3-128 differs from `hashes` is not
/// written but listed. A file is created anew (a stale file or link in its place is unlinked, never written
/// through), with the safe form of its mode and its mtime. `umask`, when known, lets the mode be given at
/// creation.
pub fn extract_files(
    data: &[u8],
    root: &[u8],
    entries: &Columns,
    layout: &Layout,
    hashes: &[u8],
    verify: bool,
    umask: Option<u32>,
) -> Result<Extracted, ExtractFailure> {
    let mut done = Extracted {
        files: 0,
        bytes: 0,
        bad: Vec::new(),
    };
    let mut path = root.to_vec();
    for i in 0..entries.len() {
        if entries.kind(i) != FILE {
            continue;
        }
        let start = u64_at(layout.data_offsets, i);
        let size = entries.size(i);
        let Some(content) = file_content(data, start, size) else {
            done.bad.push(i);
            continue;
        };
        if verify && xxh3_128(content).to_be_bytes()[..] != hashes[16 * i..16 * i + 16] {
            done.bad.push(i);
            continue;
        }
        path.truncate(root.len());
        path.extend_from_slice(entries.paths[i]);
        write_file(&path, content, entries.mode(i), entries.mtime(i), umask).map_err(
            |failure| match failure {
                None => ExtractFailure::IsDirectory(i),
                Some(err) => ExtractFailure::Write(i, err),
            },
        )?;
        done.files += 1;
        done.bytes += size;
    }
    Ok(done)
}

/// Create `path` holding `content` (Err(None): a directory stands there).
pub(crate) fn write_file(
    path: &[u8],
    content: &[u8],
    mode: u32,
    mtime_ns: i64,
    umask: Option<u32>,
) -> Result<(), Option<io::Error>> {
    let wanted = mode & 0o7777 & !STRIPPED_MODE_BITS;
    let direct = umask.is_some_and(|mask| wanted & mask == 0);
    let fd = create_file(path, if direct { wanted } else { 0o600 })?;
    fsio::write_all(&fd, content).map_err(Some)?;
    if !direct {
        fsio::fchmod(&fd, wanted).map_err(Some)?;
    }
    fsio::set_mtime(&fd, mtime_ns).map_err(Some)?;
    fsio::close(fd).map_err(Some)
}

/// Open a new, empty file at `path`, unlinking first whatever non-directory stands there.
fn create_file(path: &[u8], mode: u32) -> Result<Fd, Option<io::Error>> {
    match fsio::open(path, OPEN_FLAGS, mode) {
        Ok(fd) => return Ok(fd),
        Err(err) if err.raw_os_error() != Some(libc::EEXIST) => return Err(Some(err)),
        Err(_) => {}
    }
    match fsio::lstat(path) {
        Ok(st) if st.st_mode & libc::S_IFMT == libc::S_IFDIR => return Err(None),
        _ => {}
    }
    match fsio::unlink(path) {
        Err(err) if err.raw_os_error() != Some(libc::ENOENT) => return Err(Some(err)),
        _ => {}
    }
    fsio::open(path, OPEN_FLAGS, mode).map_err(Some)
}
