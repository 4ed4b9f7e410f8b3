//! Named worker threads taking work from a [`WorkQueue`], each with its own state.
//!
//! Each thread owns one [`Worker`] built by a factory on the starting thread (so a failure to
//! build one — a buffer, a connection — is the start's error). A panic while a worker runs a
//! piece of work is caught: it is counted, the worker's [`Worker::after_panic`] resets what the
//! panic may have left half-done, and the thread goes on serving. Whatever the work carried is
//! dropped by the unwind — a [`crate::Ticket`] or [`crate::Part`] in it then reports its job
//! failed, which is what makes "exactly one result per job" hold under panics. The pool logs
//! each panic (an error naming the thread and the message). A closure `FnMut(W)` is a worker.
//!
//! [`WorkerPool::stop_and_join`] closes the queue, lets the threads finish what is queued, and
//! waits at most a timeout: threads still busy then are left behind and named in the
//! [`JoinReport`], never waited for without bound.

use std::panic::{AssertUnwindSafe, catch_unwind};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use parking_lot::{Condvar, Mutex};

use crate::counters::KitCounters;
use crate::queue::WorkQueue;

/// What one thread of a pool runs: its per-thread state and how it serves a piece of work.
pub trait Worker<W>: Send + 'static {
    /// Serves one piece of work.
    fn run(&mut self, work: W);

    /// Called after [`Worker::run`] panicked (with the panic's message), before the thread
    /// takes its next piece of work: drop state the panic may have left inconsistent (a
    /// connection in the middle of a reply) and log. By then the unwind has dropped the work,
    /// so its job may already be reported and drained: a tier that counts panicked jobs as
    /// failures reads [`crate::Counts::abandoned`], counted before the result is visible, rather
    /// than counting here.
    fn after_panic(&mut self, message: &str) {
        let _ = message;
    }
}

/// A closure is a worker whose state is what it captured (a tier's shared state, say) and that
/// needs no repair after a panic.
impl<W, F> Worker<W> for F
where
    F: FnMut(W) + Send + 'static,
{
    fn run(&mut self, work: W) {
        self(work);
    }
}

/// The threads that ended, per the exit signal each sends as its last act.
#[derive(Default)]
struct Exits {
    count: Mutex<usize>,
    cond: Condvar,
}

/// Signals a thread's end from its `Drop`, so a thread that dies any way still signals.
struct ExitSignal {
    exits: Arc<Exits>,
    flag: Arc<AtomicBool>,
}

impl Drop for ExitSignal {
    fn drop(&mut self) {
        self.flag.store(true, Ordering::Release);
        *self.exits.count.lock() += 1;
        self.exits.cond.notify_all();
    }
}

struct Thread {
    name: String,
    handle: JoinHandle<()>,
    exited: Arc<AtomicBool>,
}

/// How [`WorkerPool::stop_and_join`] went.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct JoinReport {
    /// Threads that ended and were joined.
    pub joined: usize,
    /// Of those, threads that ended by a panic outside the guarded work (in the kit or in a
    /// worker's `after_panic`).
    pub died: usize,
    /// Threads still running at the timeout, by name: left behind (detached).
    pub left_behind: Vec<String>,
}

impl JoinReport {
    /// Whether every thread ended normally in time.
    #[must_use]
    pub fn is_clean(&self) -> bool {
        self.died == 0 && self.left_behind.is_empty()
    }

    /// `Ok` when clean, else a tier's shutdown error saying what went wrong (`what` names the
    /// threads, e.g. "redis worker").
    ///
    /// # Errors
    /// `TierError::Other` with [`JoinReport::problem`]'s sentence.
    pub fn into_result(self, what: &str) -> Result<(), tiering_core::TierError> {
        self.problem(what)
            .map_or(Ok(()), |p| Err(tiering_core::TierError::Other(p)))
    }

    /// `None` when clean, else a sentence for a tier's shutdown error (`what` names the
    /// threads, e.g. "redis worker").
    #[must_use]
    pub fn problem(&self, what: &str) -> Option<String> {
        let mut parts = Vec::new();
        if self.died > 0 {
            parts.push(format!("{} {what} thread(s) panicked", self.died));
        }
        if !self.left_behind.is_empty() {
            parts.push(format!(
                "{} {what} thread(s) did not stop in time and were left running: {}",
                self.left_behind.len(),
                self.left_behind.join(", ")
            ));
        }
        (!parts.is_empty()).then(|| parts.join("; "))
    }
}

/// The text of a panic payload (a `&str` or `String` message, or a placeholder).
#[must_use]
pub fn panic_message(payload: &(dyn std::any::Any + Send)) -> &str {
    payload
        .downcast_ref::<&str>()
        .copied()
        .or_else(|| payload.downcast_ref::<String>().map(String::as_str))
        .unwrap_or("(not a string)")
}

