//! Walk a source tree in tar's order and lstat every entry on several threads, into index columns.
//!
//! The walk lists each directory once (names sorted bytewise: the directory, its non-directories, then its
//! subdirectories, depth first), as `bundles/scan.py`'s `_walk` does. Entries the Python rules must look at
//! themselves (symlinks, special files, names holding `.pallet`, failed lstat calls, mtimes out of range)
//! are returned as "attention" entries with placeholder columns.

use crate::header::{DIR, FILE};
use std::ffi::OsStr;
use std::fs;
use std::io;
use std::os::unix::ffi::OsStrExt;
use std::os::unix::fs::MetadataExt;
use std::path::Path;

/// The columns of a scanned tree (numbers as native-endian bytes, as `array` takes them).
#[derive(Default)]
pub struct Scanned {
    pub names: Vec<Vec<u8>>,
    pub kinds: Vec<u8>,
    pub modes: Vec<u32>,
    pub mtimes: Vec<i64>,
    pub sizes: Vec<u64>,
    /// (entry, device, inode) of regular files with more than one link.
    pub multi_linked: Vec<[u64; 3]>,
    /// Entries whose columns Python fills itself.
    pub attention: Vec<u64>,
}

/// A directory that could not be listed, and why.
pub struct ListFailure {
    pub path: Vec<u8>,
    pub error: io::Error,
}

/// List every name under `root` in stream order (relative, without `root`).
pub fn walk(root: &[u8]) -> Result<Vec<Vec<u8>>, ListFailure> {
    let mut names = Vec::new();
    let mut stack: Vec<Vec<u8>> = vec![Vec::new()];
    while let Some(current) = stack.pop() {
        let full = if current.is_empty() {
            root.to_vec()
        } else {
            [root, b"/", &current].concat()
        };
        let mut children = list(&full).map_err(|error| ListFailure {
            path: full.clone(),
            error,
        })?;
        children.sort();
        let prefix = if current.is_empty() {
            Vec::new()
        } else {
            [&current[..], b"/"].concat()
        };
        if !current.is_empty() {
            names.push(current);
        }
        names.extend(
            children
                .iter()
                .filter(|(_, is_dir)| !is_dir)
                .map(|(name, _)| [&prefix[..], name].concat()),
        );
        stack.extend(
            children
                .iter()
                .rev()
                .filter(|(_, is_dir)| *is_dir)
                .map(|(name, _)| [&prefix[..], name].concat()),
        );
    }
    Ok(names)
}

/// The (name, is a directory, not following symlinks) pairs of one directory.
fn list(path: &[u8]) -> io::Result<Vec<(Vec<u8>, bool)>> {
    let mut children = Vec::new();
    for entry in fs::read_dir(Path::new(OsStr::from_bytes(path)))? {
        let entry = entry?;
        let is_dir = entry.file_type()?.is_dir();
        children.push((entry.file_name().as_bytes().to_vec(), is_dir));
    }
    Ok(children)
}

/// lstat every name under `root` with `threads` threads and fill the columns.
pub fn stat_all(root: &[u8], names: Vec<Vec<u8>>, threads: usize) -> Scanned {
    let chunk = names.len().div_ceil(threads.max(1)).max(1);
    let parts: Vec<Scanned> = std::thread::scope(|scope| {
        let handles: Vec<_> = names
            .chunks(chunk)
            .enumerate()
            .map(|(n, part)| scope.spawn(move || stat_part(root, part, n * chunk)))
            .collect();
        handles
            .into_iter()
            .map(|h| h.join().unwrap_or_default())
            .collect()
    });
    let mut all = Scanned {
        names,
        ..Scanned::default()
    };
    for part in parts {
        all.kinds.extend(part.kinds);
        all.modes.extend(part.modes);
        all.mtimes.extend(part.mtimes);
        all.sizes.extend(part.sizes);
        all.multi_linked.extend(part.multi_linked);
        all.attention.extend(part.attention);
    }
    all
}

fn stat_part(root: &[u8], names: &[Vec<u8>], first: usize) -> Scanned {
    let mut out = Scanned::default();
    let mut path = [root, b"/"].concat();
    let base = path.len();
    for (n, rel) in names.iter().enumerate() {
        path.truncate(base);
        path.extend_from_slice(rel);
        let entry = (first + n) as u64;
        let meta = fs::symlink_metadata(Path::new(OsStr::from_bytes(&path)));
        let mtime = meta.as_ref().ok().and_then(|m| {
            m.mtime()
                .checked_mul(1_000_000_000)?
                .checked_add(m.mtime_nsec())
        });
        let (kind, size) = match &meta {
            Ok(m) if m.file_type().is_file() => (FILE, m.size()),
            Ok(m) if m.file_type().is_dir() => (DIR, 0),
            _ => (FILE, 0),
        };
        let plain = meta
            .as_ref()
            .is_ok_and(|m| m.file_type().is_file() || m.file_type().is_dir());
        if !plain || mtime.is_none() || contains(rel, b".pallet") {
            out.attention.push(entry);
        } else if let Ok(m) = &meta {
            if kind == FILE && m.nlink() > 1 {
                out.multi_linked.push([entry, m.dev(), m.ino()]);
            }
        }
        out.kinds.push(kind);
        out.modes
            .push(meta.as_ref().map_or(0, |m| m.mode() & 0o7777));
        out.mtimes.push(mtime.unwrap_or(0));
        out.sizes.push(size);
    }
    out
}

fn contains(haystack: &[u8], needle: &[u8]) -> bool {
    haystack.windows(needle.len()).any(|w| w == needle)
}
