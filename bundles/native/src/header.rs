//! Byte-exact pax/ustar member headers, the same bytes as `bundles/tarformat.py`'s `member_header`.

const BLOCK: usize = 512;
const MAX_OCTAL_11: i64 = 8i64.pow(11) - 1;
const PAX_NAME: &[u8] = b"././@PaxHeader";

/// Entry kinds as stored in the index.
pub const FILE: u8 = 0;
pub const DIR: u8 = 1;
pub const SYMLINK: u8 = 2;
pub const HARDLINK: u8 = 3;

/// Bytes of zero padding after `size` bytes of member data.
pub fn padding(size: u64) -> usize {
    ((BLOCK as u64 - size % BLOCK as u64) % BLOCK as u64) as usize
}

fn typeflag(kind: u8) -> u8 {
    match kind {
        DIR => b'5',
        SYMLINK => b'2',
        HARDLINK => b'1',
        _ => b'0',
    }
}

fn octal(out: &mut [u8], value: u64) {
    // `out` is the field without its terminating NUL: zero-padded octal digits.
    let mut v = value;
    for slot in out.iter_mut().rev() {
        *slot = b'0' + (v & 7) as u8;
        v >>= 3;
    }
}

struct Ustar<'a> {
    name: &'a [u8],
    prefix: &'a [u8],
    mode: u32,
    size: u64,
    mtime: i64,
    typeflag: u8,
    link: &'a [u8],
}

fn ustar_block(out: &mut Vec<u8>, fields: &Ustar) {
    let start = out.len();
    out.resize(start + BLOCK, 0);
    let block = &mut out[start..];
    block[..fields.name.len()].copy_from_slice(fields.name);
    octal(&mut block[100..107], u64::from(fields.mode));
    octal(&mut block[108..115], 0);
    octal(&mut block[116..123], 0);
    octal(&mut block[124..135], fields.size);
    octal(&mut block[136..147], fields.mtime as u64);
    block[148..156].copy_from_slice(b"        ");
    block[156] = fields.typeflag;
    block[157..157 + fields.link.len()].copy_from_slice(fields.link);
    block[257..265].copy_from_slice(b"ustar\x0000");
    octal(&mut block[329..336], 0);
    octal(&mut block[337..344], 0);
    block[345..345 + fields.prefix.len()].copy_from_slice(fields.prefix);
    let checksum: u64 = block.iter().map(|&b| u64::from(b)).sum();
    octal(&mut block[148..154], checksum);
    block[154] = 0;
    block[155] = b' ';
}

fn digits(value: usize) -> usize {
    value.to_string().len()
}

fn pax_record(out: &mut Vec<u8>, key: &[u8], value: &[u8]) {
    let body = 1 + key.len() + 1 + value.len() + 1;
    let mut length = body + 1;
    while digits(length) + body != length {
        length += 1;
    }
    out.extend_from_slice(length.to_string().as_bytes());
    out.push(b' ');
    out.extend_from_slice(key);
    out.push(b'=');
    out.extend_from_slice(value);
    out.push(b'\n');
}

fn mtime_record(out: &mut Vec<u8>, mtime_ns: i64, seconds: i64, nanos: i64) {
    if (0..1_000_000_000_000).contains(&seconds) {
        let body = format!(" mtime={seconds}.{nanos:09}\n");
        out.extend_from_slice((body.len() + 2).to_string().as_bytes());
        out.extend_from_slice(body.as_bytes());
        return;
    }
    let sign = if mtime_ns < 0 { "-" } else { "" };
    let magnitude = mtime_ns.unsigned_abs();
    let value = format!(
        "{sign}{}.{:09}",
        magnitude / 1_000_000_000,
        magnitude % 1_000_000_000
    );
    pax_record(out, b"mtime", value.as_bytes());
}

fn is_utf8(raw: &[u8]) -> bool {
    std::str::from_utf8(raw).is_ok()
}

