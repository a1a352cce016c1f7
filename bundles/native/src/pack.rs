//! Build one shard's uncompressed tar bytes from the source tree: headers, stable reads, content hashes.

use crate::columns::Columns;
use crate::fsio::{self, Fd};
use crate::header::{member_header, padding, FILE};
use md5::{Digest, Md5};
use xxhash_rust::xxh3::xxh3_128;

const END_OF_ARCHIVE: usize = 1024;
// O_NONBLOCK: a FIFO put in a file's place never blocks the read (it fails the regular-file check instead)
const READ_FLAGS: libc::c_int =
    libc::O_RDONLY | libc::O_NOFOLLOW | libc::O_CLOEXEC | libc::O_NONBLOCK;

/// Why a source file could not be read as the scan saw it (Python turns it into its SourceError).
pub enum ReadFailure {
    /// open(2) or read(2) failed, or the size differs from the scan's: Python reads it again to explain.
    Unreadable(usize),
    /// Its size, mtime or ctime moved while it was read a second time.
    Changing(usize),
    /// The shard cannot be held in memory (sizes from a hostile or absurd index, or memory exhausted).
    TooLarge(usize),
}

/// One built shard, before compression.
pub struct RawShard {
    pub raw: Vec<u8>,
    pub file_bytes: u64,
    pub hashes: Vec<u8>,
    pub offsets: Vec<u64>,
    pub data_offsets: Vec<u64>,
    pub md5s: Vec<u8>,
}

/// Build the tar bytes of all `entries`, reading files under `root` (with a trailing slash).
pub fn build_shard(
    root: &[u8],
    entries: &Columns,
    last: bool,
    md5: bool,
) -> Result<RawShard, ReadFailure> {
    let n = entries.len();
    let estimate = (0..n).try_fold(END_OF_ARCHIVE as u64, |total, i| {
        total
            .checked_add(entries.size(i))
            .and_then(|t| t.checked_add(1536))
            .ok_or(i)
    });
    let mut raw = Vec::new();
    match estimate.map(usize::try_from) {
        Ok(Ok(bytes)) if raw.try_reserve_exact(bytes).is_ok() => {}
        Ok(_) => return Err(ReadFailure::TooLarge(n.saturating_sub(1))),
        Err(i) => return Err(ReadFailure::TooLarge(i)),
    }
    let mut shard = RawShard {
        raw,
        file_bytes: 0,
        hashes: Vec::with_capacity(16 * n),
        offsets: Vec::with_capacity(n),
        data_offsets: Vec::with_capacity(n),
        md5s: Vec::new(),
    };
    let mut path = root.to_vec();
    for i in 0..n {
        shard.offsets.push(shard.raw.len() as u64);
        member_header(&mut shard.raw, &entries.member(i));
        shard.data_offsets.push(shard.raw.len() as u64);
        if entries.kind(i) != FILE {
            shard.hashes.extend_from_slice(&[0u8; 16]);
            continue;
        }
        path.truncate(root.len());
        path.extend_from_slice(entries.paths[i]);
        let size = entries.size(i);
        let start = shard.raw.len();
        read_file(&path, size, entries.mtime(i), &mut shard.raw).map_err(|changing| {
            if changing {
                ReadFailure::Changing(i)
            } else {
                ReadFailure::Unreadable(i)
            }
        })?;
        let data = &shard.raw[start..];
        shard
            .hashes
            .extend_from_slice(&xxh3_128(data).to_be_bytes());
        if md5 {
            shard.md5s.extend_from_slice(&Md5::digest(data));
        }
        shard.file_bytes += size;
        shard.raw.resize(shard.raw.len() + padding(size), 0);
    }
    if last {
        shard.raw.resize(shard.raw.len() + END_OF_ARCHIVE, 0);
    }
    Ok(shard)
}

/// Append exactly `size` bytes of the file at `path` to `out`, read as bundles/shards.py's `_read_file` does:
/// one read and one fstat that must show the scan's size and mtime; otherwise two more reads between two
/// fstat calls, which must not see the size, mtime or ctime move and must give the same bytes (writes
/// within one tick of the kernel's coarse file clock leave mtime unchanged). Err(true) means it moved (changing),
/// Err(false) that it could not be read or its size differs.
fn read_file(path: &[u8], size: u64, mtime_ns: i64, out: &mut Vec<u8>) -> Result<(), bool> {
    let fd = fsio::open(path, READ_FLAGS, 0).map_err(|_| false)?;
    let start = out.len();
    let got = read_into(&fd, size, out)?;
    let after = fsio::fstat(&fd).map_err(|_| false)?;
    let regular = after.st_mode & libc::S_IFMT == libc::S_IFREG;
    if got == size && after.st_size as u64 == size && fsio::mtime_ns(&after) == mtime_ns && regular
    {
        out.truncate(start + size as usize);
        return Ok(());
    }
    out.truncate(start);
    fsio::rewind(&fd).map_err(|_| false)?;
    let before = fsio::fstat(&fd).map_err(|_| false)?;
    let got = read_into(&fd, size, out)?;
    fsio::rewind(&fd).map_err(|_| false)?;
    let mut again = Vec::with_capacity(size as usize + 1);
    read_into(&fd, size, &mut again)?;
    let after = fsio::fstat(&fd).map_err(|_| false)?;
    if got != size || after.st_mode & libc::S_IFMT != libc::S_IFREG {
        out.truncate(start);
        return Err(false);
    }
    let stamp = |st: &libc::stat| (st.st_size, fsio::mtime_ns(st), fsio::ctime_ns(st));
    let moved = stamp(&before) != stamp(&after) || again[..] != out[start..];
    out.truncate(start + size as usize);
    if moved {
        return Err(true);
    }
    Ok(())
}

/// Read up to `size + 1` bytes (one more shows that the file grew) onto `out`; return how many were read.
fn read_into(fd: &Fd, size: u64, out: &mut Vec<u8>) -> Result<u64, bool> {
    let start = out.len();
    out.resize(start + size as usize + 1, 0);
    let got = fsio::read_full(fd, &mut out[start..]).map_err(|_| false)?;
    out.truncate(start + got);
    Ok(got as u64)
}
