//! `kvtier.WorkerReporter`: a copy worker's connection to the manager's completion channel.

use std::path::PathBuf;

use parking_lot::Mutex;
use pyo3::prelude::*;
use tiering_core::channel::WorkerReporter;

use crate::errors::kvtier_err;
use crate::keys::keys_from_py;

/// Reports finished device→arena stores of one worker rank to the manager's completion channel
/// (`manager.open_completion_channel(path)`), so the manager completes and cascades them while
/// the model runs. `fingerprint` is the manager's `arena_fingerprint`.
#[pyclass(module = "kvtier", name = "WorkerReporter", frozen)]
pub(crate) struct PyWorkerReporter {
    inner: Mutex<Option<WorkerReporter>>,
    rank: u32,
}

#[pymethods]
impl PyWorkerReporter {
    /// Connects to the channel at `socket_path` as `rank`.
    #[new]
    #[allow(clippy::needless_pass_by_value, reason = "pyo3 extracts an owned path")]
    fn new(py: Python<'_>, socket_path: PathBuf, rank: u32, fingerprint: u64) -> PyResult<Self> {
        let reporter = py
            .detach(|| WorkerReporter::connect(&socket_path, rank, fingerprint))
            .map_err(|e| kvtier_err(format!("cannot connect to {}: {e}", socket_path.display())))?;
        Ok(Self {
            inner: Mutex::new(Some(reporter)),
            rank,
        })
    }

    /// This worker's rank.
    #[getter]
    fn rank(&self) -> u32 {
        self.rank
    }

    /// Reports that the copies of `keys` into their rows finished (`success`) or failed.
    #[pyo3(signature = (keys, success = true))]
    fn report(&self, py: Python<'_>, keys: &Bound<'_, PyAny>, success: bool) -> PyResult<()> {
        let keys = keys_from_py(keys)?;
        py.detach(|| {
            let mut guard = self.inner.lock();
            match guard.as_mut() {
                None => Err(kvtier_err("the reporter was closed")),
                Some(r) => r.report(&keys, success).map_err(kvtier_err),
            }
        })
    }

    /// Says goodbye and closes (the manager then does not fail this rank's stores). Idempotent.
    fn close(&self, py: Python<'_>) -> PyResult<()> {
        py.detach(|| match self.inner.lock().take() {
            None => Ok(()),
            Some(r) => r.close().map_err(kvtier_err),
        })
    }
}
