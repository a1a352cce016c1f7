//! Bindings of the pack side: tar headers, building a shard, scanning a tree.

use crate::{header, names, pack, plan, scan, words, EntryArgs, NativeFailure};
use pyo3::prelude::*;
use pyo3::types::PyBytes;

/// member_header(path, kind, mode, mtime_ns, size, link, nanoseconds=False) -> bytes: the same bytes as
/// tarformat.member_header.
#[pyfunction]
#[pyo3(signature = (path, kind, mode, mtime_ns, size, link, nanoseconds=false))]
#[allow(clippy::too_many_arguments)]
pub fn member_header<'py>(
    py: Python<'py>,
    path: &[u8],
    kind: u8,
    mode: u32,
    mtime_ns: i64,
    size: u64,
    link: &[u8],
    nanoseconds: bool,
) -> Bound<'py, PyBytes> {
    let mut out = Vec::with_capacity(1536);
    let member = header::Member {
        path,
        kind,
        mode,
        mtime_ns,
        size,
        link,
        nanoseconds,
    };
    header::member_header(&mut out, &member);
    PyBytes::new(py, &out)
}

type Bytes<'py> = Bound<'py, PyBytes>;
type Built<'py> = (
    Bytes<'py>,
    u64,
    Bytes<'py>,
    Bytes<'py>,
    Bytes<'py>,
    Bytes<'py>,
);

/// build_shard(root, entries, last, md5) -> (raw, file_bytes, hashes, offsets, data_offsets, md5s): one
/// shard's uncompressed tar bytes; `root` ends with a slash.
#[pyfunction]
pub fn build_shard<'py>(
    py: Python<'py>,
    root: &[u8],
    entries: EntryArgs<'py>,
    last: bool,
    md5: bool,
) -> PyResult<Built<'py>> {
    let entries = entries.columns()?;
    let built = py.allow_threads(|| pack::build_shard(root, &entries, last, md5));
    let shard = built.map_err(|failure| match failure {
        pack::ReadFailure::Unreadable(i) => NativeFailure::new_err(("unreadable", i, 0)),
        pack::ReadFailure::Changing(i) => NativeFailure::new_err(("changing", i, 0)),
        pack::ReadFailure::TooLarge(i) => NativeFailure::new_err(("too large", i, 0)),
    })?;
    Ok((
        PyBytes::new(py, &shard.raw),
        shard.file_bytes,
        PyBytes::new(py, &shard.hashes),
        PyBytes::new(py, &words(&shard.offsets, u64::to_ne_bytes)),
        PyBytes::new(py, &words(&shard.data_offsets, u64::to_ne_bytes)),
        PyBytes::new(py, &shard.md5s),
    ))
}

type ScanColumns<'py> = (
    Bytes<'py>,
    Bytes<'py>,
    Bytes<'py>,
    Bytes<'py>,
    Bytes<'py>,
    Bytes<'py>,
    Bytes<'py>,
);

/// scan_tree(root, threads) -> (names, kinds, modes, mtimes, sizes, multi_linked, attention): the walk and
/// lstat of a directory tree, see scan.rs; a directory that cannot be listed is
/// NativeFailure("list", path, errno).
#[pyfunction]
pub fn scan_tree<'py>(py: Python<'py>, root: &[u8], threads: usize) -> PyResult<ScanColumns<'py>> {
    let scanned =
        py.allow_threads(|| scan::walk(root).map(|names| scan::stat_all(root, names, threads)));
    let tree = scanned.map_err(|failure| {
        let errno = failure.error.raw_os_error().unwrap_or(libc::EIO);
        NativeFailure::new_err(("list", PyBytes::new(py, &failure.path).unbind(), errno))
    })?;
    let linked: Vec<u64> = tree.multi_linked.iter().flatten().copied().collect();
    Ok((
        PyBytes::new(py, &tree.names.join(&0u8)),
        PyBytes::new(py, &tree.kinds),
        PyBytes::new(py, &words(&tree.modes, u32::to_ne_bytes)),
        PyBytes::new(py, &words(&tree.mtimes, i64::to_ne_bytes)),
        PyBytes::new(py, &words(&tree.sizes, u64::to_ne_bytes)),
        PyBytes::new(py, &words(&linked, u64::to_ne_bytes)),
        PyBytes::new(py, &words(&tree.attention, u64::to_ne_bytes)),
    ))
}

/// plan_cuts(paths, links, count, sizes, shard_size, held_raw_limit, cuts_per_target) -> (firsts, counts, bigs):
/// the shard cuts of `count` entries (names NUL-joined, sizes as `array("Q")` bytes), as bundles/shards.py's
/// `plan_shards` makes them; firsts and counts as u64 `array` bytes, bigs one byte per shard.
#[pyfunction]
#[allow(clippy::too_many_arguments)]
pub fn plan_cuts<'py>(
    py: Python<'py>,
    paths: &[u8],
    links: &[u8],
    count: usize,
    sizes: &[u8],
    shard_size: u64,
    held_raw_limit: u64,
    cuts_per_target: u64,
) -> PyResult<(Bytes<'py>, Bytes<'py>, Bytes<'py>)> {
    let (paths, links) = (names(paths, count)?, names(links, count)?);
    if sizes.len() != 8 * count {
        return Err(pyo3::exceptions::PyValueError::new_err(
            "wrong number of sizes",
        ));
    }
    let rules = plan::CutRules {
        shard_size,
        held_raw_limit,
        cuts_per_target,
    };
    let cuts = py.allow_threads(|| plan::plan_cuts(&paths, &links, sizes, &rules));
    let firsts: Vec<u64> = cuts.iter().map(|c| c.first as u64).collect();
    let counts: Vec<u64> = cuts.iter().map(|c| c.count as u64).collect();
    let bigs: Vec<u8> = cuts.iter().map(|c| u8::from(c.big)).collect();
    Ok((
        PyBytes::new(py, &words(&firsts, u64::to_ne_bytes)),
        PyBytes::new(py, &words(&counts, u64::to_ne_bytes)),
        PyBytes::new(py, &bigs),
    ))
}
