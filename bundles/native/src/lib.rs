//! `bundles._native`: the per-file loops of pack and unpack in compiled code, called with the GIL released.
//!
//! Every function takes the index's columns as Python hands them over (NUL-joined names, `array` bytes),
//! owns its state for the call alone (`PlainExtraction`, the plain-archive writer, owns one extraction's),
//! and reports failures as `NativeFailure(kind, entry, errno)` for the
//! Python wrapper in `bundles/native.py` to turn into pallet's own errors. The bindings live in `py_*.rs`,
//! the work in the other modules.

mod columns;
mod copy;
mod fsio;
mod header;
mod pack;
mod plain_header;
mod plain_run;
mod plan;
mod py_copy;
mod py_pack;
mod py_plain;
mod py_unpack;
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
const INTERFACE: u32 = 6;

/// The entry columns as Python passes them, one tuple: (count, paths, links, kinds, modes, mtimes, sizes,
/// format), names NUL-joined, numbers as `array` bytes and `format` the bundle format version their tar headers
/// follow (see `entry_columns` in bundles/native.py).
#[derive(FromPyObject)]
struct EntryArgs<'py>(
    usize,
    Bound<'py, PyBytes>,
    Bound<'py, PyBytes>,
    Bound<'py, PyBytes>,
    Bound<'py, PyBytes>,
    Bound<'py, PyBytes>,
    Bound<'py, PyBytes>,
    u32,
);

impl EntryArgs<'_> {
    fn count(&self) -> usize {
        self.0
    }

    /// The columns, borrowed; ValueError unless every one holds `count` entries.
    fn columns(&self) -> PyResult<Columns<'_>> {
        let bad = || PyValueError::new_err("entry columns of different lengths");
        let entries = Columns {
            paths: split_blob(self.1.as_bytes(), self.0).ok_or_else(bad)?,
            links: split_blob(self.2.as_bytes(), self.0).ok_or_else(bad)?,
            kinds: self.3.as_bytes(),
            modes: self.4.as_bytes(),
            mtimes: self.5.as_bytes(),
            sizes: self.6.as_bytes(),
            nanoseconds: self.7 < 2,
        };
        entries.consistent().then_some(entries).ok_or_else(bad)
    }
}

/// Names NUL-joined by Python, split into `count` parts; ValueError when the count differs.
fn names(blob: &[u8], count: usize) -> PyResult<Vec<&[u8]>> {
    split_blob(blob, count).ok_or_else(|| PyValueError::new_err("wrong number of names"))
}

/// Numbers as the bytes of a native-endian `array`.
fn words<T: Copy, const N: usize>(values: &[T], bytes: fn(T) -> [u8; N]) -> Vec<u8> {
    values.iter().flat_map(|&v| bytes(v)).collect()
}

#[pymodule]
fn _native(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add("INTERFACE", INTERFACE)?;
    m.add("NativeFailure", m.py().get_type::<NativeFailure>())?;
    m.add_function(wrap_pyfunction!(py_pack::member_header, m)?)?;
    m.add_function(wrap_pyfunction!(py_pack::build_shard, m)?)?;
    m.add_function(wrap_pyfunction!(py_pack::scan_tree, m)?)?;
    m.add_function(wrap_pyfunction!(py_pack::plan_cuts, m)?)?;
    m.add_function(wrap_pyfunction!(py_unpack::check_members, m)?)?;
    m.add_function(wrap_pyfunction!(py_unpack::extract_files, m)?)?;
    m.add_function(wrap_pyfunction!(py_unpack::content_mismatches, m)?)?;
    m.add_function(wrap_pyfunction!(py_unpack::trivially_safe, m)?)?;
    m.add_function(wrap_pyfunction!(py_copy::kinds_of, m)?)?;
    m.add_function(wrap_pyfunction!(py_copy::copy_files, m)?)?;
    m.add_class::<py_plain::PlainExtraction>()?;
    Ok(())
}
