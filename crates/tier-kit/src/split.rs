//! A job run in several parts (batches, runs of consecutive slots) on several workers, still
//! reported once.
//!
//! A [`SplitJob`] owns the job's [`Ticket`], the tier's data about the job and one outcome per
//! key. It hands out [`Part`]s, each naming the key indices it carries. A part is settled once,
//! by value ([`Part::settle`]); a part dropped unsettled (a panic unwound through it, a queue
//! refused or cancelled it) leaves its keys at their initial outcome, so a tier starts every key
//! a part will carry at its failure value. When the last part is settled or dropped — and the
//! `SplitJob` itself, which holds the job open while parts are still being cut, is gone — the
//! tier's [`JobFinisher`] turns the outcomes into the one result, on the thread that let go last.

use std::sync::Arc;

use parking_lot::Mutex;

use tiering_core::{JobKind, OffloadKey};

use crate::ledger::Ticket;

/// What a tier keeps about a job while its parts run: its direction and its keys, in order —
/// what its [`JobFinisher`] counts and reports it by, once the rows are gone. The `T` of a
/// [`SplitJob`] whose finisher needs nothing more (the outcomes carry the rest); a tier that
/// keeps more about a job wraps it in a type of its own.
///
/// ```
/// use std::sync::Arc;
/// use tier_kit::{JobFinisher, JobKeys, JobLedger, SplitJob, Ticket, TierCounters};
/// use tiering_core::{JobId, JobKind, OffloadKey};
///
/// struct Finisher { counters: Arc<TierCounters>, chunk_bytes: u64 }
///
/// impl JobFinisher<JobKeys, bool> for Finisher {
///     fn finish(&self, job: &JobKeys, ok: Vec<bool>, ticket: Ticket) {
///         let moved = ok.iter().filter(|o| **o).count() as u64;
///         let bytes = moved * self.chunk_bytes;
///         // Counted before it is reported: the result is visible at once.
///         self.counters.count_job(job.kind, moved, job.keys.len() as u64 - moved, bytes);
///         ticket.complete_keys(&job.keys, &ok, bytes);
///     }
/// }
///
/// let ledger = JobLedger::default();
/// let counters = Arc::new(TierCounters::default());
/// let finisher = Arc::new(Finisher { counters: Arc::clone(&counters), chunk_bytes: 64 });
/// let keys = vec![OffloadKey::from_u64(1), OffloadKey::from_u64(2)];
/// let job = SplitJob::new(
///     ledger.open(JobId(7)),
///     JobKeys { kind: JobKind::Store, keys },
///     vec![false; 2], // every key failed until a part settles it
///     finisher,
/// );
/// let part = job.part(vec![0, 1]);
/// drop(job);
/// part.settle([(0, true)]); // key 1 keeps its initial outcome
/// assert_eq!((counters.stores.get(), counters.failures.get()), (1, 1));
/// ```
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct JobKeys {
    /// Store or promotion.
    pub kind: JobKind,
    /// The job's keys, in the order of its rows: a part's indices and its outcomes refer to them.
    pub keys: Vec<OffloadKey>,
}

/// Turns a split job's per-key outcomes into its one result: counters, events, and one of the
/// ticket's reports. Runs on whichever thread lets go of the job last, possibly while that
/// thread unwinds from a panic, so it must not panic itself.
pub trait JobFinisher<T, O>: Send + Sync {
    /// Reports the job `data` whose keys ended as `outcomes`.
    fn finish(&self, data: &T, outcomes: Vec<O>, ticket: Ticket);
}

impl<T, O, F> JobFinisher<T, O> for F
where
    F: Fn(&T, Vec<O>, Ticket) + Send + Sync,
{
    fn finish(&self, data: &T, outcomes: Vec<O>, ticket: Ticket) {
        self(data, outcomes, ticket);
    }
}

struct Progress<O> {
    outcomes: Vec<O>,
    /// Parts not settled yet, plus one while the `SplitJob` is alive.
    holds: usize,
    ticket: Option<Ticket>,
}

