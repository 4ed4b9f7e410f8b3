//! The job table: every primary↔secondary job handed to a tier and not yet finished, by id.
//!
//! A tier's result is only trusted for a job this table holds under that tier, and a job's
//! entry is what releases its pins or reserved rows once it ends, so registering and removing
//! go through here and nowhere else.

use std::collections::HashMap;

use crate::job::{JobId, JobKind, JobResult};
use crate::key::OffloadKey;
use crate::request::ReqContext;

/// A registered primary↔secondary job.
pub(crate) struct JobMeta {
    /// The secondary tier the job was handed to.
    pub(crate) tier: usize,
    /// A store (cascade or peer) or a promotion: what its end releases.
    pub(crate) kind: JobKind,
    /// The chunks it copies.
    pub(crate) keys: Vec<OffloadKey>,
    /// The request it copies them for (the primary's pins and reservations are per request).
    pub(crate) ctx: ReqContext,
}

/// The jobs in flight (see the module docs).
#[derive(Default)]
pub(crate) struct JobTable {
    jobs: HashMap<JobId, JobMeta>,
    next: u64,
    /// The buffer tiers report finished jobs into, kept between polls so a poll allocates
    /// nothing.
    results: Vec<JobResult>,
}

impl JobTable {
    /// Registers `meta` under a new id.
    pub(crate) fn register(&mut self, meta: JobMeta) -> JobId {
        let id = JobId(self.next);
        self.next += 1;
        self.jobs.insert(id, meta);
        id
    }

    /// The job `id`, while in flight.
    pub(crate) fn get(&self, id: &JobId) -> Option<&JobMeta> {
        self.jobs.get(id)
    }

    /// Takes job `id` out: it has ended.
    pub(crate) fn remove(&mut self, id: &JobId) -> Option<JobMeta> {
        self.jobs.remove(id)
    }

    /// Jobs in flight.
    pub(crate) fn len(&self) -> usize {
        self.jobs.len()
    }

    /// Whether no job is in flight.
    pub(crate) fn is_empty(&self) -> bool {
        self.jobs.is_empty()
    }

    /// The ids of tier `idx`'s jobs.
    pub(crate) fn ids_of(&self, idx: usize) -> Vec<JobId> {
        self.jobs
            .iter()
            .filter(|(_, m)| m.tier == idx)
            .map(|(id, _)| *id)
            .collect()
    }

    /// How many jobs tier `idx` holds.
    pub(crate) fn held_by(&self, idx: usize) -> usize {
        self.jobs.values().filter(|m| m.tier == idx).count()
    }

    /// Chunks of tier `idx`'s promotions in flight.
    pub(crate) fn promoting(&self, idx: usize) -> usize {
        self.jobs
            .values()
            .filter(|m| m.tier == idx && m.kind == JobKind::Promotion)
            .map(|m| m.keys.len())
            .sum()
    }

    /// Whether a promotion is in flight on a tier `on_tier` accepts.
    pub(crate) fn any_promotion_on(&self, mut on_tier: impl FnMut(usize) -> bool) -> bool {
        self.jobs
            .values()
            .any(|m| m.kind == JobKind::Promotion && on_tier(m.tier))
    }

    /// The (empty) result buffer, for a poll; hand it back with
    /// [`JobTable::return_result_buffer`].
    pub(crate) fn take_result_buffer(&mut self) -> Vec<JobResult> {
        std::mem::take(&mut self.results)
    }

    /// Keeps the result buffer (and its capacity) for the next poll.
    pub(crate) fn return_result_buffer(&mut self, results: Vec<JobResult>) {
        self.results = results;
    }
}
