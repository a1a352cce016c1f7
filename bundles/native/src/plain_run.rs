//! Write runs of simple members of a plain tar archive straight from a window of its decompressed bytes.
//!
//! The rules are those of `bundles/plain.py`, which stays the judge: a run writes a member only when
//! Python would write it the same way without a question (a regular file or directory whose name has no
//! empty, `.`, `..` or reserved component, not under a symlink member seen so far nor named as a link
//! member, whose data is all in the window). At the first member that is not such a member, or whose creation fails in any way, the run
//! stops before it and Python reads that member itself: its errors and refusals are Python's.

use crate::fsio;
use crate::plain_header::{is_zero_block, simple_member, SimpleKind, SimpleMember, BLOCK};
use crate::safety::plain_name;
use crate::unpack::write_file;
use std::collections::HashSet;

/// A directory member is made private and given its own mode last; a parent the archive does not list gets
/// what `mkdir -p` (and GNU tar) would give it: 0o777 less the umask.
const MEMBER_DIRECTORY_MODE: u32 = 0o700;
const PARENT_DIRECTORY_MODE: u32 = 0o777;

/// Where a run stopped: a member Python must read, or one that needs more bytes in the window.
#[derive(Debug, PartialEq, Eq)]
pub enum Stop {
    /// The member at the stop (or the end of the archive) is for the Python reader.
    Python,
    /// The member at the stop needs this many bytes, counted from its header, to be whole in the window.
    Needs(u64),
}

/// What one run did: bytes of the window it consumed, what it wrote, and why it stopped.
pub struct RunOutcome {
    pub consumed: usize,
    pub entries: u64,
    pub files: u64,
    pub bytes: u64,
    /// Directory members written, with their mode and mtime (ns), for Python to apply last.
    pub directories: Vec<(Vec<u8>, u32, i64)>,
    pub stop: Stop,
}

/// The state of one extraction, kept across runs: the destination, what is known to be there, and the
/// names of symlink members and of all link members met so far (told by Python, which reads them; a later
/// member of a link's name replaces it, which Python does).
pub struct PlainExtraction {
    root: Vec<u8>,
    umask: Option<u32>,
    pub symlinks: HashSet<Vec<u8>>,
    pub links: HashSet<Vec<u8>>,
    pub files: HashSet<Vec<u8>>,
    directories_there: HashSet<Vec<u8>>,
}

impl PlainExtraction {
    /// An extraction into `root` (which ends with a slash).
    pub fn new(root: &[u8], umask: Option<u32>) -> Self {
        PlainExtraction {
            root: root.to_vec(),
            umask,
            symlinks: HashSet::new(),
            links: HashSet::new(),
            files: HashSet::new(),
            directories_there: HashSet::new(),
        }
    }

    /// Write the simple members found in `window` from its start; see the module docs for where it stops.
    pub fn run(&mut self, window: &[u8]) -> RunOutcome {
        let mut done = RunOutcome {
            consumed: 0,
            entries: 0,
            files: 0,
            bytes: 0,
            directories: Vec::new(),
            stop: Stop::Python,
        };
        loop {
            let rest = &window[done.consumed..];
            if rest.len() < BLOCK {
                done.stop = Stop::Needs(BLOCK as u64);
                return done;
            }
            let block = &rest[..BLOCK];
            let Some(member) = (!is_zero_block(block))
                .then(|| simple_member(block))
                .flatten()
            else {
                return done;
            };
            let length = member_length(&member);
            if length > rest.len() as u64 {
                done.stop = Stop::Needs(length);
                return done;
            }
            if !self.write_member(&member, &rest[BLOCK..], &mut done) {
                return done;
            }
            done.consumed += length as usize;
        }
    }