struct Shared<T, O> {
    data: T,
    progress: Mutex<Progress<O>>,
    finisher: Arc<dyn JobFinisher<T, O>>,
}

impl<T, O> Shared<T, O> {
    /// Drops one hold after applying `outcomes`; the last hold finishes the job.
    fn release(&self, outcomes: impl IntoIterator<Item = (usize, O)>) {
        let done = {
            let mut p = self.progress.lock();
            for (i, o) in outcomes {
                if let Some(slot) = p.outcomes.get_mut(i) {
                    *slot = o;
                }
            }
            p.holds -= 1;
            if p.holds == 0 {
                p.ticket.take().map(|t| (t, std::mem::take(&mut p.outcomes)))
            } else {
                None
            }
        };
        if let Some((ticket, outcomes)) = done {
            self.finisher.finish(&self.data, outcomes, ticket);
        }
    }
}

/// A job being cut into parts. Dropping it (after the last [`SplitJob::part`]) lets the job
/// finish once its parts are settled — at once when it has none.
pub struct SplitJob<T, O> {
    shared: Arc<Shared<T, O>>,
}

impl<T, O> SplitJob<T, O> {
    /// A job reported through `ticket`, whose keys start with `outcomes` (one per key), finished
    /// by `finisher`.
    #[must_use]
    pub fn new(ticket: Ticket, data: T, outcomes: Vec<O>, finisher: Arc<dyn JobFinisher<T, O>>) -> Self {
        Self {
            shared: Arc::new(Shared {
                data,
                progress: Mutex::new(Progress {
                    outcomes,
                    holds: 1,
                    ticket: Some(ticket),
                }),
                finisher,
            }),
        }
    }

    /// The tier's data about the job.
    #[must_use]
    pub fn data(&self) -> &T {
        &self.shared.data
    }

    /// A part carrying the keys at `indices`; the job waits for it.
    #[must_use = "a dropped part settles its keys at their initial outcome"]
    pub fn part(&self, indices: Vec<usize>) -> Part<T, O> {
        self.shared.progress.lock().holds += 1;
        Part {
            shared: Arc::clone(&self.shared),
            indices,
            settled: false,
        }
    }
}

impl<T, O> Drop for SplitJob<T, O> {
    fn drop(&mut self) {
        self.shared.release(std::iter::empty());
    }
}

/// One part of a [`SplitJob`]: settled once, by value.
pub struct Part<T, O> {
    shared: Arc<Shared<T, O>>,
    indices: Vec<usize>,
    settled: bool,
}

impl<T, O> Part<T, O> {
    /// The tier's data about the job this part belongs to.
    #[must_use]
    pub fn job(&self) -> &T {
        &self.shared.data
    }

    /// The job's key indices this part carries.
    #[must_use]
    pub fn indices(&self) -> &[usize] {
        &self.indices
    }

    /// Records how this part's keys ended, as `(index, outcome)` pairs; an index it does not
    /// name keeps its initial outcome.
    pub fn settle(mut self, outcomes: impl IntoIterator<Item = (usize, O)>) {
        self.settled = true;
        self.shared.release(outcomes);
    }
}

impl<T, O> Drop for Part<T, O> {
    fn drop(&mut self) {
        if !self.settled {
            self.shared.release(std::iter::empty());
        }
    }
}

#[cfg(test)]
mod tests {
    use tiering_core::{JobId, JobOutcome, OffloadKey};

    use super::*;
    use crate::JobLedger;

    fn keys(n: u64) -> Vec<OffloadKey> {
        (0..n).map(OffloadKey::from_u64).collect()
    }

    fn finisher() -> Arc<dyn JobFinisher<Vec<OffloadKey>, bool>> {
        Arc::new(|keys: &Vec<OffloadKey>, ok: Vec<bool>, ticket: Ticket| {
            ticket.complete_keys(keys, &ok, 0);
        })
    }

