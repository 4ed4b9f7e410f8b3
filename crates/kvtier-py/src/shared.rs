//! What a `kvtier.TieringManager` handle and its steps share: the manager itself, its arena
//! (outside the manager's lock, see `manager.rs`), and the thread that holds a step, which is
//! how the handle refuses a call that would wait for the caller's own step.

use std::sync::Arc;
use std::thread::ThreadId;

use parking_lot::{Mutex, RwLock};
use pyo3::prelude::*;
use tiering_core::{TierInfo, TieringManager, arena::ChunkArena};

use crate::errors::StepError;

/// The manager and the thread that holds its step, shared with the steps.
pub(crate) struct Shared {
    pub(crate) manager: RwLock<Option<TieringManager>>,
    /// The manager's arena until shutdown, outside `manager`'s lock (see the module docs).
    pub(crate) arena: Mutex<Option<Arc<ChunkArena>>>,
    /// The thread holding a step of this manager, if any.
    pub(crate) step_thread: Mutex<Option<ThreadId>>,
    /// The chain file's `type` of each tier: the primary's, then the secondaries' in order.
    pub(crate) tier_types: Vec<String>,
    /// Name, medium and locality of each tier, as built: the primary's, then the secondaries'.
    pub(crate) tier_infos: Vec<TierInfo>,
}

impl Drop for Shared {
    fn drop(&mut self) {
        // A manager collected without `shutdown` shuts down here: joining the control thread
        // and draining the tiers can take seconds, so other Python threads keep running. (When
        // the interpreter is finalizing it cannot be attached to; then it is dropped as is.)
        if let Some(manager) = self.manager.get_mut().take() {
            let arena = self.arena.get_mut().take();
            // Not attachable: the closure is dropped unrun, which drops the two just the same.
            let _ = Python::try_attach(|py| py.detach(move || drop((manager, arena))));
        }
    }
}

impl Shared {
    pub(crate) fn refuse_if_this_thread_holds_a_step(&self, what: &str) -> PyResult<()> {
        if *self.step_thread.lock() == Some(std::thread::current().id()) {
            return Err(StepError::new_err(format!(
                "{what}: this thread holds a step of this manager; call it on the step, or exit \
                 the step first (waiting here would deadlock)"
            )));
        }
        Ok(())
    }
}
