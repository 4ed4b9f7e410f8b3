//! The `kvtier` Python extension (module `kvtier._kvtier`, re-exported by the `kvtier` package).
//!
//! What it exposes (`docs/ARCHITECTURE.md`, "Engine integration"):
//! - `manager::PyTieringManager` (`kvtier.TieringManager`): a chain built from a chain file,
//!   whose engine calls are made on a `step::PyStep` (`with manager.step() as s:`) with the
//!   method names and argument shapes of vLLM 0.33.0's `OffloadingManager`;
//! - `arena::PyArenaView` (`kvtier.ArenaView`): a worker process's window on the shared arena,
//!   rows as zero-copy numpy arrays over held row grants;
//! - `reporter::PyWorkerReporter` (`kvtier.WorkerReporter`): store completions reported over
//!   the completion channel.
//!
//! Every call that can block (taking the step lock, reset, shutdown, socket writes, row copies)
//! releases the GIL.

// The tier crates are linked for their `register_tier!` registrations (chain files name them).
use tier_cpu as _;
use tier_disk as _;
use tier_p2p as _;
use tier_redis as _;

mod arena;
mod chain;
mod errors;
#[cfg(feature = "fault-injection")]
mod faulty;
mod keys;
mod manager;
mod reporter;
mod shared;
mod step;
mod values;

use pyo3::prelude::*;

/// The extension module `kvtier._kvtier`.
#[pymodule]
fn _kvtier(m: &Bound<'_, PyModule>) -> PyResult<()> {
    let py = m.py();
    m.add("KvtierError", py.get_type::<errors::KvtierError>())?;
    m.add("ConfigError", py.get_type::<errors::ConfigError>())?;
    m.add("StepError", py.get_type::<errors::StepError>())?;
    m.add_class::<values::LookupResult>()?;
    m.add_class::<values::OffloadPolicy>()?;
    m.add_class::<values::PrepareStoreOutput>()?;
    m.add_class::<values::OffloadingEvent>()?;
    m.add_class::<values::LoadSource>()?;
    m.add_class::<values::ScheduleEndContext>()?;
    m.add_class::<values::PyReqContext>()?;
    m.add_class::<manager::PyTieringManager>()?;
    m.add_class::<step::PyStep>()?;
    m.add_class::<arena::PyArenaView>()?;
    m.add_class::<arena::PyRow>()?;
    m.add_class::<arena::PyRowMemory>()?;
    m.add_class::<reporter::PyWorkerReporter>()?;
    m.add_function(wrap_pyfunction!(chain::chain_arena_path, m)?)?;
    m.add_function(wrap_pyfunction!(keys::make_offload_key, m)?)?;
    m.add_function(wrap_pyfunction!(keys::split_offload_key, m)?)?;
    m.add("KEY_BYTES", tiering_core::KEY_BYTES)?;
    Ok(())
}