    /// Write one member whose data starts `data`; false (nothing counted) when Python must take it.
    fn write_member(&mut self, member: &SimpleMember, data: &[u8], done: &mut RunOutcome) -> bool {
        let name = normalized(member.name);
        if name.is_empty() {
            return true; // the archive's root, "./": Python skips it too
        }
        if !plain_name(&name)
            || self.links.contains(&name)
            || self.under_symlink(&name)
            || !self.make_parents(&name)
        {
            return false;
        }
        let mtime_ns = match i64::try_from(member.mtime) {
            Ok(seconds) if seconds <= i64::MAX / 1_000_000_000 => seconds * 1_000_000_000,
            _ => return false,
        };
        match member.kind {
            SimpleKind::Directory => {
                if !self.make_directory(&name, MEMBER_DIRECTORY_MODE) {
                    return false;
                }
                done.directories.push((name, member.mode, mtime_ns));
            }
            SimpleKind::File => {
                let content = &data[..member.size as usize];
                let path = [&self.root[..], &name[..]].concat();
                if write_file(&path, content, member.mode, mtime_ns, self.umask).is_err() {
                    return false;
                }
                self.files.insert(name);
                done.files += 1;
                done.bytes += member.size;
            }
        }
        done.entries += 1;
        true
    }

    /// True when a proper prefix of `name` is a symlink member seen so far.
    fn under_symlink(&self, name: &[u8]) -> bool {
        !self.symlinks.is_empty()
            && name
                .iter()
                .enumerate()
                .any(|(i, &b)| b == b'/' && self.symlinks.contains(&name[..i]))
    }

    /// Make or find every directory above `name`; false when one is not a real directory or cannot be made.
    fn make_parents(&mut self, name: &[u8]) -> bool {
        name.iter()
            .enumerate()
            .filter(|&(_, &b)| b == b'/')
            .all(|(i, _)| self.make_directory(&name[..i], PARENT_DIRECTORY_MODE))
    }

    /// Make or find directory `name` (all its parents there); false when something else stands there.
    fn make_directory(&mut self, name: &[u8], mode: u32) -> bool {
        if self.directories_there.contains(name) {
            return true;
        }
        let path = [&self.root[..], name].concat();
        let made = match fsio::mkdir(&path, mode) {
            Ok(()) => true,
            Err(err) if err.raw_os_error() == Some(libc::EEXIST) => is_real_directory(&path),
            Err(_) => false,
        };
        if made {
            self.directories_there.insert(name.to_vec());
        }
        made
    }
}

/// lstat says a directory (not a link to one).
fn is_real_directory(path: &[u8]) -> bool {
    fsio::lstat(path).is_ok_and(|st| st.st_mode & libc::S_IFMT == libc::S_IFDIR)
}

/// Header, data and padding of a member: where the next header starts, relative to this one.
fn member_length(member: &SimpleMember) -> u64 {
    let data = match member.kind {
        SimpleKind::File => {
            member.size.saturating_add(BLOCK as u64 - 1) / BLOCK as u64 * BLOCK as u64
        }
        SimpleKind::Directory => 0, // tarfile reads no data after a directory header
    };
    (BLOCK as u64).saturating_add(data)
}

/// `name` without empty and `.` components, as `_normalized` in bundles/plain.py; a leading slash is kept
/// (so the name is not plain and Python refuses it).
pub fn normalized(name: &[u8]) -> Vec<u8> {
    if name.starts_with(b"/") {
        return name.to_vec();
    }
    let parts: Vec<&[u8]> = name
        .split(|&b| b == b'/')
        .filter(|part| !part.is_empty() && *part != b".")
        .collect();
    parts.join(&b'/')
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn normalizes_as_python_does() {
        assert_eq!(normalized(b"./a//b/./c/"), b"a/b/c".to_vec());
        assert_eq!(normalized(b"./"), Vec::<u8>::new());
        assert_eq!(normalized(b"/etc/x"), b"/etc/x".to_vec());
    }

    #[test]
    fn a_proper_prefix_that_is_a_symlink_stops_the_run() {
        let mut run = PlainExtraction::new(b"/nonexistent/", None);
        run.symlinks.insert(b"a/l".to_vec());
        assert!(run.under_symlink(b"a/l/x"));
        assert!(!run.under_symlink(b"a/l"));
        assert!(!run.under_symlink(b"a/lx/y"));
    }
}
