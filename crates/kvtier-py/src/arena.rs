//! `kvtier.ArenaView`: a worker process's window on the manager's shared arena, and `Row`, one
//! held row grant whose bytes are exposed as zero-copy numpy arrays.
//!
//! Soundness: a `Row`'s arrays are built on one private `memoryview` over the granted row.
//! Every array derived from it (slices, reshapes, `memoryview(arr)`) keeps an export of that
//! memoryview, so releasing the grant first releases the memoryview, which Python refuses
//! (`BufferError`) while any array still uses it — the grant is then kept and `release` raises.
//! A `Row` garbage-collected while arrays still use it leaks its grant (and the mapping) instead
//! of freeing memory they point to.

use std::ffi::c_char;
use std::path::PathBuf;

use parking_lot::Mutex;
use pyo3::prelude::*;
use pyo3::types::PyBytes;
use tiering_core::arena::ArenaView;
use tiering_core::{RowRead, RowWrite};

use crate::errors::kvtier_err;

// Values of the stable ABI's `PyBUF_READ` / `PyBUF_WRITE` (not exported under abi3 by pyo3).
const PYBUF_READ: i32 = 0x100;
const PYBUF_WRITE: i32 = 0x200;

/// A shared arena opened by a worker process (the scheduler process owns it). Rows are granted
/// row by row, excluding the owner's and other views' grants.
#[pyclass(module = "kvtier", name = "ArenaView", frozen)]
pub(crate) struct PyArenaView {
    view: ArenaView,
    path: PathBuf,
}

#[pymethods]
impl PyArenaView {
    /// Attaches to the shared arena at `path` (the manager's `arena_path`); with `num_chunks`
    /// and `chunk_bytes`, refuses an arena of another geometry.
    #[new]
    #[pyo3(signature = (path, num_chunks = None, chunk_bytes = None))]
    fn new(
        py: Python<'_>,
        path: PathBuf,
        num_chunks: Option<usize>,
        chunk_bytes: Option<usize>,
    ) -> PyResult<Self> {
        let view = py
            .detach(|| match (num_chunks, chunk_bytes) {
                (Some(n), Some(b)) => ArenaView::open_expecting(&path, n, b),
                _ => ArenaView::open(&path),
            })
            .map_err(kvtier_err)?;
        Ok(Self { view, path })
    }

    /// Number of rows.
    #[getter]
    fn num_chunks(&self) -> usize {
        self.view.num_chunks()
    }

    /// Bytes of one chunk (the usable length of a row).
    #[getter]
    fn chunk_bytes(&self) -> usize {
        self.view.chunk_bytes()
    }

    /// The arena file.
    #[getter]
    fn path(&self) -> PathBuf {
        self.path.clone()
    }

    /// The fingerprint the completion channel expects from this arena's workers.
    #[getter]
    fn fingerprint(&self) -> u64 {
        tiering_core::channel::arena_fingerprint(&self.view)
    }

    /// Whether the owning (scheduler) process is still alive.
    fn owner_alive(&self) -> PyResult<bool> {
        self.view.owner_alive().map_err(kvtier_err)
    }

    /// Locks the arena's pages in RAM (`mlock`), as DMA from a device needs.
    fn lock_memory(&self, py: Python<'_>) -> PyResult<()> {
        py.detach(|| self.view.lock_memory()).map_err(kvtier_err)
    }

    /// Copies `data` into row `chunk_id` (takes and releases a write grant).
    fn write_row(&self, py: Python<'_>, chunk_id: u32, data: &[u8]) -> PyResult<()> {
        if data.len() > self.view.chunk_bytes() {
            return Err(kvtier_err(format!(
                "{} bytes do not fit a row of {} bytes",
                data.len(),
                self.view.chunk_bytes()
            )));
        }
        py.detach(|| {
            let mut row = self.view.write_row(chunk_id)?;
            row[..data.len()].copy_from_slice(data);
            Ok::<_, tiering_core::ArenaError>(())
        })
        .map_err(kvtier_err)
    }

    /// A copy of row `chunk_id` (takes and releases a read grant).
    fn read_row<'py>(&self, py: Python<'py>, chunk_id: u32) -> PyResult<Bound<'py, PyBytes>> {
        let data = py
            .detach(|| self.view.read_row(chunk_id).map(|r| r.to_vec()))
            .map_err(kvtier_err)?;
        Ok(PyBytes::new(py, &data))
    }

    /// Holds a grant on row `chunk_id` (exclusive with `write=True`, shared otherwise) until the
    /// returned `Row` is released; `row.array()` is a zero-copy numpy view of its bytes.
    #[pyo3(signature = (chunk_id, write = false))]
    fn row(&self, chunk_id: u32, write: bool) -> PyResult<PyRow> {
        let grant = if write {
            Grant::Write(self.view.write_row(chunk_id).map_err(kvtier_err)?)
        } else {
            Grant::Read(self.view.read_row(chunk_id).map_err(kvtier_err)?)
        };
        Ok(PyRow {
            chunk_id,
            state: Mutex::new(RowState {
                grant: Some(grant),
                memoryview: None,
            }),
        })
    }

    fn __repr__(&self) -> String {
        format!(
            "ArenaView({:?}, {} chunks of {} bytes)",
            self.path,
            self.view.num_chunks(),
            self.view.chunk_bytes()
        )
    }
}

