//! `kvtier.TieringManager`: the handle of a chain built from a chain file.
//!
//! The engine calls of a scheduler step go on a `Step` (`manager.step()`); the handle keeps the
//! read-mostly hooks and the teardown. One thread must never hold two steps of a manager (the
//! second would wait for the first forever) nor call a handle hook that takes the lock while it
//! holds a step: both raise `StepError` instead of deadlocking.
//!
//! A thread holding a step never touches the handle's read-write lock either: a teardown
//! (`shutdown`, `reset_cache`) holds or waits for its write side while it waits for the step to
//! end, and a reader queued behind that writer would wait for itself. The arena getters read a
//! copy of the arena handle kept outside that lock.

use std::path::PathBuf;
use std::sync::Arc;

use parking_lot::{Mutex, RwLock};
use pyo3::prelude::*;
use pyo3::types::PyList;
use tiering_config::ChainConfig;
use tiering_core::{TierInfo, TieringManager, registry::Registry};

use crate::errors::{config_err, kvtier_err};
use crate::shared::Shared;
use crate::step::PyStep;
use crate::values::{events_list, locality_name, medium_name, row_bytes, stats_to_py};

/// A tiering manager over a chain of tiers (CPU primary, then disk, peers, ...), built from a
/// chain file. Make the engine calls of each scheduler step on `with manager.step() as s:`.
#[pyclass(module = "kvtier", name = "TieringManager")]
pub(crate) struct PyTieringManager {
    shared: Arc<Shared>,
}

/// Builds the chain; `reporters` overrides the number of worker ranks that report each store
/// (chain files have no key for it).
fn build(
    config: &ChainConfig,
    chunk_bytes: usize,
    reporters: Option<u32>,
) -> Result<(TieringManager, Vec<TierInfo>), String> {
    if reporters == Some(0) {
        return Err("reporters must be at least 1".to_owned());
    }
    let registry = Registry::global().map_err(|e| e.to_string())?;
    let mut built = config
        .resolve(registry)
        .and_then(|r| r.build_tiers(chunk_bytes))
        .map_err(|e| e.to_string())?;
    if let Some(n) = reporters {
        built.manager_config.reporters = n;
    }
    let infos = std::iter::once(built.primary.info())
        .chain(built.secondaries.iter().map(|t| t.info()))
        .collect();
    Ok((built.into_manager(), infos))
}

impl PyTieringManager {
    fn from_chain(
        py: Python<'_>,
        config: &ChainConfig,
        chunk_bytes: usize,
        reporters: Option<u32>,
    ) -> PyResult<Self> {
        if chunk_bytes == 0 {
            return Err(config_err("chunk_bytes must be positive"));
        }
        let (manager, tier_infos) = py
            .detach(|| build(config, chunk_bytes, reporters))
            .map_err(config_err)?;
        Ok(Self {
            shared: Arc::new(Shared {
                arena: Mutex::new(Some(Arc::clone(manager.arena()))),
                manager: RwLock::new(Some(manager)),
                step_thread: Mutex::new(None),
                tier_types: std::iter::once(&config.primary)
                    .chain(&config.secondaries)
                    .map(|t| t.tier_type.clone())
                    .collect(),
                tier_infos,
            }),
        })
    }

    /// Runs `f` on the live manager (read lock), GIL released.
    fn with_manager<R: Send>(
        &self,
        py: Python<'_>,
        what: &str,
        f: impl FnOnce(&TieringManager) -> R + Send,
    ) -> PyResult<R> {
        self.shared.refuse_if_this_thread_holds_a_step(what)?;
        let shared = &self.shared;
        py.detach(|| shared.manager.read().as_ref().map(f))
            .ok_or_else(|| kvtier_err("the manager has been shut down"))
    }

    fn with_manager_mut<R: Send>(
        &self,
        py: Python<'_>,
        what: &str,
        f: impl FnOnce(&mut TieringManager) -> R + Send,
    ) -> PyResult<R> {
        self.shared.refuse_if_this_thread_holds_a_step(what)?;
        let shared = &self.shared;
        py.detach(|| shared.manager.write().as_mut().map(f))
            .ok_or_else(|| kvtier_err("the manager has been shut down"))
    }

    fn arena_info<R: Send>(
        &self,
        py: Python<'_>,
        f: impl FnOnce(&Arc<tiering_core::arena::ChunkArena>) -> R + Send,
    ) -> PyResult<R> {
        // Not through `manager`'s lock, so this works inside a step too (see the module docs).
        let arena = self
            .shared
            .arena
            .lock()
            .clone()
            .ok_or_else(|| kvtier_err("the manager has been shut down"))?;
        Ok(py.detach(|| f(&arena)))
    }
}

