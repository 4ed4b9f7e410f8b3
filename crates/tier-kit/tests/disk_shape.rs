//! The disk tier's shape on the kit: loads before stores with a fairness bound, one scratch
//! buffer per thread, jobs cut into runs whose keys carry a tier-specific outcome, and a job
//! refused by a stopping tier — every job still reported once.

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};

use tier_kit::{
    JobFinisher, JobLedger, KitCounters, LaneSpec, Part, RefusalReason, SplitJob, Ticket, Weight, WorkQueue,
    Worker, WorkerPool,
};
use tiering_core::{JobId, JobOutcome, OffloadKey};

const LOADS: usize = 0;
const STORES: usize = 1;
const CHUNK: u64 = 64;

/// A key's outcome as a disk-like tier tracks it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum KeyState {
    Pending,
    Written,
    Deduplicated,
}

type Run = Part<Vec<OffloadKey>, KeyState>;

/// One thread's scratch space, built once per thread by the pool's factory.
struct IoThread {
    scratch: Vec<u8>,
    runs: Arc<AtomicUsize>,
}

impl Worker<Run> for IoThread {
    fn run(&mut self, run: Run) {
        self.scratch.fill(0);
        self.runs.fetch_add(1, Ordering::Relaxed);
        let outcomes: Vec<(usize, KeyState)> =
            run.indices().iter().map(|&i| (i, KeyState::Written)).collect();
        run.settle(outcomes);
    }
}

fn finisher() -> Arc<dyn JobFinisher<Vec<OffloadKey>, KeyState>> {
    Arc::new(|keys: &Vec<OffloadKey>, states: Vec<KeyState>, ticket: Ticket| {
        let ok: Vec<bool> = states.iter().map(|s| *s != KeyState::Pending).collect();
        let written = states.iter().filter(|s| **s == KeyState::Written).count() as u64;
        ticket.complete_keys(keys, &ok, written * CHUNK);
    })
}

#[test]
fn a_disk_shaped_tier_reports_every_job_once_including_refused_runs() {
    let counters = Arc::new(KitCounters::new());
    let ledger = JobLedger::new(Arc::clone(&counters));
    let queue = Arc::new(
        WorkQueue::builder()
            .lane(LaneSpec::unbounded())
            .lane(LaneSpec::unbounded().served_after(8))
            .weigh(|run: &Run| Weight::new(run.indices().len() as u64, run.indices().len() as u64 * CHUNK))
            .counters(Arc::clone(&counters))
            .build(),
    );
    let runs = Arc::new(AtomicUsize::new(0));
    let mut pool = WorkerPool::builder("disk-shape")
        .threads(2)
        .counters(Arc::clone(&counters))
        .start(Arc::clone(&queue), |_| {
            Ok(IoThread {
                scratch: vec![0; 4096],
                runs: Arc::clone(&runs),
            })
        })
        .unwrap();

    // Job 1: a store of four keys, the first already held, the rest in two runs.
    let keys: Vec<OffloadKey> = (0..4).map(OffloadKey::from_u64).collect();
    let mut states = vec![KeyState::Pending; 4];
    states[0] = KeyState::Deduplicated;
    let job = SplitJob::new(ledger.open(JobId(1)), keys, states, finisher());
    let parts = vec![job.part(vec![1, 2]), job.part(vec![3])];
    drop(job);
    queue.submit_all(STORES, parts).map_err(|_| "refused").unwrap();

    // Job 2: a load submitted once the tier is stopping: refused, handed back, dropped.
    queue.close();
    let late = SplitJob::new(
        ledger.open(JobId(2)),
        vec![OffloadKey::from_u64(9)],
        vec![KeyState::Pending],
        finisher(),
    );
    let refused = queue.submit(LOADS, late.part(vec![0])).unwrap_err();
    assert_eq!(refused.reason, RefusalReason::Closed);
    drop((late, refused));

    assert!(ledger.wait_idle(None));
    let mut out = Vec::new();
    ledger.take_finished(&mut out);
    out.sort_by_key(|r| r.id);
    assert_eq!(out.len(), 2, "{out:?}");
    assert_eq!(
        (out[0].id, &out[0].outcome, out[0].bytes),
        (JobId(1), &JobOutcome::Ok, 3 * CHUNK)
    );
    assert_eq!((out[1].id, &out[1].outcome), (JobId(2), &JobOutcome::Failed));
    assert_eq!(runs.load(Ordering::Relaxed), 2);
    // A run counts as running until its thread is back at the queue, which may be just after
    // its job was reported; once the threads are joined nothing runs.
    assert!(pool.stop_and_join(std::time::Duration::MAX).is_clean());
    assert_eq!(queue.depth(STORES).in_flight, Weight::default());
    let c = counters.snapshot();
    assert_eq!((c.submitted, c.completed, c.failed, c.panicked), (2, 2, 1, 0));
}
