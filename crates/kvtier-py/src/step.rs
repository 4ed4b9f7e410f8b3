//! `kvtier.Step`: one scheduler step, holding the manager's lock until it is exited.
//!
//! The methods carry vLLM 0.33.0's `OffloadingManager` names and argument shapes. They run
//! with the GIL held: under the step lock every call is short (tier I/O runs on the tiers'
//! threads), and keeping the GIL saves two thread-state switches per call.

use std::sync::Arc;

use parking_lot::Mutex;
use pyo3::prelude::*;
use pyo3::types::PyList;
use tiering_core::{OffloadingManager, Step};

use crate::errors::{StepError, kvtier_err};
use crate::keys::{key_from_py, keys_from_py};
use crate::shared::Shared;
use crate::values::{
    LoadSource, LookupResult, OffloadPolicy, PrepareStoreOutput, PyReqContext, ScheduleEndContext,
    events_list, stats_to_py,
};

/// One scheduler step of a `TieringManager` (from `manager.step()`): holds the manager's lock
/// until exited, so a chunk `lookup` reported as a hit stays resident until `prepare_load`.
/// Use as a context manager; leaving the block (also by an exception) releases the lock.
#[pyclass(module = "kvtier", name = "Step", frozen)]
pub(crate) struct PyStep {
    step: Mutex<Option<Step<'static>>>,
    shared: Arc<Shared>,
}

impl PyStep {
    pub(crate) fn new(step: Step<'static>, shared: Arc<Shared>) -> Self {
        Self {
            step: Mutex::new(Some(step)),
            shared,
        }
    }

    fn with<R>(
        &self,
        f: impl FnOnce(&mut Step<'static>) -> Result<R, tiering_core::ManagerError>,
    ) -> PyResult<R> {
        let mut guard = self.step.lock();
        let step = guard.as_mut().ok_or_else(|| {
            StepError::new_err("the step was released; start a new one with manager.step()")
        })?;
        f(step).map_err(kvtier_err)
    }

    fn release_inner(&self, py: Python<'_>) {
        let taken = self.step.lock().take();
        if let Some(step) = taken {
            // Cleared while the lock is still held, so the next holder's mark is never erased.
            *self.shared.step_thread.lock() = None;
            // Dropping flushes what the step queued after on_schedule_end, then unlocks.
            py.detach(move || drop(step));
        }
    }
}

impl Drop for PyStep {
    fn drop(&mut self) {
        if let Some(step) = self.step.get_mut().take() {
            *self.shared.step_thread.lock() = None;
            drop(step);
        }
    }
}

#[pymethods]
impl PyStep {
    /// The verdict for one chunk: `HIT` (load it this step), `HIT_PENDING`, `MISS` or `RETRY`.
    fn lookup(
        &self,
        py: Python<'_>,
        key: &Bound<'_, PyAny>,
        req_context: &PyReqContext,
    ) -> PyResult<Py<PyAny>> {
        let key = key_from_py(key)?;
        let r = self.with(|s| s.lookup(&key, &req_context.inner))?;
        LookupResult::object(py, r)
    }

