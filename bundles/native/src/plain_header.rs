//! Read one tar header block the way Python's `tarfile` does, for the members the fast path may write.
//!
//! `simple_member` accepts only what `tarfile.TarInfo.frombuf` reads to the same values without help: a
//! valid checksum, plain octal numbers, an empty prefix field, and a regular file or directory type. Anything
//! else (pax and GNU extension headers, links, devices, base-256 numbers, a name in the prefix field) gives
//! `None`, and the Python reader in `bundles/plain_reader.py` decides and explains.

pub const BLOCK: usize = 512;

/// What a simple member is.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub enum SimpleKind {
    File,
    Directory,
}

/// A header the fast path may act on: its name as stored, kind, and numbers.
#[derive(Debug)]
pub struct SimpleMember<'a> {
    pub name: &'a [u8],
    pub kind: SimpleKind,
    pub size: u64,
    pub mode: u32,
    pub mtime: u64,
}

/// True when every byte of the block is zero (the end-of-archive marker, handled by the Python reader).
pub fn is_zero_block(block: &[u8]) -> bool {
    block.iter().all(|&b| b == 0)
}

/// The header in `block` (512 bytes) when it is a simple member, else None.
pub fn simple_member(block: &[u8]) -> Option<SimpleMember<'_>> {
    if block.len() != BLOCK || !checksum_matches(block) || block[345] != 0 {
        return None;
    }
    // tarfile reads uid, gid and the device numbers even for files: a field it cannot read is its error
    for range in [108..116, 116..124, 329..337, 337..345] {
        if !(base256(&block[range.clone()]) || octal(&block[range]).is_some()) {
            return None;
        }
    }
    let name = until_nul(&block[..100]);
    let kind = match block[156] {
        b'5' => SimpleKind::Directory,
        0 if name.ends_with(b"/") => SimpleKind::Directory,
        b'0' | 0 => SimpleKind::File,
        _ => return None,
    };
    Some(SimpleMember {
        name,
        kind,
        size: octal(&block[124..136])?,
        mode: u32::try_from(octal(&block[100..108])?).ok()?,
        mtime: octal(&block[136..148])?,
    })
}

/// The stored checksum equals the unsigned sum of the block with its checksum field read as spaces.
fn checksum_matches(block: &[u8]) -> bool {
    let sum: u64 = 256
        + block[..148].iter().map(|&b| b as u64).sum::<u64>()
        + block[156..].iter().map(|&b| b as u64).sum::<u64>();
    octal(&block[148..156]) == Some(sum)
}

/// A numeric field in base-256 form (first byte 0o200 or 0o377), which tarfile always reads.
fn base256(field: &[u8]) -> bool {
    matches!(field[0], 0o200 | 0o377)
}

/// The field's bytes before its first NUL.
fn until_nul(field: &[u8]) -> &[u8] {
    field.split(|&b| b == 0).next().unwrap_or(field)
}

/// An octal number as tarfile's `nti` reads it: text before the first NUL, spaces around it, empty as 0;
/// None for any other text (tarfile may read some of it differently, so the Python reader takes it).
fn octal(field: &[u8]) -> Option<u64> {
    let text = until_nul(field);
    let start = text.iter().position(|&b| b != b' ').unwrap_or(text.len());
    let end = text
        .iter()
        .rposition(|&b| b != b' ')
        .map_or(start, |i| i + 1);
    let digits = &text[start..end];
    if digits.len() > 21 || !digits.iter().all(|b| (b'0'..=b'7').contains(b)) {
        return None;
    }
    Some(digits.iter().fold(0, |n, &d| n * 8 + u64::from(d - b'0')))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn header(name: &[u8], typeflag: u8, size: &[u8]) -> Vec<u8> {
        let mut block = vec![0u8; BLOCK];
        block[..name.len()].copy_from_slice(name);
        block[100..107].copy_from_slice(b"0000644");
        block[124..124 + size.len()].copy_from_slice(size);
        block[136..147].copy_from_slice(b"14000000000");
        block[156] = typeflag;
        block[257..263].copy_from_slice(b"ustar\0");
        block[148..156].copy_from_slice(b"        ");
        let sum: u64 = block.iter().map(|&b| b as u64).sum();
        block[148..155].copy_from_slice(format!("{sum:06o}\0").as_bytes());
        block
    }

    #[test]
    fn reads_a_regular_file() {
        let block = header(b"a/b", b'0', b"00000001750");
        let member = simple_member(&block).expect("simple");
        assert_eq!(
            (member.name, member.kind, member.size, member.mode),
            (&b"a/b"[..], SimpleKind::File, 1000, 0o644)
        );
        assert_eq!(member.mtime, 0o14000000000);
    }

    #[test]
    fn old_regular_type_with_a_slash_is_a_directory() {
        let block = header(b"d/", 0, b"0");
        assert_eq!(simple_member(&block).unwrap().kind, SimpleKind::Directory);
    }

    #[test]
    fn leaves_links_bad_checksums_and_odd_numbers_to_python() {
        assert!(simple_member(&header(b"l", b'2', b"0")).is_none());
        let mut block = header(b"f", b'0', b"12");
        block[0] = b'g';
        assert!(simple_member(&block).is_none());
        assert!(simple_member(&header(b"f", b'0', b"0x12")).is_none());
        assert!(simple_member(&header(b"f", b'0', b"\x80\0\0")).is_none());
    }
}
