//! Exactly one [`JobResult`] per submitted job.
//!
//! [`JobLedger::open`] hands out a [`Ticket`] per job. Reporting the job consumes the ticket, so
//! a second report does not compile; a ticket dropped without a report (its worker panicked and
//! the unwind dropped it, or the tier lost the job) reports the job failed from its `Drop`. The
//! ledger keeps the results for `poll_finished`, counts the jobs still open for
//! `has_pending_work` and `drain_jobs`, and signals the tier's [`ControlWaker`] on each result.

use std::sync::Arc;
use std::time::{Duration, Instant};

use parking_lot::{Condvar, Mutex};
use tiering_core::{ControlWaker, JobId, JobOutcome, JobResult, OffloadKey};

use crate::counters::KitCounters;

#[derive(Default)]
struct Finished {
    results: Vec<JobResult>,
    open: usize,
}

struct LedgerInner {
    finished: Mutex<Finished>,
    idle: Condvar,
    waker: Mutex<Option<ControlWaker>>,
    counters: Arc<KitCounters>,
}

impl LedgerInner {
    fn post(&self, result: JobResult) {
        self.counters.completed(result.outcome == JobOutcome::Failed);
        let idle = {
            let mut f = self.finished.lock();
            f.results.push(result);
            f.open = f.open.saturating_sub(1);
            f.open == 0
        };
        if idle {
            self.idle.notify_all();
        }
        self.wake();
    }

    fn wake(&self) {
        if let Some(w) = self.waker.lock().as_ref() {
            w.wake();
        }
    }
}

/// The finished results of a tier's jobs and the count of jobs still open. Cheap to clone:
/// clones share one ledger.
#[derive(Clone)]
pub struct JobLedger {
    inner: Arc<LedgerInner>,
}

impl std::fmt::Debug for JobLedger {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let fin = self.inner.finished.lock();
        f.debug_struct("JobLedger")
            .field("open", &fin.open)
            .field("finished", &fin.results.len())
            .finish_non_exhaustive()
    }
}

impl Default for JobLedger {
    fn default() -> Self {
        Self::new(Arc::default())
    }
}

impl JobLedger {
    /// An empty ledger counting into `counters`.
    #[must_use]
    pub fn new(counters: Arc<KitCounters>) -> Self {
        Self {
            inner: Arc::new(LedgerInner {
                finished: Mutex::new(Finished::default()),
                idle: Condvar::new(),
                waker: Mutex::new(None),
                counters,
            }),
        }
    }

    /// The waker to signal when a result is queued (the tier's `set_waker` passes it on).
    pub fn set_waker(&self, waker: ControlWaker) {
        *self.inner.waker.lock() = Some(waker);
    }

    /// Signals the waker, if one was set: for a tier's other reasons to be swept (a peer
    /// asked, a server came back).
    pub fn wake(&self) {
        self.inner.wake();
    }

    /// Opens job `id`: it counts as open until its ticket reports it (or is dropped).
    #[must_use = "dropping the ticket reports the job failed at once"]
    pub fn open(&self, id: JobId) -> Ticket {
        self.inner.counters.submitted();
        self.inner.finished.lock().open += 1;
        Ticket {
            id,
            opened: Instant::now(),
            ledger: Some(Arc::clone(&self.inner)),
        }
    }

    /// Moves every queued result to `out` (`SecondaryTier::poll_finished`).
    pub fn take_finished(&self, out: &mut Vec<JobResult>) {
        out.append(&mut self.inner.finished.lock().results);
    }

    /// Jobs opened and not reported yet.
    #[must_use]
    pub fn open_jobs(&self) -> usize {
        self.inner.finished.lock().open
    }

    /// Whether a job is open or a result waits for `poll_finished`
    /// (`SecondaryTier::has_pending_work`).
    #[must_use]
    pub fn has_pending(&self) -> bool {
        let f = self.inner.finished.lock();
        f.open > 0 || !f.results.is_empty()
    }

    /// Blocks until no job is open or, with a deadline, until it passes; returns whether no job
    /// is open. `drain_jobs` cancels what it can first, then waits here.
    pub fn wait_idle(&self, deadline: Option<Instant>) -> bool {
        let mut f = self.inner.finished.lock();
        while f.open > 0 {
            match deadline {
                None => self.inner.idle.wait(&mut f),
                Some(d) => {
                    if self.inner.idle.wait_until(&mut f, d).timed_out() {
                        return f.open == 0;
                    }
                }
            }
        }
        true
    }

