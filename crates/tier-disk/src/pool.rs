//! The bounded pool of I/O threads and its FIFO task queue.

use std::collections::VecDeque;
use std::sync::Arc;
use std::thread::JoinHandle;

use parking_lot::{Condvar, Mutex};

use crate::exec::{self, Scratch};
use crate::shared::{Shared, Task};

#[derive(Default)]
struct QueueState {
    tasks: VecDeque<Task>,
    stop: bool,
}

#[derive(Default)]
struct Queue {
    state: Mutex<QueueState>,
    cond: Condvar,
}

/// `io_threads` threads taking tasks from one queue.
pub(crate) struct Pool {
    queue: Arc<Queue>,
    threads: Vec<JoinHandle<()>>,
}

impl Pool {
    /// Starts `n` threads named `kvtier-disk-io-<i>`.
    pub(crate) fn start(shared: &Arc<Shared>, n: usize) -> std::io::Result<Self> {
        let queue = Arc::new(Queue::default());
        let mut pool = Self {
            queue,
            threads: Vec::with_capacity(n),
        };
        for i in 0..n {
            let scratch = Scratch::new(shared.slab.layout())?;
            let shared = Arc::clone(shared);
            let queue = Arc::clone(&pool.queue);
            let spawned = std::thread::Builder::new()
                .name(format!("kvtier-disk-io-{i}"))
                .spawn(move || worker(&shared, &queue, scratch));
            match spawned {
                Ok(handle) => pool.threads.push(handle),
                Err(e) => {
                    pool.stop_and_join();
                    return Err(e);
                }
            }
        }
        Ok(pool)
    }

    /// Queues tasks (FIFO).
    pub(crate) fn push(&self, tasks: impl IntoIterator<Item = Task>) {
        let mut q = self.queue.state.lock();
        let before = q.tasks.len();
        q.tasks.extend(tasks);
        let added = q.tasks.len() - before;
        drop(q);
        if added == 1 {
            self.queue.cond.notify_one();
        } else if added > 1 {
            self.queue.cond.notify_all();
        }
    }

    /// Removes every task not yet started.
    pub(crate) fn take_queued(&self) -> Vec<Task> {
        self.queue.state.lock().tasks.drain(..).collect()
    }

    /// Tasks waiting for a thread.
    pub(crate) fn queued(&self) -> usize {
        self.queue.state.lock().tasks.len()
    }

    /// Stops the threads once the queue is empty and joins them; returns how many panicked.
    pub(crate) fn stop_and_join(&mut self) -> usize {
        self.queue.state.lock().stop = true;
        self.queue.cond.notify_all();
        self.threads
            .drain(..)
            .map(JoinHandle::join)
            .filter(Result::is_err)
            .count()
    }
}

fn worker(shared: &Shared, queue: &Queue, mut scratch: Scratch) {
    loop {
        let task = {
            let mut q = queue.state.lock();
            loop {
                if let Some(t) = q.tasks.pop_front() {
                    break t;
                }
                if q.stop {
                    return;
                }
                queue.cond.wait(&mut q);
            }
        };
        exec::run(shared, &mut scratch, task);
    }
}