/// Starts a [`WorkerPool`].
#[derive(Debug)]
pub struct PoolBuilder {
    name: String,
    threads: usize,
    counters: Arc<KitCounters>,
}

impl PoolBuilder {
    /// Threads to start (default 1; at least 1).
    #[must_use]
    pub fn threads(mut self, n: usize) -> Self {
        self.threads = n.max(1);
        self
    }

    /// Counts panics into `counters` (shared with the tier's ledger and queue).
    #[must_use]
    pub fn counters(mut self, counters: Arc<KitCounters>) -> Self {
        self.counters = counters;
        self
    }

    /// Starts the threads, named `<name>-<i>`, each with the worker `factory(i)` builds, taking
    /// from `queue`.
    ///
    /// # Errors
    /// A worker could not be built or a thread not started; the threads already started are
    /// stopped and joined first.
    pub fn start<W, K>(
        self,
        queue: Arc<WorkQueue<W>>,
        mut factory: impl FnMut(usize) -> std::io::Result<K>,
    ) -> std::io::Result<WorkerPool<W>>
    where
        W: Send + 'static,
        K: Worker<W>,
    {
        let mut pool = WorkerPool {
            queue,
            threads: Vec::with_capacity(self.threads),
            exits: Arc::default(),
        };
        for i in 0..self.threads {
            let started = factory(i).and_then(|worker| {
                let name = format!("{}-{i}", self.name);
                let exited = Arc::new(AtomicBool::new(false));
                let signal = ExitSignal {
                    exits: Arc::clone(&pool.exits),
                    flag: Arc::clone(&exited),
                };
                let queue = Arc::clone(&pool.queue);
                let counters = Arc::clone(&self.counters);
                let handle = std::thread::Builder::new()
                    .name(name.clone())
                    .spawn(move || serve(&queue, worker, &counters, signal))?;
                Ok(Thread { name, handle, exited })
            });
            match started {
                Ok(t) => pool.threads.push(t),
                Err(e) => {
                    pool.stop_and_join(Duration::MAX);
                    return Err(e);
                }
            }
        }
        Ok(pool)
    }
}

fn serve<W, K: Worker<W>>(queue: &WorkQueue<W>, mut worker: K, counters: &KitCounters, signal: ExitSignal) {
    let _signal = signal;
    while let Some(taken) = queue.take() {
        let work = taken.work;
        // Sound to assert: the worker is this thread's own, and `after_panic` is exactly the
        // chance to repair whatever the unwind left half-done in it before its next use.
        if let Err(panic) = catch_unwind(AssertUnwindSafe(|| worker.run(work))) {
            counters.panicked();
            let message = panic_message(&*panic);
            tracing::error!(
                thread = std::thread::current().name().unwrap_or("?"),
                panic = message,
                "a tier worker panicked: its work was dropped (its jobs reported failed), the thread serves on"
            );
            worker.after_panic(message);
        }
        queue.done(taken.lane, taken.weight);
    }
}

/// A tier's worker threads. See the module documentation.
pub struct WorkerPool<W> {
    queue: Arc<WorkQueue<W>>,
    threads: Vec<Thread>,
    exits: Arc<Exits>,
}

impl<W> std::fmt::Debug for WorkerPool<W> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("WorkerPool")
            .field(
                "threads",
                &self.threads.iter().map(|t| &t.name).collect::<Vec<_>>(),
            )
            .finish_non_exhaustive()
    }
}

impl WorkerPool<()> {
    /// A builder for threads named `<name>-<i>`.
    #[must_use]
    pub fn builder(name: impl Into<String>) -> PoolBuilder {
        PoolBuilder {
            name: name.into(),
            threads: 1,
            counters: Arc::default(),
        }
    }
}

impl<W> WorkerPool<W> {
    /// The queue the threads take from.
    #[must_use]
    pub fn queue(&self) -> &Arc<WorkQueue<W>> {
        &self.queue
    }

    /// Threads started and not yet stopped.
    #[must_use]
    pub fn threads(&self) -> usize {
        self.threads.len()
    }

    /// Closes the queue, lets the threads finish what is queued, and joins those that end
    /// within `timeout`; the others are left behind (detached) and named in the report. A
    /// second call finds no threads.
    pub fn stop_and_join(&mut self, timeout: Duration) -> JoinReport {
        self.queue.close();
        let deadline = Instant::now().checked_add(timeout);
        let total = self.threads.len();
        {
            let mut ended = self.exits.count.lock();
            while *ended < total {
                match deadline {
                    Some(d) => {
                        if self.exits.cond.wait_until(&mut ended, d).timed_out() {
                            break;
                        }
                    }
                    None => self.exits.cond.wait(&mut ended),
                }
            }
        }
        let mut report = JoinReport::default();
        for t in self.threads.drain(..) {
            if t.exited.load(Ordering::Acquire) {
                // The thread has sent its exit signal, its last act: the join returns at once.
                report.joined += 1;
                if t.handle.join().is_err() {
                    report.died += 1;
                }
            } else {
                report.left_behind.push(t.name);
            }
        }
        report
    }
}

