//! Bindings of the local transport's parallel copy.

use crate::{copy, names};
use pyo3::prelude::*;
use pyo3::types::PyBytes;

/// kinds_of(root, count, items, threads) -> bytes: per item 0 regular file, 1 directory, 2 anything else (or
/// an lstat that failed), 3 regular file with more than one link; `root` ends with a slash.
#[pyfunction]
pub fn kinds_of<'py>(
    py: Python<'py>,
    root: &[u8],
    count: usize,
    items: &[u8],
    threads: usize,
) -> PyResult<Bound<'py, PyBytes>> {
    let items = names(items, count)?;
    let kinds = py.allow_threads(|| copy::kinds_of(root, &items, threads));
    Ok(PyBytes::new(py, &kinds))
}

/// Bytes copied, and (entry, errno, the error concerns the target) per failed file.
type CopyOutcome = (u64, Vec<(usize, i32, bool)>);

/// copy_files(src_root, dst_root, count, items, threads) -> (bytes copied, [(entry, errno, on_target)]):
/// copy regular files between local trees; both roots end with a slash, the targets' parents exist.
#[pyfunction]
pub fn copy_files(
    py: Python<'_>,
    src_root: &[u8],
    dst_root: &[u8],
    count: usize,
    items: &[u8],
    threads: usize,
) -> PyResult<CopyOutcome> {
    let items = names(items, count)?;
    let (bytes, failures) =
        py.allow_threads(|| copy::copy_files(src_root, dst_root, &items, threads));
    let errno = |f: &copy::CopyFailure| f.error.raw_os_error().unwrap_or(libc::EIO);
    Ok((
        bytes,
        failures
            .iter()
            .map(|f| (f.entry, errno(f), f.on_target))
            .collect(),
    ))
}