enum Grant {
    Read(RowRead),
    Write(RowWrite),
}

struct RowState {
    grant: Option<Grant>,
    /// The one memoryview every array of this row derives from.
    memoryview: Option<Py<PyAny>>,
}

/// A held grant on one arena row. Use as a context manager; `array()` gives a zero-copy numpy
/// `uint8` array of the row (writable for a write grant), valid until the row is released.
#[pyclass(module = "kvtier", name = "Row")]
pub(crate) struct PyRow {
    chunk_id: u32,
    state: Mutex<RowState>,
}

impl PyRow {
    /// Releases the memoryview (refused while arrays use it), then the grant.
    fn release_inner(&self, py: Python<'_>) -> PyResult<()> {
        let mut state = self.state.lock();
        if let Some(mv) = state.memoryview.as_ref() {
            mv.bind(py).call_method0("release").map_err(|e| {
                kvtier_err(format!(
                    "row {} is still used by an array ({e}); delete the arrays before releasing it",
                    self.chunk_id
                ))
            })?;
            state.memoryview = None;
        }
        state.grant = None;
        Ok(())
    }
}

impl Drop for PyRow {
    fn drop(&mut self) {
        let state = self.state.get_mut();
        let Some(mv) = state.memoryview.take() else {
            return;
        };
        let released = Python::attach(|py| mv.bind(py).call_method0("release").is_ok());
        if !released && let Some(grant) = state.grant.take() {
            tracing::error!(
                chunk = self.chunk_id,
                "a Row was dropped while arrays still use it; its grant is leaked to keep them valid"
            );
            std::mem::forget(grant);
        }
    }
}

#[pymethods]
impl PyRow {
    /// The row's chunk id.
    #[getter]
    fn chunk_id(&self) -> u32 {
        self.chunk_id
    }

    /// Whether the grant is exclusive (writable).
    #[getter]
    fn writable(&self) -> bool {
        matches!(self.state.lock().grant, Some(Grant::Write(_)))
    }

    /// A zero-copy numpy `uint8` array over the row (read-only for a read grant).
    fn array<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyAny>> {
        let mut state = self.state.lock();
        let (ptr, len, flags) = match state.grant.as_mut() {
            None => return Err(kvtier_err(format!("row {} was released", self.chunk_id))),
            Some(Grant::Read(r)) => (r.as_ptr().cast_mut(), r.len(), PYBUF_READ),
            Some(Grant::Write(w)) => (w.as_mut_ptr(), w.len(), PYBUF_WRITE),
        };
        if state.memoryview.is_none() {
            let len = isize::try_from(len).map_err(kvtier_err)?;
            // SAFETY: `ptr..ptr+len` is the granted row inside the arena mapping, which the grant
            // (held in `state` until `release_inner` succeeds, or leaked by `Drop`) keeps mapped
            // and locked; writes are allowed only through a write grant (PYBUF_WRITE), which
            // excludes every other grant of the row. The memoryview is released before the
            // grant, and Python refuses that while any array still exports it.
            let raw = unsafe { pyo3::ffi::PyMemoryView_FromMemory(ptr.cast::<c_char>(), len, flags) };
            // SAFETY: a new reference or NULL with an exception set, as the C API documents.
            let mv = unsafe { Bound::from_owned_ptr_or_err(py, raw) }?;
            state.memoryview = Some(mv.unbind());
        }
        let mv = state
            .memoryview
            .as_ref()
            .map(|m| m.bind(py).clone())
            .ok_or_else(|| kvtier_err("memoryview missing"))?;
        drop(state);
        let np = py.import("numpy")?;
        let uint8 = np.getattr("uint8")?;
        np.call_method1("frombuffer", (mv, uint8))
    }

    /// A copy of the row's bytes.
    fn tobytes<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyBytes>> {
        let state = self.state.lock();
        match state.grant.as_ref() {
            None => Err(kvtier_err(format!("row {} was released", self.chunk_id))),
            Some(Grant::Read(r)) => Ok(PyBytes::new(py, r)),
            Some(Grant::Write(w)) => Ok(PyBytes::new(py, w)),
        }
    }

    /// Releases the grant. Raises if an array of the row is still alive (the grant is kept).
    fn release(&self, py: Python<'_>) -> PyResult<()> {
        self.release_inner(py)
    }

    fn __enter__(slf: Py<Self>) -> Py<Self> {
        slf
    }

    #[pyo3(signature = (*_exc))]
    fn __exit__(&self, py: Python<'_>, _exc: &Bound<'_, pyo3::types::PyTuple>) -> PyResult<bool> {
        self.release_inner(py)?;
        Ok(false)
    }
}