    /// The counters this ledger counts into.
    #[must_use]
    pub fn counters(&self) -> &Arc<KitCounters> {
        &self.inner.counters
    }
}

/// The obligation to report one job. Consumed by [`Ticket::complete`], [`Ticket::complete_keys`]
/// or [`Ticket::fail`]; dropped unreported, it reports the job failed.
pub struct Ticket {
    id: JobId,
    opened: Instant,
    /// `None` once reported.
    ledger: Option<Arc<LedgerInner>>,
}

impl std::fmt::Debug for Ticket {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Ticket")
            .field("id", &self.id)
            .finish_non_exhaustive()
    }
}

impl Ticket {
    /// The job's id.
    #[must_use]
    pub fn id(&self) -> JobId {
        self.id
    }

    /// Time since the job was opened (a result's `elapsed`).
    #[must_use]
    pub fn elapsed(&self) -> Duration {
        self.opened.elapsed()
    }

    /// Reports the job with `outcome`, having moved `bytes`.
    pub fn complete(mut self, outcome: JobOutcome, bytes: u64) {
        let result = JobResult {
            id: self.id,
            outcome,
            bytes,
            elapsed: self.elapsed(),
        };
        if let Some(ledger) = self.ledger.take() {
            ledger.post(result);
        }
    }

    /// Reports the job from per-key success flags parallel to `keys` (`Ok`, `Partial` or
    /// `Failed`, as `JobResult::from_key_outcomes`).
    pub fn complete_keys(self, keys: &[OffloadKey], succeeded: &[bool], bytes: u64) {
        let outcome = JobResult::from_key_outcomes(self.id, keys, succeeded, bytes, Duration::ZERO).outcome;
        self.complete(outcome, bytes);
    }

    /// Reports the job failed.
    pub fn fail(self) {
        self.complete(JobOutcome::Failed, 0);
    }
}

impl Drop for Ticket {
    fn drop(&mut self) {
        if let Some(ledger) = self.ledger.take() {
            ledger.counters.abandoned();
            ledger.post(JobResult::failed(self.id, self.opened.elapsed()));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_ticket_reports_once_and_a_dropped_one_reports_failure() {
        let ledger = JobLedger::default();
        let waker = ControlWaker::new();
        ledger.set_waker(waker.clone());
        let a = ledger.open(JobId(1));
        let b = ledger.open(JobId(2));
        assert_eq!(ledger.open_jobs(), 2);
        assert!(ledger.has_pending());
        a.complete(JobOutcome::Ok, 64);
        assert!(waker.wait(Duration::ZERO), "a result wakes the control plane");
        drop(b);
        assert!(ledger.wait_idle(None));
        let mut out = Vec::new();
        ledger.take_finished(&mut out);
        assert_eq!(out.len(), 2);
        assert_eq!(
            (out[0].id, &out[0].outcome, out[0].bytes),
            (JobId(1), &JobOutcome::Ok, 64)
        );
        assert_eq!((out[1].id, &out[1].outcome), (JobId(2), &JobOutcome::Failed));
        assert!(!ledger.has_pending());
        let c = ledger.counters().snapshot();
        assert_eq!((c.submitted, c.completed, c.failed, c.abandoned), (2, 2, 1, 1));
    }

    #[test]
    fn per_key_flags_give_partial_results() {
        let ledger = JobLedger::default();
        let keys = [OffloadKey::from_u64(1), OffloadKey::from_u64(2)];
        ledger.open(JobId(7)).complete_keys(&keys, &[false, true], 10);
        let mut out = Vec::new();
        ledger.take_finished(&mut out);
        assert_eq!(out[0].outcome, JobOutcome::Partial(vec![keys[1]]));
        assert_eq!(out[0].bytes, 10);
    }

    #[test]
    fn waiting_with_a_deadline_gives_up_while_a_job_is_open() {
        let ledger = JobLedger::default();
        let ticket = ledger.open(JobId(1));
        assert!(!ledger.wait_idle(Some(Instant::now())));
        let other = ledger.clone();
        let waiter = std::thread::spawn(move || other.wait_idle(None));
        ticket.fail();
        assert!(waiter.join().unwrap());
    }
}