#[cfg(test)]
mod tests {
    use std::sync::mpsc;

    use tiering_core::{JobId, JobOutcome};

    use super::*;
    use crate::{JobLedger, LaneSpec, Ticket};

    /// Runs jobs: reports them ok, or panics when asked to.
    struct Runner {
        recovered: mpsc::Sender<String>,
    }

    impl Worker<(Ticket, bool)> for Runner {
        fn run(&mut self, (ticket, panics): (Ticket, bool)) {
            assert!(!panics, "injected worker panic");
            ticket.complete(JobOutcome::Ok, 1);
        }

        fn after_panic(&mut self, message: &str) {
            self.recovered.send(message.to_owned()).unwrap();
        }
    }

    #[test]
    fn a_panicking_job_is_reported_failed_once_and_the_thread_keeps_serving() {
        let counters = Arc::new(KitCounters::new());
        let ledger = JobLedger::new(Arc::clone(&counters));
        let queue = Arc::new(WorkQueue::builder().lane(LaneSpec::unbounded()).build());
        let (tx, rx) = mpsc::channel();
        let mut pool = WorkerPool::builder("kit-test")
            .counters(Arc::clone(&counters))
            .start(Arc::clone(&queue), |_| {
                Ok(Runner {
                    recovered: tx.clone(),
                })
            })
            .unwrap();
        queue.submit(0, (ledger.open(JobId(1)), true)).unwrap();
        queue.submit(0, (ledger.open(JobId(2)), false)).unwrap();
        assert!(ledger.wait_idle(None));
        let mut out = Vec::new();
        ledger.take_finished(&mut out);
        out.sort_by_key(|r| r.id);
        let outcomes: Vec<_> = out.iter().map(|r| (r.id, r.outcome.clone())).collect();
        assert_eq!(
            outcomes,
            vec![(JobId(1), JobOutcome::Failed), (JobId(2), JobOutcome::Ok)]
        );
        assert_eq!(rx.recv().unwrap(), "injected worker panic");
        let c = counters.snapshot();
        assert_eq!((c.panicked, c.abandoned, c.completed), (1, 1, 2));
        let report = pool.stop_and_join(Duration::MAX);
        assert_eq!(
            report,
            JoinReport {
                joined: 1,
                died: 0,
                left_behind: vec![]
            }
        );
        assert!(report.is_clean() && report.problem("test").is_none());
        assert!(report.into_result("test").is_ok());
    }

    /// Blocks in `run` until released.
    struct Stuck {
        release: Arc<(Mutex<bool>, Condvar)>,
        started: mpsc::Sender<()>,
    }

    impl Worker<()> for Stuck {
        fn run(&mut self, (): ()) {
            self.started.send(()).unwrap();
            let (lock, cond) = &*self.release;
            let mut released = lock.lock();
            while !*released {
                cond.wait(&mut released);
            }
        }
    }

    #[test]
    fn a_stuck_thread_is_left_behind_and_named_instead_of_waited_for() {
        let release = Arc::new((Mutex::new(false), Condvar::new()));
        let (tx, rx) = mpsc::channel();
        let queue = Arc::new(WorkQueue::builder().build());
        let mut pool = WorkerPool::builder("kit-stuck")
            .threads(2)
            .start(Arc::clone(&queue), |_| {
                Ok(Stuck {
                    release: Arc::clone(&release),
                    started: tx.clone(),
                })
            })
            .unwrap();
        queue.submit(0, ()).unwrap();
        rx.recv().unwrap();
        let report = pool.stop_and_join(Duration::ZERO);
        assert_eq!(report.joined + report.left_behind.len(), 2);
        assert!(
            report.left_behind.iter().any(|n| n.starts_with("kit-stuck-")),
            "{report:?}"
        );
        let problem = report.problem("test").unwrap();
        assert!(problem.contains("left running: kit-stuck-"), "{problem}");
        let err = report.into_result("test").unwrap_err();
        assert!(err.to_string().contains(&problem), "{err}");
        assert_eq!(pool.threads(), 0);
        *release.0.lock() = true;
        release.1.notify_all();
    }

    #[test]
    fn a_worker_that_cannot_be_built_fails_the_start() {
        let queue = Arc::new(WorkQueue::<()>::builder().build());
        let err = WorkerPool::builder("kit-fail")
            .threads(3)
            .start(Arc::clone(&queue), |i| {
                if i == 2 {
                    Err(std::io::Error::other("no buffer"))
                } else {
                    Ok(Stuck {
                        release: Arc::default(),
                        started: mpsc::channel().0,
                    })
                }
            })
            .unwrap_err();
        assert_eq!(err.to_string(), "no buffer");
        assert!(queue.is_closed(), "the threads already started were stopped");
    }
}