#[pymethods]
impl PyTieringManager {
    /// Builds the chain described by the chain file at `path`, for chunks of `chunk_bytes`
    /// bytes (one offloaded chunk of the engine's KV cache). `reporters` is the number of
    /// worker ranks that report each store on the completion channel (default 1).
    #[staticmethod]
    #[pyo3(signature = (path, chunk_bytes, reporters = None))]
    #[allow(clippy::needless_pass_by_value, reason = "pyo3 extracts an owned path")]
    fn from_config(
        py: Python<'_>,
        path: PathBuf,
        chunk_bytes: usize,
        reporters: Option<u32>,
    ) -> PyResult<Self> {
        let config = py.detach(|| ChainConfig::load(&path)).map_err(config_err)?;
        Self::from_chain(py, &config, chunk_bytes, reporters)
    }

    /// Builds the chain described by TOML `text` (the chain-file format); `source` names it in
    /// error messages.
    #[staticmethod]
    #[pyo3(signature = (text, chunk_bytes, source = "<string>", reporters = None))]
    fn from_toml(
        py: Python<'_>,
        text: &str,
        chunk_bytes: usize,
        source: &str,
        reporters: Option<u32>,
    ) -> PyResult<Self> {
        let config = ChainConfig::parse(source, text).map_err(config_err)?;
        Self::from_chain(py, &config, chunk_bytes, reporters)
    }

    /// Starts a scheduler step: waits (GIL released) for the manager's lock and holds it until
    /// the step is exited. Use as `with manager.step() as s:`; exit it before the model runs.
    fn step(&self, py: Python<'_>) -> PyResult<PyStep> {
        self.shared.refuse_if_this_thread_holds_a_step("step")?;
        let shared = &self.shared;
        let step = py
            .detach(|| shared.manager.read().as_ref().map(TieringManager::detached_step))
            .ok_or_else(|| kvtier_err("the manager has been shut down"))?;
        *self.shared.step_thread.lock() = Some(std::thread::current().id());
        Ok(PyStep::new(step, Arc::clone(&self.shared)))
    }

    /// Whether the engine should keep stepping even with no requests.
    fn has_pending_work(&self, py: Python<'_>) -> PyResult<bool> {
        self.with_manager(py, "has_pending_work", TieringManager::has_pending_work)?
            .map_err(kvtier_err)
    }

    /// Events since the last call: the primary tier's, then each secondary's in chain order.
    fn take_events<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyList>> {
        let events = self
            .with_manager(py, "take_events", TieringManager::take_events)?
            .map_err(kvtier_err)?;
        events_list(py, events)
    }

    /// A snapshot of the counters: `{"manager": {...}, "primary": {...}, "secondaries": [...],
    /// "jobs_in_flight": n, "gates": [...], "decisions": [...]}` (`gates` and `decisions`: one
    /// dict per secondary tier, in chain order).
    fn stats<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyAny>> {
        let stats = self
            .with_manager(py, "stats", TieringManager::stats)?
            .map_err(kvtier_err)?;
        stats_to_py(py, &stats)
    }

    /// vLLM's name for `stats`.
    fn get_stats<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyAny>> {
        self.stats(py)
    }

    /// Drains every tier, then forgets everything in the primary tier (secondary data
    /// survives). Not in the middle of a step.
    fn reset_cache(&self, py: Python<'_>) -> PyResult<()> {
        self.with_manager_mut(py, "reset_cache", TieringManager::reset_cache)?
            .map_err(kvtier_err)
    }

    /// `reset_cache` for an engine whose copies into the rows may still run after it (vLLM
    /// submits a step's store copies at the next step): rows with a write in flight are not
    /// allocated again until `release_reset_fence`. Returns how many rows are fenced.
    fn reset_cache_fencing_writes(&self, py: Python<'_>) -> PyResult<usize> {
        self.with_manager_mut(
            py,
            "reset_cache_fencing_writes",
            TieringManager::reset_cache_fencing_writes,
        )?
        .map_err(kvtier_err)
    }

    /// The copies queued at the last fencing reset are over: the fenced rows can be allocated
    /// again. Returns how many were released.
    fn release_reset_fence(&self, py: Python<'_>) -> PyResult<usize> {
        self.with_manager(py, "release_reset_fence", TieringManager::release_reset_fence)?
            .map_err(kvtier_err)
    }

    /// Stops the control plane, shuts the tiers down and releases the arena. Idempotent.
    fn shutdown(&self, py: Python<'_>) -> PyResult<()> {
        self.shared.refuse_if_this_thread_holds_a_step("shutdown")?;
        let shared = &self.shared;
        let result = py.detach(|| {
            let mut guard = shared.manager.write();
            let Some(m) = guard.as_mut() else {
                return Ok(());
            };
            let r = m.shutdown();
            if r.is_ok() {
                // Dropping the handle and the arena's copy here releases the arena (and its
                // shared-memory file).
                *guard = None;
                *shared.arena.lock() = None;
            }
            r
        });
        result.map_err(kvtier_err)
    }

