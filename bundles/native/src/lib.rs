//! `bundles._native`: the per-file loops of pack and unpack in compiled code, called with the GIL released.
//!
//! Every function takes the index's columns as Python hands them over (NUL-joined names, `array` bytes),
//! owns its state for the call alone, and reports failures as `NativeFailure(kind, entry, errno)` for the
//! Python wrapper in `bundles/native.py` to turn into pallet's own errors.

mod columns;
mod copy;
mod fsio;
mod header;
mod pack;
mod safety;
mod scan;
mod unpack;

use columns::{split_blob, Columns};
use pyo3::create_exception;
use pyo3::exceptions::{PyException, PyValueError};
use pyo3::prelude::*;
use pyo3::types::PyBytes;

create_exception!(
    _native,
    NativeFailure,
    PyException,
    "(kind, entry, errno): a failure the wrapper explains"
);

/// The version of this engine's interface, checked by the Python wrapper before use.
const INTERFACE: u32 = 1;

#[allow(clippy::too_many_arguments)]
fn columns<'a>(
    count: usize,
    paths: &'a [u8],
    links: &'a [u8],
    kinds: &'a [u8],
    modes: &'a [u8],
    mtimes: &'a [u8],
    sizes: &'a [u8],
) -> PyResult<Columns<'a>> {
    let bad = || PyValueError::new_err("entry columns of different lengths");
    let entries = Columns {
        paths: split_blob(paths, count).ok_or_else(bad)?,
        links: split_blob(links, count).ok_or_else(bad)?,
        kinds,
        modes,
        mtimes,
        sizes,
    };
    if entries.consistent() {
        Ok(entries)
    } else {
        Err(bad())
    }
}

/// member_header(path, kind, mode, mtime_ns, size, link) -> bytes: the same bytes as tarformat.member_header.
#[pyfunction]
fn member_header<'py>(
    py: Python<'py>,
    path: &[u8],
    kind: u8,
    mode: u32,
    mtime_ns: i64,
    size: u64,
    link: &[u8],
) -> Bound<'py, PyBytes> {
    let mut out = Vec::with_capacity(1536);
    header::member_header(
        &mut out,
        &header::Member {
            path,
            kind,
            mode,
            mtime_ns,
            size,
            link,
        },
    );
    PyBytes::new(py, &out)
}

type Built<'py> = (
    Bound<'py, PyBytes>,
    u64,
    Bound<'py, PyBytes>,
    Bound<'py, PyBytes>,
    Bound<'py, PyBytes>,
    Bound<'py, PyBytes>,
);

/// build_shard(root, count, paths, links, kinds, modes, mtimes, sizes, last, md5)
/// -> (raw, file_bytes, hashes, offsets, data_offsets, md5s): one shard's uncompressed tar bytes.
#[pyfunction]
#[allow(clippy::too_many_arguments)]
fn build_shard<'py>(
    py: Python<'py>,
    root: &[u8],
    count: usize,
    paths: &[u8],
    links: &[u8],
    kinds: &[u8],
    modes: &[u8],
    mtimes: &[u8],
    sizes: &[u8],
    last: bool,
    md5: bool,
) -> PyResult<Built<'py>> {
    let entries = columns(count, paths, links, kinds, modes, mtimes, sizes)?;
    let built = py.allow_threads(|| pack::build_shard(root, &entries, last, md5));
    let shard = built.map_err(|failure| match failure {
        pack::ReadFailure::Unreadable(i) => NativeFailure::new_err(("unreadable", i, 0)),
        pack::ReadFailure::Changing(i) => NativeFailure::new_err(("changing", i, 0)),
        pack::ReadFailure::TooLarge(i) => NativeFailure::new_err(("too large", i, 0)),
    })?;
    let words = |values: &[u64]| {
        values
            .iter()
            .flat_map(|v| v.to_ne_bytes())
            .collect::<Vec<u8>>()
    };
    Ok((
        PyBytes::new(py, &shard.raw),
        shard.file_bytes,
        PyBytes::new(py, &shard.hashes),
        PyBytes::new(py, &words(&shard.offsets)),
        PyBytes::new(py, &words(&shard.data_offsets)),
        PyBytes::new(py, &shard.md5s),
    ))
}

