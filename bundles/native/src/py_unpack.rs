//! Bindings of the unpack side: checking a shard's members and contents, writing its files, the safety
//! pre-check.

use crate::columns::Columns;
use crate::{names, safety, unpack, EntryArgs, NativeFailure};
use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;

/// The columns of `entries` and where each entry sits in the shard; ValueError unless the offset columns (and
/// `hashes`, when given) hold one value per entry.
fn laid_out<'a>(
    entries: &'a EntryArgs<'_>,
    offsets: &'a [u8],
    data_offsets: &'a [u8],
    hashes: Option<&[u8]>,
) -> PyResult<(Columns<'a>, unpack::Layout<'a>)> {
    let count = entries.count();
    let wrong_hashes = hashes.is_some_and(|hashes| hashes.len() != 16 * count);
    if offsets.len() != 8 * count || data_offsets.len() != 8 * count || wrong_hashes {
        return Err(PyValueError::new_err(
            "offset or hash columns of the wrong length",
        ));
    }
    Ok((
        entries.columns()?,
        unpack::Layout {
            offsets,
            data_offsets,
        },
    ))
}

/// check_members(data, entries, offsets, data_offsets) -> int | None: None when the tar bytes hold exactly
/// these members, else the first entry that differs (the entry count: the bytes after the last entry).
#[pyfunction]
pub fn check_members(
    py: Python<'_>,
    data: &[u8],
    entries: EntryArgs<'_>,
    offsets: &[u8],
    data_offsets: &[u8],
) -> PyResult<Option<usize>> {
    let (entries, layout) = laid_out(&entries, offsets, data_offsets, None)?;
    Ok(py.allow_threads(|| unpack::check_members(data, &entries, &layout)))
}

/// extract_files(data, root, entries, data_offsets, hashes, verify, umask) -> (files, bytes, bad entries):
/// write a shard's regular files under `root` (ending with a slash); see unpack::extract_files.
#[pyfunction]
#[pyo3(signature = (data, root, entries, data_offsets, hashes, verify, umask))]
#[allow(clippy::too_many_arguments)]
pub fn extract_files(
    py: Python<'_>,
    data: &[u8],
    root: &[u8],
    entries: EntryArgs<'_>,
    data_offsets: &[u8],
    hashes: &[u8],
    verify: bool,
    umask: Option<u32>,
) -> PyResult<(u64, u64, Vec<usize>)> {
    let (entries, layout) = laid_out(&entries, data_offsets, data_offsets, Some(hashes))?;
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

/// content_mismatches(data, entries, data_offsets, hashes) -> [entry]: the regular files whose content in the
/// shard's tar bytes is missing or does not match its hash.
#[pyfunction]
pub fn content_mismatches(
    py: Python<'_>,
    data: &[u8],
    entries: EntryArgs<'_>,
    data_offsets: &[u8],
    hashes: &[u8],
) -> PyResult<Vec<usize>> {
    let (entries, layout) = laid_out(&entries, data_offsets, data_offsets, Some(hashes))?;
    Ok(py.allow_threads(|| unpack::content_mismatches(data, &entries, &layout, hashes)))
}

/// trivially_safe(count, paths, kinds) -> bool: True only when the extraction rules cannot refuse any entry
/// (plain names, files and directories only); False means "ask the Python rules", not "unsafe".
#[pyfunction]
pub fn trivially_safe(py: Python<'_>, count: usize, paths: &[u8], kinds: &[u8]) -> PyResult<bool> {
    let paths = names(paths, count)?;
    if kinds.len() != count {
        return Err(PyValueError::new_err("entry columns of different lengths"));
    }
    Ok(py.allow_threads(|| safety::trivially_safe(&paths, kinds)))
}
