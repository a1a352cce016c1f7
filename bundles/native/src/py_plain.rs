//! Bindings of the plain-archive fast path: one `PlainExtraction` object per extraction.

use crate::plain_run::{self, Stop};
use pyo3::prelude::*;
use pyo3::types::PyBytes;

/// What `PlainExtraction.run` returns: (consumed, needed, entries, files, bytes, [(directory, mode, mtime)]).
type RunResult<'py> = (
    usize,
    u64,
    u64,
    u64,
    u64,
    Vec<(Bound<'py, PyBytes>, u32, i64)>,
);

/// PlainExtraction(root, umask): the native writer of simple members of one plain archive into `root`
/// (ending with a slash); see plain_run.rs for which members it writes and where it stops.
#[pyclass(module = "bundles._native")]
pub struct PlainExtraction {
    inner: plain_run::PlainExtraction,
}

#[pymethods]
impl PlainExtraction {
    #[new]
    #[pyo3(signature = (root, umask))]
    fn new(root: &[u8], umask: Option<u32>) -> Self {
        PlainExtraction {
            inner: plain_run::PlainExtraction::new(root, umask),
        }
    }

    /// run(window, start) -> (consumed, needed, entries, files, bytes, directories): write the simple members
    /// from `window[start:]`; `needed` is 0 when the member at the stop is for Python, else the bytes (from
    /// its header) it needs in the window.
    fn run<'py>(&mut self, py: Python<'py>, window: &[u8], start: usize) -> RunResult<'py> {
        let rest = window.get(start..).unwrap_or_default();
        let inner = &mut self.inner;
        let done = py.allow_threads(|| inner.run(rest));
        let needed = match done.stop {
            Stop::Python => 0,
            Stop::Needs(bytes) => bytes,
        };
        let directories = done
            .directories
            .iter()
            .map(|(name, mode, mtime)| (PyBytes::new(py, name), *mode, *mtime))
            .collect();
        (
            done.consumed,
            needed,
            done.entries,
            done.files,
            done.bytes,
            directories,
        )
    }

    /// A symlink member named `name` was read: no later member is written under it.
    fn add_symlink(&mut self, name: &[u8]) {
        self.inner.symlinks.insert(name.to_vec());
    }

    /// A link member named `name` waits to be made: a later member of that name is left to Python.
    fn add_link(&mut self, name: &[u8]) {
        self.inner.links.insert(name.to_vec());
    }

    /// A member that is not a link took the name `name`: it is no longer a symlink or a link to make.
    fn drop_link(&mut self, name: &[u8]) {
        self.inner.symlinks.remove(name);
        self.inner.links.remove(name);
    }

    /// A regular file named `name` was written by the Python reader.
    fn add_file(&mut self, name: &[u8]) {
        self.inner.files.insert(name.to_vec());
    }

    /// True when a regular file named `name` was written (a hard link may name it).
    fn has_file(&self, name: &[u8]) -> bool {
        self.inner.files.contains(name)
    }
}