/// check_members(data, count, paths, links, kinds, modes, mtimes, sizes, offsets, data_offsets) -> int | None:
/// None when the tar bytes hold exactly these members, else the first entry that differs (`count`: the bytes
/// after the last entry).
#[pyfunction]
#[allow(clippy::too_many_arguments)]
fn check_members(
    py: Python<'_>,
    data: &[u8],
    count: usize,
    paths: &[u8],
    links: &[u8],
    kinds: &[u8],
    modes: &[u8],
    mtimes: &[u8],
    sizes: &[u8],
    offsets: &[u8],
    data_offsets: &[u8],
) -> PyResult<Option<usize>> {
    let entries = columns(count, paths, links, kinds, modes, mtimes, sizes)?;
    if offsets.len() != 8 * count || data_offsets.len() != 8 * count {
        return Err(PyValueError::new_err("offset columns of the wrong length"));
    }
    let layout = unpack::Layout {
        offsets,
        data_offsets,
    };
    Ok(py.allow_threads(|| unpack::check_members(data, &entries, &layout)))
}

/// extract_files(data, root, count, paths, kinds, modes, mtimes, sizes, data_offsets, hashes, verify, umask)
/// -> (files, bytes, bad entries): write a shard's regular files; see unpack::extract_files.
#[pyfunction]
#[pyo3(signature = (data, root, count, paths, kinds, modes, mtimes, sizes, data_offsets, hashes, verify, umask))]
#[allow(clippy::too_many_arguments)]
fn extract_files(
    py: Python<'_>,
    data: &[u8],
    root: &[u8],
    count: usize,
    paths: &[u8],
    kinds: &[u8],
    modes: &[u8],
    mtimes: &[u8],
    sizes: &[u8],
    data_offsets: &[u8],
    hashes: &[u8],
    verify: bool,
    umask: Option<u32>,
) -> PyResult<(u64, u64, Vec<usize>)> {
    let no_links = vec![0u8; count.saturating_sub(1)];
    let entries = columns(count, paths, &no_links, kinds, modes, mtimes, sizes)?;
    if data_offsets.len() != 8 * count || hashes.len() != 16 * count {
        return Err(PyValueError::new_err(
            "offset or hash columns of the wrong length",
        ));
    }
    let layout = unpack::Layout {
        offsets: data_offsets,
        data_offsets,
    };
    let done = py.allow_threads(|| {
        unpack::extract_files(data, root, &entries, &layout, hashes, verify, umask)
    });
    match done {
        Ok(done) => Ok((done.files, done.bytes, done.bad)),
        Err(unpack::ExtractFailure::IsDirectory(i)) => {
            Err(NativeFailure::new_err(("directory", i, 0)))
        }
        Err(unpack::ExtractFailure::Write(i, err)) => Err(NativeFailure::new_err((
            "write",
            i,
            err.raw_os_error().unwrap_or(libc::EIO),
        ))),
    }
}

/// trivially_safe(count, paths, kinds) -> bool: True only when the extraction rules cannot refuse any entry
/// (plain names, files and directories only); False means "ask the Python rules", not "unsafe".
#[pyfunction]
fn trivially_safe(py: Python<'_>, count: usize, paths: &[u8], kinds: &[u8]) -> PyResult<bool> {
    let names = split_blob(paths, count).filter(|_| kinds.len() == count);
    let names = names.ok_or_else(|| PyValueError::new_err("entry columns of different lengths"))?;
    Ok(py.allow_threads(|| safety::trivially_safe(&names, kinds)))
}

type ScanColumns<'py> = (
    Bound<'py, PyBytes>,
    Bound<'py, PyBytes>,
    Bound<'py, PyBytes>,
    Bound<'py, PyBytes>,
    Bound<'py, PyBytes>,
    Bound<'py, PyBytes>,
    Bound<'py, PyBytes>,
);

