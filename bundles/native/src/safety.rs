//! A conservative pre-check of the extraction rules: proves the common, plain tree safe, else defers.
//!
//! `bundles/safety.py` holds the rules. This check says `true` only for an index whose entries are all
//! regular files and directories with plain relative names (no empty, `.` or `..` component, no NUL, no
//! name starting with `.pallet`), no duplicates, and every parent a directory listed earlier: the case where
//! the rules find nothing. For anything else it says `false` and the Python rules decide and explain.

use crate::header::{DIR, FILE};
use std::collections::HashSet;

/// True when every entry passes the plain-name fast path of `bundles/safety.py` and is a file or directory.
pub fn trivially_safe(paths: &[&[u8]], kinds: &[u8]) -> bool {
    let mut seen: HashSet<&[u8]> = HashSet::with_capacity(paths.len());
    let mut directories: HashSet<&[u8]> = HashSet::new();
    for (&path, &kind) in paths.iter().zip(kinds) {
        if (kind != FILE && kind != DIR) || !plain_name(path) || !seen.insert(path) {
            return false;
        }
        if let Some(cut) = path.iter().rposition(|&b| b == b'/') {
            if !directories.contains(&path[..cut]) {
                return false;
            }
        }
        if kind == DIR {
            directories.insert(path);
        }
    }
    true
}

/// A relative name of non-empty components, none `.`, `..` or starting with `.pallet`, and no NUL.
pub(crate) fn plain_name(path: &[u8]) -> bool {
    !path.is_empty()
        && !path.contains(&0)
        && path.split(|&b| b == b'/').all(|part| {
            !part.is_empty() && part != b"." && part != b".." && !part.starts_with(b".pallet")
        })
}
