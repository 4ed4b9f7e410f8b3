//! # tier-kit — the plumbing of a threaded tier
//!
//! A secondary tier's manager-facing methods must return at once, so its copies run on threads
//! of its own; and the manager trusts it to report every submitted job exactly once
//! (`SecondaryTier::poll_finished`), to say whether work is in flight (`has_pending_work`), to
//! wait for it (`drain_jobs`) and to stop its threads (`shutdown`, `Drop`). That plumbing is the
//! same in every tier; this crate is it, so a tier author writes only what is particular to the
//! storage. `tier-disk`, `tier-redis` and `examples/tier-example` are built on it. The contracts themselves
//! are `tiering_core::SecondaryTier`'s doc comments and `docs/tier-author-guide.md`.
//!
//! ## The pieces
//!
//! - [`JobLedger`] — one per tier. [`JobLedger::open`] gives a [`Ticket`] per submitted job;
//!   reporting consumes it ([`Ticket::complete`], [`Ticket::complete_keys`], [`Ticket::fail`]),
//!   so a job cannot be reported twice, and a ticket dropped unreported (a panic unwound through
//!   it) reports the job failed. The ledger keeps the results for `poll_finished`
//!   ([`JobLedger::take_finished`]), answers `has_pending_work` ([`JobLedger::has_pending`]),
//!   waits for `drain_jobs` ([`JobLedger::wait_idle`], with an optional deadline) and signals
//!   the manager's `ControlWaker` on each result ([`JobLedger::set_waker`]).
//! - [`SplitJob`] and [`Part`] — a job cut into parts that run on several workers (pipelined
//!   batches, runs of slots) and still report once: each part is settled once, by value, with
//!   the outcomes of its keys; the last one to go hands every outcome to the tier's
//!   [`JobFinisher`], which counts, emits events and reports the ticket. A part dropped
//!   unsettled leaves its keys at their initial outcome: start keys at their failure value.
//!   [`JobKeys`] (the job's direction and keys) is what a split job carries for a finisher
//!   that needs nothing more.
//! - [`WorkQueue`] — priority lanes (loads before stores, say), each optionally bounded in
//!   entries and bytes ([`LaneSpec`]) and optionally served after `n` entries of higher lanes
//!   passed it ([`LaneSpec::served_after`]: the fairness bound that keeps stores moving under
//!   a stream of loads). [`WorkQueue::submit`] / [`WorkQueue::submit_all`] refuse what does not
//!   fit and hand it back ([`Refused`]); [`WorkQueue::drain_lane`] takes back what is queued
//!   (a drain cancels it); [`WorkQueue::depth`] gives queued and running entries, items and
//!   bytes per lane, for stats and cost models. [`LaneSpec::flag`] is a lane of one entry for
//!   "do this once soon" work (a probe, a refresh).
//! - [`WorkerPool`] — `n` named threads, each owning the [`Worker`] a factory built for it (a
//!   connection, scratch buffers), taking from the queue. A panic in [`Worker::run`] is caught
//!   and counted; [`Worker::after_panic`] resets the thread's state and the thread serves on,
//!   while whatever the work carried is dropped — its ticket or part reports failure.
//!   [`WorkerPool::stop_and_join`] closes the queue, lets queued work finish and waits at most
//!   a timeout, naming the threads it had to leave behind ([`JoinReport`]).
//! - [`KitCounters`] — jobs submitted, completed, failed and abandoned, worker panics and
//!   rejected submissions, shared by the three (each builder takes it) and read with
//!   [`KitCounters::snapshot`] for `stats`. [`TierCounters`] are the counters every tier's
//!   `TierStats` carries (hits, misses, stores, loads, evictions, failures, bytes), each a
//!   lock-free [`Counter`]; [`TierCounters::count_job`] counts a finished job by its
//!   direction (what a finisher does before it reports), and [`TierCounters::stats`] fills a
//!   `TierStats` with them and the tier's extras.
//! - [`accept_store`] / [`accept_load`] — the checks of a submitted job (the tier's own
//!   refusal, `TransferJob::defect`, grants of the right direction), giving the job's keys and
//!   typed rows ([`Accepted`]) or what reporting it failed needs ([`Rejected`]).
//! - [`RateLimitedLog`] — at most one warning per kind per period, counting what it held back,
//!   so a failing device or server does not log a line per chunk.
//!
//! ## A tier on the kit
//!
//! ```ignore
//! struct MyTier { ledger: JobLedger, pool: WorkerPool<Job>, counters: Arc<KitCounters> }
//!
//! // build: one ledger, one queue, one pool, sharing the counters
//! let counters = Arc::new(KitCounters::new());
//! let ledger = JobLedger::new(Arc::clone(&counters));
//! let queue = Arc::new(WorkQueue::builder()
//!     .lane(LaneSpec::unbounded())                                   // LOADS
//!     .lane(LaneSpec::unbounded().max_entries(1024).served_after(8)) // STORES
//!     .counters(Arc::clone(&counters))
//!     .build());
//! let pool = WorkerPool::builder("my-tier")
//!     .threads(4)
//!     .counters(Arc::clone(&counters))
//!     .start(Arc::clone(&queue), |_| Ok(MyWorker::new(&storage)))?;
//!
//! // submit_store / submit_load: checked, then the job travels with its ticket
//! let job = match accept_store(job, self.chunk_bytes, None) {
//!     Ok(job) => job,
//!     Err(rejected) => return self.ledger.open(rejected.id).fail(),
//! };
//! let ticket = self.ledger.open(job.id);
//! if let Err(refused) = self.pool.queue().submit(STORES, Job { job, ticket }) {
//!     drop(refused.work); // its ticket reports the job failed
//! }
//!
//! // the worker: copy, then report (a panic here reports the job failed)
//! impl Worker<Job> for MyWorker {
//!     fn run(&mut self, Job { job, ticket }: Job) {
//!         let (ok, bytes) = self.copy(&job.keys, &job.rows);
//!         ticket.complete_keys(&job.keys, &ok, bytes);
//!     }
//! }
//!
//! fn set_waker(&mut self, w: ControlWaker) { self.ledger.set_waker(w) }
//! fn poll_finished(&mut self, out: &mut Vec<JobResult>) { self.ledger.take_finished(out) }
//! fn has_pending_work(&self) -> bool { self.ledger.has_pending() }
//! fn drain_jobs(&mut self) {
//!     drop(self.pool.queue().drain_lane(STORES)); // their tickets report them failed
//!     self.ledger.wait_idle(None);
//! }
//! fn shutdown(&mut self) -> Result<(), TierError> {
//!     self.drain_jobs();
//!     self.pool.stop_and_join(Duration::from_secs(10)).into_result("my-tier worker")
//! }
//! ```
//!
//! Two things to know. A result is visible (and `drain_jobs` may return) as soon as the ticket
//! reports, so count what a job did before reporting it; for a panicked job that is the ledger's
//! [`Counts::abandoned`], counted before its failure is posted. And a queued piece of work that
//! holds the tier's shared state (a finisher, a guard) keeps it alive until it runs or is
//! drained: drain before dropping the tier, as `shutdown` does.
//!
//! Why results must be exact: the manager keeps each job's arena rows pinned (and, for a
//! promotion, a primary row reserved) until the job's result arrives, so a lost result leaks
//! rows and a duplicate one releases rows twice. Why the shutdown is bounded: a tier's
//! `shutdown` runs under the manager's `tier_timeout`, and a thread stuck in a device or network
//! call must not hang the process that is stopping (`docs/ARCHITECTURE.md`, "The control-plane
//! thread").

mod accept;
mod counters;
mod ledger;
mod pool;
mod queue;
mod ratelog;
mod split;

pub use accept::{Accepted, Rejected, accept_load, accept_store};
pub use counters::{Counter, Counts, KitCounters, TierCounters};
pub use ledger::{JobLedger, Ticket};
pub use pool::{JoinReport, PoolBuilder, Worker, WorkerPool, panic_message};
pub use queue::{LaneDepth, LaneSpec, QueueBuilder, RefusalReason, Refused, WakePolicy, Weight, WorkQueue};
pub use ratelog::RateLimitedLog;
pub use split::{JobFinisher, JobKeys, Part, SplitJob};