/// scan_tree(root, threads) -> (names, kinds, modes, mtimes, sizes, multi_linked, attention): the walk and lstat
/// of a directory tree, see scan.rs; a directory that cannot be listed is NativeFailure("list", path, errno).
#[pyfunction]
fn scan_tree<'py>(py: Python<'py>, root: &[u8], threads: usize) -> PyResult<ScanColumns<'py>> {
    let scanned =
        py.allow_threads(|| scan::walk(root).map(|names| scan::stat_all(root, names, threads)));
    let tree = scanned.map_err(|failure| {
        let errno = failure.error.raw_os_error().unwrap_or(libc::EIO);
        NativeFailure::new_err(("list", PyBytes::new(py, &failure.path).unbind(), errno))
    })?;
    let bytes = |raw: Vec<u8>| PyBytes::new(py, &raw);
    Ok((
        bytes(tree.names.join(&0u8)),
        bytes(tree.kinds),
        bytes(tree.modes.iter().flat_map(|v| v.to_ne_bytes()).collect()),
        bytes(tree.mtimes.iter().flat_map(|v| v.to_ne_bytes()).collect()),
        bytes(tree.sizes.iter().flat_map(|v| v.to_ne_bytes()).collect()),
        bytes(
            tree.multi_linked
                .iter()
                .flatten()
                .flat_map(|v| v.to_ne_bytes())
                .collect(),
        ),
        bytes(
            tree.attention
                .iter()
                .flat_map(|v| v.to_ne_bytes())
                .collect(),
        ),
    ))
}

/// kinds_of(root, count, items, threads) -> bytes: per item 0 regular file, 1 directory, 2 anything else (or
/// an lstat that failed), 3 regular file with more than one link; `root` ends with a slash.
#[pyfunction]
fn kinds_of<'py>(
    py: Python<'py>,
    root: &[u8],
    count: usize,
    items: &[u8],
    threads: usize,
) -> PyResult<Bound<'py, PyBytes>> {
    let names =
        split_blob(items, count).ok_or_else(|| PyValueError::new_err("wrong item count"))?;
    let kinds = py.allow_threads(|| copy::kinds_of(root, &names, threads));
    Ok(PyBytes::new(py, &kinds))
}

/// Bytes copied, and (entry, errno, the error concerns the target) per failed file.
type CopyOutcome = (u64, Vec<(usize, i32, bool)>);

/// copy_files(src_root, dst_root, count, items, threads) -> (bytes copied, [(entry, errno, on_target)]):
/// copy regular files between local trees; both roots end with a slash, the targets' parents exist.
#[pyfunction]
fn copy_files(
    py: Python<'_>,
    src_root: &[u8],
    dst_root: &[u8],
    count: usize,
    items: &[u8],
    threads: usize,
) -> PyResult<CopyOutcome> {
    let names =
        split_blob(items, count).ok_or_else(|| PyValueError::new_err("wrong item count"))?;
    let (bytes, failures) =
        py.allow_threads(|| copy::copy_files(src_root, dst_root, &names, threads));
    let failures = failures
        .into_iter()
        .map(|f| {
            (
                f.entry,
                f.error.raw_os_error().unwrap_or(libc::EIO),
                f.on_target,
            )
        })
        .collect();
    Ok((bytes, failures))
}

#[pymodule]
fn _native(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add("INTERFACE", INTERFACE)?;
    m.add("NativeFailure", m.py().get_type::<NativeFailure>())?;
    m.add_function(wrap_pyfunction!(member_header, m)?)?;
    m.add_function(wrap_pyfunction!(build_shard, m)?)?;
    m.add_function(wrap_pyfunction!(check_members, m)?)?;
    m.add_function(wrap_pyfunction!(trivially_safe, m)?)?;
    m.add_function(wrap_pyfunction!(scan_tree, m)?)?;
    m.add_function(wrap_pyfunction!(kinds_of, m)?)?;
    m.add_function(wrap_pyfunction!(copy_files, m)?)?;
    m.add_function(wrap_pyfunction!(extract_files, m)?)?;
    Ok(())
}
