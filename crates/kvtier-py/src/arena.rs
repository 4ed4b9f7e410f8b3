//! `kvtier.ArenaView`: a worker process's window on the manager's shared arena, and `Row`, one
//! held row grant whose bytes are exposed as zero-copy numpy arrays.
//!
//! Soundness: the grant is owned by a small `RowMemory` object that numpy arrays of the row
//! take as their base (through `__array_interface__`); every derived array (slices, reshapes,
//! `memoryview(arr)`) keeps that base alive, so the grant — and the mapping — outlive every
//! array. `Row.release()` refuses while arrays exist (it checks that it holds the only
//! reference), so a released row really is free for other writers.

use std::path::PathBuf;

use parking_lot::Mutex;
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyDict};
use tiering_core::arena::ArenaView;
use tiering_core::arena::{RowRead, RowWrite};

use crate::errors::kvtier_err;

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

    /// `(address, length)` of the row region (row 0 on, `num_chunks × row_stride` bytes): the
    /// range to register with a device for DMA (e.g. `cudaHostRegister`), and to unregister
    /// before the view is dropped. Rows are only to be touched through grants.
    #[getter]
    fn row_region(&self) -> (usize, usize) {
        let (ptr, len) = self.view.row_region();
        (ptr as usize, len)
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
            Ok::<_, tiering_core::arena::ArenaError>(())
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
    fn row(&self, py: Python<'_>, chunk_id: u32, write: bool) -> PyResult<PyRow> {
        let grant = if write {
            Grant::Write(self.view.write_row(chunk_id).map_err(kvtier_err)?)
        } else {
            Grant::Read(self.view.read_row(chunk_id).map_err(kvtier_err)?)
        };
        Ok(PyRow {
            chunk_id,
            memory: Mutex::new(Some(Py::new(py, PyRowMemory::new(grant))?)),
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

/// The memory of one granted row, owning the grant. numpy arrays made from it (through
/// `__array_interface__`) keep it as their base, so the grant lives as long as any of them.
#[pyclass(module = "kvtier", name = "RowMemory", frozen)]
pub(crate) struct PyRowMemory {
    /// Held only to be dropped (releasing the row lock) when the last array is gone.
    _grant: Grant,
    ptr: usize,
    len: usize,
    writable: bool,
}

impl PyRowMemory {
    fn new(mut grant: Grant) -> Self {
        let (ptr, len, writable) = match &mut grant {
            Grant::Read(r) => (r.as_ptr() as usize, r.len(), false),
            Grant::Write(w) => (w.as_mut_ptr() as usize, w.len(), true),
        };
        Self {
            _grant: grant,
            ptr,
            len,
            writable,
        }
    }

    /// A copy of the row, taken through the raw pointer: numpy arrays of a write grant may be
    /// written by other Python threads, so no Rust reference to the bytes is ever formed.
    fn to_vec(&self) -> Vec<u8> {
        let mut out = vec![0u8; self.len];
        // SAFETY: `ptr..ptr+len` is the row this object's grant holds, inside the arena mapping
        // the grant's `Arc` keeps mapped for as long as `self` lives; `out` has `len` bytes and
        // does not overlap the mapping.
        unsafe { std::ptr::copy_nonoverlapping(self.ptr as *const u8, out.as_mut_ptr(), self.len) };
        out
    }
}

#[pymethods]
impl PyRowMemory {
    /// numpy's array interface (version 3): a `uint8` vector over the row, read-only for a
    /// read grant.
    #[getter]
    fn __array_interface__<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let d = PyDict::new(py);
        d.set_item("shape", (self.len,))?;
        d.set_item("typestr", "|u1")?;
        d.set_item("data", (self.ptr, !self.writable))?;
        d.set_item("version", 3)?;
        Ok(d)
    }
}

/// A held grant on one arena row. Use as a context manager; `array()` gives a zero-copy numpy
/// `uint8` array of the row (writable for a write grant). Releasing the row while an array of it
/// is alive is refused; a `Row` dropped while arrays live leaves the grant to them, released
/// when the last one goes.
#[pyclass(module = "kvtier", name = "Row")]
pub(crate) struct PyRow {
    chunk_id: u32,
    memory: Mutex<Option<Py<PyRowMemory>>>,
}

impl PyRow {
    fn memory<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyRowMemory>> {
        self.memory
            .lock()
            .as_ref()
            .map(|m| m.bind(py).clone())
            .ok_or_else(|| kvtier_err(format!("row {} was released", self.chunk_id)))
    }

    fn release_inner(&self, py: Python<'_>) -> PyResult<()> {
        let mut guard = self.memory.lock();
        if let Some(m) = guard.as_ref() {
            // Our reference is the only one unless an array (or a view of one) still uses it.
            let users = m.bind(py).get_refcnt() - 1;
            if users > 0 {
                return Err(kvtier_err(format!(
                    "row {} is still used by {users} array(s); delete them before releasing it",
                    self.chunk_id
                )));
            }
        }
        *guard = None;
        Ok(())
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
    fn writable(&self, py: Python<'_>) -> PyResult<bool> {
        Ok(self.memory(py)?.get().writable)
    }

    /// A zero-copy numpy `uint8` array over the row (read-only for a read grant).
    fn array<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyAny>> {
        let memory = self.memory(py)?;
        py.import("numpy")?.call_method1("asarray", (memory,))
    }

    /// A copy of the row's bytes.
    fn tobytes<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyBytes>> {
        let memory = self.memory(py)?;
        Ok(PyBytes::new(py, &memory.get().to_vec()))
    }

    /// Releases the grant. Raises if an array of the row is still alive (the grant is kept).
    fn release(&self, py: Python<'_>) -> PyResult<()> {
        self.release_inner(py)
    }

    fn __enter__(slf: Py<Self>) -> Py<Self> {
        slf
    }

    /// Releases the grant. Left by an exception, it never raises over it: arrays the
    /// exception's traceback still holds keep the grant until they are gone.
    #[pyo3(signature = (*exc))]
    fn __exit__(&self, py: Python<'_>, exc: &Bound<'_, pyo3::types::PyTuple>) -> PyResult<bool> {
        let unwinding = exc.get_item(0).is_ok_and(|t| !t.is_none());
        if unwinding {
            // The grant passes to the arrays still alive (released with the last of them), or
            // is released now if there are none.
            *self.memory.lock() = None;
        } else {
            self.release_inner(py)?;
        }
        Ok(false)
    }
}
