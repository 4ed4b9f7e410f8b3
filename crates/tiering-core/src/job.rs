//! Primary↔secondary transfer jobs and their results.

use std::fmt;
use std::time::Duration;

use crate::arena::RowGrant;
use crate::key::OffloadKey;
use crate::outcome::ChunkId;
use crate::request::ReqContext;

/// Identifies one primary↔secondary job. The manager allocates ids from one counter shared by
/// promotions, cascades and peer store jobs, so an id names exactly one job.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct JobId(pub u64);

impl fmt::Display for JobId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "job#{}", self.0)
    }
}

/// The direction of a job.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum JobKind {
    /// Primary → secondary: the tier reads the granted rows (a cascade, or a peer store job).
    Store,
    /// Secondary → primary: the tier writes the granted rows.
    Promotion,
}

/// One batch of chunks to move between the primary tier and one secondary tier.
///
/// `keys[i]` lives in arena row `chunk_ids[i]`, and `rows` grants access to exactly those rows —
/// read access for a store, write access for a promotion — for as long as the job is outstanding.
/// Dropping the job (or its rows) releases the grant, so a tier keeps the job (or moves the rows
/// to its I/O threads) until the copy is finished, then reports a [`JobResult`].
#[derive(Debug)]
pub struct TransferJob {
    /// The job id the result must carry.
    pub id: JobId,
    /// Store or promotion.
    pub kind: JobKind,
    /// The chunks, in order.
    pub keys: Vec<OffloadKey>,
    /// The arena rows, parallel to `keys`.
    pub chunk_ids: Vec<ChunkId>,
    /// The request the job belongs to.
    pub req: ReqContext,
    /// Access to the rows, parallel to `keys`.
    pub rows: RowGrant,
}

impl TransferJob {
    /// Why a tier whose chunks are `chunk_bytes` long cannot run this job as a `kind` job, or
    /// `None` when it can: it must have come through the method of its kind and carry one
    /// granted row per key, each one chunk long. A tier refuses a defective job (failing every
    /// key) rather than touch rows it was not meant to.
    #[must_use]
    pub fn defect(&self, kind: JobKind, chunk_bytes: usize) -> Option<&'static str> {
        if self.kind != kind {
            Some("submitted through the wrong method for its kind")
        } else if self.rows.len() != self.keys.len() {
            Some("row grants do not match its keys")
        } else if (0..self.rows.len()).any(|i| self.rows.row(i).map(<[u8]>::len) != Some(chunk_bytes)) {
            Some("a granted row is not one chunk long")
        } else {
            None
        }
    }
}

/// How a job ended.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum JobOutcome {
    /// Every key succeeded.
    Ok,
    /// Every key failed.
    Failed,
    /// Only these keys succeeded (a subset of the job's keys); the rest failed.
    Partial(Vec<OffloadKey>),
}

/// The report of one finished job. Every submitted job is reported exactly once.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct JobResult {
    /// The job's id.
    pub id: JobId,
    /// Whether it succeeded.
    pub outcome: JobOutcome,
    /// Payload bytes moved.
    pub bytes: u64,
    /// Time from submission to completion.
    pub elapsed: Duration,
}

impl JobResult {
    /// A fully successful result.
    #[must_use]
    pub fn ok(id: JobId, bytes: u64, elapsed: Duration) -> Self {
        Self {
            id,
            outcome: JobOutcome::Ok,
            bytes,
            elapsed,
        }
    }

    /// A fully failed result.
    #[must_use]
    pub fn failed(id: JobId, elapsed: Duration) -> Self {
        Self {
            id,
            outcome: JobOutcome::Failed,
            bytes: 0,
            elapsed,
        }
    }

    /// Builds the result from per-key success flags (parallel to `keys`): `Ok`, `Failed` or
    /// `Partial` as appropriate.
    #[must_use]
    pub fn from_key_outcomes(
        id: JobId,
        keys: &[OffloadKey],
        succeeded: &[bool],
        bytes: u64,
        elapsed: Duration,
    ) -> Self {
        let ok: Vec<OffloadKey> = keys
            .iter()
            .zip(succeeded)
            .filter(|&(_, &s)| s)
            .map(|(k, _)| *k)
            .collect();
        let outcome = if ok.len() == keys.len() {
            JobOutcome::Ok
        } else if ok.is_empty() {
            JobOutcome::Failed
        } else {
            JobOutcome::Partial(ok)
        };
        Self {
            id,
            outcome,
            bytes,
            elapsed,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::arena::ChunkArena;

    fn job(kind: JobKind, keys: usize, rows: RowGrant) -> TransferJob {
        TransferJob {
            id: JobId(1),
            kind,
            keys: (0..keys as u64).map(OffloadKey::from_u64).collect(),
            chunk_ids: (0..keys as u32).collect(),
            req: ReqContext::local("r"),
            rows,
        }
    }

    #[test]
    fn a_job_is_runnable_only_as_its_kind_with_one_chunk_long_row_per_key() {
        let arena = ChunkArena::new(4, 64).unwrap();
        let store = job(
            JobKind::Store,
            2,
            RowGrant::Read(arena.read_rows(&[0, 1]).unwrap()),
        );
        assert_eq!(store.defect(JobKind::Store, 64), None);
        assert_eq!(
            store.defect(JobKind::Promotion, 64),
            Some("submitted through the wrong method for its kind")
        );
        assert_eq!(
            store.defect(JobKind::Store, 128),
            Some("a granted row is not one chunk long")
        );
        drop(store);
        let short = job(
            JobKind::Promotion,
            3,
            RowGrant::Write(arena.write_rows(&[2, 3]).unwrap()),
        );
        assert_eq!(
            short.defect(JobKind::Promotion, 64),
            Some("row grants do not match its keys")
        );
    }
}