    fn results(ledger: &JobLedger) -> Vec<JobOutcome> {
        let mut out = Vec::new();
        ledger.take_finished(&mut out);
        out.into_iter().map(|r| r.outcome).collect()
    }

    #[test]
    fn the_last_part_reports_the_job_and_earlier_parts_do_not() {
        let ledger = JobLedger::default();
        let k = keys(4);
        let job = SplitJob::new(ledger.open(JobId(1)), k.clone(), vec![false; 4], finisher());
        let a = job.part(vec![0, 1]);
        let b = job.part(vec![2, 3]);
        drop(job);
        a.settle([(0, true), (1, true)]);
        assert!(results(&ledger).is_empty(), "one part is still running");
        b.settle([(2, true), (3, false)]);
        assert_eq!(results(&ledger), vec![JobOutcome::Partial(k[..3].to_vec())]);
        assert_eq!(ledger.open_jobs(), 0);
    }

    #[test]
    fn a_job_is_not_finished_while_it_is_still_being_cut() {
        let ledger = JobLedger::default();
        let job = SplitJob::new(ledger.open(JobId(1)), keys(2), vec![false; 2], finisher());
        job.part(vec![0]).settle([(0, true)]);
        assert!(results(&ledger).is_empty(), "the second part is not cut yet");
        let second = job.part(vec![1]);
        drop(job);
        second.settle([(1, true)]);
        assert_eq!(results(&ledger), vec![JobOutcome::Ok]);
    }

    #[test]
    fn a_job_without_parts_finishes_when_its_handle_goes() {
        let ledger = JobLedger::default();
        drop(SplitJob::new(
            ledger.open(JobId(3)),
            keys(1),
            vec![true],
            finisher(),
        ));
        assert_eq!(results(&ledger), vec![JobOutcome::Ok]);
    }

    #[test]
    fn a_finisher_over_job_keys_counts_and_reports_by_the_jobs_direction() {
        use crate::TierCounters;
        use tiering_core::JobKind;

        let counters = Arc::new(TierCounters::default());
        let c = Arc::clone(&counters);
        let finisher: Arc<dyn JobFinisher<JobKeys, bool>> =
            Arc::new(move |job: &JobKeys, ok: Vec<bool>, ticket: Ticket| {
                let moved = ok.iter().filter(|o| **o).count() as u64;
                c.count_job(job.kind, moved, job.keys.len() as u64 - moved, moved * 8);
                ticket.complete_keys(&job.keys, &ok, moved * 8);
            });
        let ledger = JobLedger::default();
        let k = keys(3);
        let load = JobKeys {
            kind: JobKind::Promotion,
            keys: k.clone(),
        };
        let job = SplitJob::new(ledger.open(JobId(1)), load, vec![false; 3], finisher);
        assert_eq!(job.data().kind, JobKind::Promotion);
        let part = job.part(vec![0, 2]);
        drop(job);
        assert_eq!(part.job().keys, k);
        part.settle([(0, true), (2, true)]);
        assert_eq!(results(&ledger), vec![JobOutcome::Partial(vec![k[0], k[2]])]);
        let s = counters.stats("t", []);
        assert_eq!((s.loads, s.bytes_read, s.failures, s.stores), (2, 16, 1, 0));
    }

    #[test]
    fn a_part_unwound_by_a_panic_fails_its_keys_only() {
        let ledger = JobLedger::default();
        let k = keys(2);
        let job = SplitJob::new(ledger.open(JobId(1)), k.clone(), vec![false; 2], finisher());
        let doomed = job.part(vec![0]);
        let fine = job.part(vec![1]);
        drop(job);
        let unwound = std::panic::catch_unwind(std::panic::AssertUnwindSafe(move || {
            let _held = doomed;
            panic!("injected");
        }));
        assert!(unwound.is_err());
        fine.settle([(1, true)]);
        assert_eq!(results(&ledger), vec![JobOutcome::Partial(vec![k[1]])]);
        assert_eq!(ledger.counters().snapshot().completed, 1, "one result, not two");
    }
}