    /// Opens the completion channel (a Unix socket at `path`) on which worker processes'
    /// `WorkerReporter`s report finished stores.
    #[allow(clippy::needless_pass_by_value, reason = "pyo3 extracts an owned path")]
    fn open_completion_channel(&self, py: Python<'_>, path: PathBuf) -> PyResult<()> {
        self.with_manager(py, "open_completion_channel", |m| {
            m.open_completion_channel(&path)
        })?
        .map_err(kvtier_err)
    }

    /// Number of arena rows (primary chunks).
    #[getter]
    fn num_chunks(&self, py: Python<'_>) -> PyResult<usize> {
        self.arena_info(py, |a| a.num_chunks())
    }

    /// Bytes of one chunk.
    #[getter]
    fn chunk_bytes(&self, py: Python<'_>) -> PyResult<usize> {
        self.arena_info(py, |a| a.chunk_bytes())
    }

    /// Bytes one arena row takes (the chunk size rounded up to the page size).
    #[getter]
    fn row_stride(&self, py: Python<'_>) -> PyResult<usize> {
        self.arena_info(py, |a| a.row_stride())
    }

    /// The arena's shared-memory file (for workers' `ArenaView`), or `None` if anonymous.
    #[getter]
    fn arena_path(&self, py: Python<'_>) -> PyResult<Option<PathBuf>> {
        self.arena_info(py, |a| a.shared_path().map(std::path::Path::to_path_buf))
    }

    /// The fingerprint workers present on the completion channel.
    #[getter]
    fn arena_fingerprint(&self, py: Python<'_>) -> PyResult<u64> {
        self.arena_info(py, |a| tiering_core::channel::arena_fingerprint(a))
    }

    /// The chain's tiers as built, primary first, then the secondaries in chain order: one dict
    /// each, `{"name", "type", "medium", "locality", "secondary"}` (`medium` "CPU"/"STORAGE" or
    /// `None`, `locality` "LOCAL"/"REMOTE" or `None`, `secondary` the index in chain order or
    /// `None` for the primary). Fixed for the manager's life; readable inside a step and after
    /// shutdown.
    #[getter]
    fn tiers<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyAny>> {
        let shared = &self.shared;
        let tiers: Vec<serde_json::Value> = shared
            .tier_infos
            .iter()
            .enumerate()
            .map(|(i, info)| {
                serde_json::json!({
                    "name": info.name,
                    "type": shared.tier_types.get(i).cloned().unwrap_or_default(),
                    "medium": info.medium.map(medium_name),
                    "locality": info.locality.map(locality_name),
                    "secondary": i.checked_sub(1),
                })
            })
            .collect();
        py.import("json")?
            .call_method1("loads", (serde_json::Value::from(tiers).to_string(),))
    }

    /// Whether the control-plane thread is running (`False` once shut down).
    #[getter]
    fn control_thread_running(&self, py: Python<'_>) -> PyResult<bool> {
        self.shared
            .refuse_if_this_thread_holds_a_step("control_thread_running")?;
        let shared = &self.shared;
        Ok(py.detach(|| {
            shared
                .manager
                .read()
                .as_ref()
                .is_some_and(TieringManager::control_thread_running)
        }))
    }

    /// A copy of arena row `chunk_id` (the owner's side; takes a read grant for the copy).
    fn read_row<'py>(&self, py: Python<'py>, chunk_id: u32) -> PyResult<Bound<'py, pyo3::types::PyBytes>> {
        let data = self
            .arena_info(py, |a| a.read_row(chunk_id).map(|r| r.to_vec()))?
            .map_err(kvtier_err)?;
        Ok(row_bytes(py, &data))
    }

    /// Copies `data` into arena row `chunk_id` (the owner's side; takes a write grant).
    fn write_row(&self, py: Python<'_>, chunk_id: u32, data: &[u8]) -> PyResult<()> {
        self.arena_info(py, |a| {
            let mut row = a.write_row(chunk_id).map_err(kvtier_err)?;
            if data.len() > row.len() {
                return Err(kvtier_err(format!(
                    "{} bytes do not fit a row of {} bytes",
                    data.len(),
                    row.len()
                )));
            }
            row[..data.len()].copy_from_slice(data);
            Ok(())
        })?
    }

    fn __enter__(slf: Py<Self>) -> Py<Self> {
        slf
    }

    #[pyo3(signature = (*_exc))]
    fn __exit__(&self, py: Python<'_>, _exc: &Bound<'_, pyo3::types::PyTuple>) -> PyResult<bool> {
        self.shutdown(py)?;
        Ok(false)
    }

    fn __repr__(&self, py: Python<'_>) -> String {
        match self.arena_info(py, |a| (a.num_chunks(), a.chunk_bytes())) {
            Ok((n, b)) => format!("TieringManager({n} chunks of {b} bytes)"),
            Err(_) => "TieringManager(shut down)".to_owned(),
        }
    }
}
