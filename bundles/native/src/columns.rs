//! Entry columns handed over from Python: NUL-joined names and native-endian arrays, read without copying.

use crate::header::Member;

/// Split a NUL-joined blob into its `count` parts (an empty blob holds one empty part).
pub fn split_blob(blob: &[u8], count: usize) -> Option<Vec<&[u8]>> {
    let parts: Vec<&[u8]> = if count == 0 {
        Vec::new()
    } else {
        blob.split(|&b| b == 0).collect()
    };
    (parts.len() == count).then_some(parts)
}

/// Read element `i` of a native-endian array of `N`-byte values.
fn element<const N: usize>(raw: &[u8], i: usize) -> [u8; N] {
    let mut out = [0u8; N];
    out.copy_from_slice(&raw[i * N..(i + 1) * N]);
    out
}

/// The metadata columns of a run of entries (kinds, modes, mtimes and sizes as `array` bytes).
pub struct Columns<'a> {
    pub paths: Vec<&'a [u8]>,
    pub links: Vec<&'a [u8]>,
    pub kinds: &'a [u8],
    pub modes: &'a [u8],
    pub mtimes: &'a [u8],
    pub sizes: &'a [u8],
    /// Headers in format version 1 (nanoseconds in pax records); see `Member::nanoseconds`.
    pub nanoseconds: bool,
}

impl<'a> Columns<'a> {
    /// Check that every column holds `paths.len()` entries.
    pub fn consistent(&self) -> bool {
        let n = self.paths.len();
        self.links.len() == n
            && self.kinds.len() == n
            && self.modes.len() == 4 * n
            && self.mtimes.len() == 8 * n
            && self.sizes.len() == 8 * n
    }

    pub fn len(&self) -> usize {
        self.paths.len()
    }

    pub fn kind(&self, i: usize) -> u8 {
        self.kinds[i]
    }

    pub fn size(&self, i: usize) -> u64 {
        u64::from_ne_bytes(element(self.sizes, i))
    }

    pub fn mode(&self, i: usize) -> u32 {
        u32::from_ne_bytes(element(self.modes, i))
    }

    pub fn mtime(&self, i: usize) -> i64 {
        i64::from_ne_bytes(element(self.mtimes, i))
    }

    pub fn member(&self, i: usize) -> Member<'a> {
        Member {
            path: self.paths[i],
            kind: self.kinds[i],
            mode: self.mode(i),
            mtime_ns: self.mtime(i),
            size: self.size(i),
            link: self.links[i],
            nanoseconds: self.nanoseconds,
        }
    }
}

/// Read element `i` of a native-endian `array("Q")`'s bytes.
pub fn u64_at(raw: &[u8], i: usize) -> u64 {
    u64::from_ne_bytes(element(raw, i))
}