fn split_ustar_name(name: &[u8]) -> Option<(&[u8], &[u8])> {
    if name.len() <= 100 {
        return Some((b"", name));
    }
    if name.len() > 256 {
        return None;
    }
    let from = name.len().saturating_sub(101);
    let mut cut = name[from..]
        .iter()
        .position(|&b| b == b'/')
        .map(|p| p + from);
    while let Some(at) = cut {
        if at > 155 {
            break;
        }
        if name.len() - at - 1 <= 100 && at > 0 {
            return Some((&name[..at], &name[at + 1..]));
        }
        cut = name[at + 1..]
            .iter()
            .position(|&b| b == b'/')
            .map(|p| p + at + 1);
    }
    None
}

fn pax_member(out: &mut Vec<u8>, payload: &[u8]) {
    ustar_block(
        out,
        &Ustar {
            name: PAX_NAME,
            prefix: b"",
            mode: 0o644,
            size: payload.len() as u64,
            mtime: 0,
            typeflag: b'x',
            link: b"",
        },
    );
    out.extend_from_slice(payload);
    out.resize(out.len() + padding(payload.len() as u64), 0);
}

/// One entry's metadata, as the index holds it.
pub struct Member<'a> {
    pub path: &'a [u8],
    pub kind: u8,
    pub mode: u32,
    pub mtime_ns: i64,
    pub size: u64,
    pub link: &'a [u8],
    /// Format version 1: a pax `mtime` record carries the nanoseconds of every mtime that has any. From
    /// version 2 on, an mtime that ustar can hold is written as its whole seconds (the index keeps the rest).
    pub nanoseconds: bool,
}

/// Append the header (pax extended header if needed, then ustar) of `member` to `out`.
pub fn member_header(out: &mut Vec<u8>, member: &Member) {
    let plain_file = member.kind == FILE
        && member.path.len() <= 100
        && member.size <= MAX_OCTAL_11 as u64
        && (0..(MAX_OCTAL_11 + 1).saturating_mul(1_000_000_000)).contains(&member.mtime_ns);
    if plain_file && !member.link.is_empty() {
        // As tarformat.py's fast path for plain files: a file's link column is not written.
        return member_header(
            out,
            &Member {
                link: b"",
                ..*member
            },
        );
    }
    let dir_name: Vec<u8>;
    let full: &[u8] = if member.kind == DIR {
        dir_name = [member.path, b"/"].concat();
        &dir_name
    } else {
        member.path
    };
    let data_size = if member.kind == FILE { member.size } else { 0 };
    let mut records = Vec::new();
    let fallback: Vec<u8>;
    let (prefix, name): (&[u8], &[u8]) = match split_ustar_name(full) {
        Some(split) => split,
        None => {
            pax_record(&mut records, b"path", full);
            fallback = if is_utf8(full) {
                let tail = &full[full.len() - 100..];
                tail[tail.iter().take_while(|&&b| b == b'/').count()..].to_vec()
            } else {
                b"@PaxPath".to_vec()
            };
            (b"", &fallback)
        }
    };
    if member.link.len() > 100 {
        pax_record(&mut records, b"linkpath", member.link);
    }
    let mut seconds = member.mtime_ns.div_euclid(1_000_000_000);
    let nanos = member.mtime_ns.rem_euclid(1_000_000_000);
    let in_range = (0..=MAX_OCTAL_11).contains(&seconds);
    if !in_range || nanos != 0 && member.nanoseconds {
        mtime_record(&mut records, member.mtime_ns, seconds, nanos);
        seconds = seconds.clamp(0, MAX_OCTAL_11);
    }
    let big = data_size > MAX_OCTAL_11 as u64;
    if big {
        pax_record(&mut records, b"size", data_size.to_string().as_bytes());
    }
    let link = &member.link[..member.link.len().min(100)];
    if !records.is_empty() {
        let ascii = member.path.is_ascii() && member.link.is_ascii();
        if !(ascii || is_utf8(member.path) && is_utf8(member.link)) {
            let mut payload = Vec::new();
            pax_record(&mut payload, b"hdrcharset", b"BINARY");
            payload.extend_from_slice(&records);
            records = payload;
        }
        pax_member(out, &records);
    }
    ustar_block(
        out,
        &Ustar {
            name,
            prefix,
            mode: member.mode & 0o7777,
            size: if big { 0 } else { data_size },
            mtime: seconds,
            typeflag: typeflag(member.kind),
            link,
        },
    );
}