    /// Pins `HIT` keys for a device load; returns their arena rows (chunk ids) in key order.
    fn prepare_load<'py>(
        &self,
        py: Python<'py>,
        keys: &Bound<'py, PyAny>,
        req_context: &PyReqContext,
    ) -> PyResult<Bound<'py, PyList>> {
        let keys = keys_from_py(keys)?;
        let ids = self.with(|s| s.prepare_load(&keys, &req_context.inner))?;
        PyList::new(py, ids)
    }

    /// A recency hint for every tier; unknown keys are ignored.
    fn touch(&self, keys: &Bound<'_, PyAny>, req_context: &PyReqContext) -> PyResult<()> {
        let keys = keys_from_py(keys)?;
        self.with(|s| s.touch(&keys, &req_context.inner))
    }

    /// Releases the pins of a finished device load.
    fn complete_load(&self, keys: &Bound<'_, PyAny>, req_context: &PyReqContext) -> PyResult<()> {
        let keys = keys_from_py(keys)?;
        self.with(|s| s.complete_load(&keys, &req_context.inner))
    }

    /// Reserves arena rows for newly computed chunks; `None` when there is no room (retry on a
    /// later step).
    fn prepare_store(
        &self,
        py: Python<'_>,
        keys: &Bound<'_, PyAny>,
        req_context: &PyReqContext,
    ) -> PyResult<Option<PrepareStoreOutput>> {
        let parsed = keys_from_py(keys)?;
        let out = self.with(|s| s.prepare_store(&parsed, &req_context.inner))?;
        out.map(|o| PrepareStoreOutput::from_core(py, o, &parsed, keys))
            .transpose()
    }

    /// The device→arena copy of a `prepare_store` finished (`success`) or failed.
    #[pyo3(signature = (keys, req_context, success = true))]
    fn complete_store(
        &self,
        keys: &Bound<'_, PyAny>,
        req_context: &PyReqContext,
        success: bool,
    ) -> PyResult<()> {
        let keys = keys_from_py(keys)?;
        self.with(|s| s.complete_store(&keys, &req_context.inner, success))
    }

    /// A request reached the scheduler; returns its offload policy.
    fn on_new_request(&self, py: Python<'_>, req_context: &PyReqContext) -> PyResult<Py<PyAny>> {
        let policy = self.with(|s| s.on_new_request(&req_context.inner))?;
        OffloadPolicy::object(py, policy)
    }

    /// No further `prepare_*` calls will come for the request (completions may).
    fn on_request_finished(&self, req_context: &PyReqContext) -> PyResult<()> {
        self.with(|s| s.on_request_finished(&req_context.inner))
    }

    /// The end-of-step flush (promotions, tiers' step hooks). The lock is held until the step
    /// is exited, so the connector's later calls of the step (stores, finished requests) may
    /// follow it.
    #[pyo3(signature = (ctx = None))]
    fn on_schedule_end(&self, ctx: Option<&ScheduleEndContext>) -> PyResult<()> {
        let core = ctx.map(ScheduleEndContext::to_core).unwrap_or_default();
        self.with(|s| s.on_schedule_end(&core))
    }

    /// Where `key`'s chunk came from for this request (vLLM's `get_load_source`; ask after
    /// `lookup` answered `HIT`): the secondary tier whose promotion brought it into the primary
    /// for this request, else the primary. Remembered for announced requests until they end.
    fn load_source(&self, key: &Bound<'_, PyAny>, req_context: &PyReqContext) -> PyResult<LoadSource> {
        let key = key_from_py(key)?;
        let source = self.with(|s| s.load_source(&key, &req_context.inner))?;
        let position = source.secondary.map_or(0, |i| i + 1);
        let tier_type = self.shared.tier_types.get(position).cloned().unwrap_or_default();
        Ok(LoadSource::from_core(source, tier_type))
    }

    /// Events since the last call (primary first, then each secondary in chain order).
    fn take_events<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyList>> {
        let events = self.with(Step::take_events)?;
        events_list(py, events)
    }

    /// The engine's copies queued at the last `reset_cache_fencing_writes` are over: the
    /// fenced rows can be allocated again. Returns how many were released.
    fn release_reset_fence(&self) -> PyResult<usize> {
        self.with(Step::release_reset_fence)
    }

    /// Whether the engine should keep stepping even with no requests.
    fn has_pending_work(&self) -> PyResult<bool> {
        self.with(Step::has_pending_work)
    }

    /// A snapshot of the counters (as `TieringManager.stats`).
    fn stats<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyAny>> {
        let stats = self.with(Step::stats)?;
        stats_to_py(py, &stats)
    }

    /// Releases the lock now (what leaving the `with` block does). Idempotent.
    fn release(&self, py: Python<'_>) {
        self.release_inner(py);
    }

    /// Whether the step was released.
    #[getter]
    fn released(&self) -> bool {
        self.step.lock().is_none()
    }

    fn __enter__(slf: Py<Self>) -> Py<Self> {
        slf
    }

    #[pyo3(signature = (*_exc))]
    fn __exit__(&self, py: Python<'_>, _exc: &Bound<'_, pyo3::types::PyTuple>) -> bool {
        self.release_inner(py);
        false
    }

    fn __repr__(&self) -> String {
        format!("Step(released={})", self.released())
    }
}
