//! The worker threads: each owns one connection, takes work from the shared queue by
//! priority, and runs it as pipelined round trips. A connection error drops the connection;
//! the next batch reconnects once the shared backoff allows it, and until then batches fail at
//! once instead of waiting on a dead server.

use std::panic::{AssertUnwindSafe, catch_unwind};
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::thread::JoinHandle;
use std::time::Instant;

use redis::{RedisError, Value};
use tiering_core::{OffloadKey, RowRead, RowWrite};

use crate::conn::Conn;
use crate::format::{ValueArg, ValueDefect};
use crate::info;
use crate::shared::{Batch, Counters, JobState, Shared, Work};

/// The worker threads.
pub(crate) struct Workers {
    threads: Vec<JoinHandle<()>>,
}

impl Workers {
    /// Starts `n` workers named `kvtier-redis-<i>`.
    pub(crate) fn start(shared: &Arc<Shared>, n: usize) -> std::io::Result<Self> {
        let mut workers = Self {
            threads: Vec::with_capacity(n),
        };
        for i in 0..n {
            let s = Arc::clone(shared);
            let spawned = std::thread::Builder::new()
                .name(format!("kvtier-redis-{i}"))
                .spawn(move || {
                    Worker {
                        shared: s,
                        conn: None,
                    }
                    .run();
                });
            match spawned {
                Ok(h) => workers.threads.push(h),
                Err(e) => {
                    workers.stop_and_join(shared);
                    return Err(e);
                }
            }
        }
        Ok(workers)
    }

    /// Stops the workers once the queue is empty and joins them; returns how many panicked.
    pub(crate) fn stop_and_join(&mut self, shared: &Shared) -> usize {
        shared.queue.lock().stop = true;
        shared.queue_cond.notify_all();
        self.threads
            .drain(..)
            .map(JoinHandle::join)
            .filter(Result::is_err)
            .count()
    }
}

/// Whether `e` means the connection is unusable (rather than one command failing).
fn breaks_connection(e: &RedisError) -> bool {
    e.is_io_error()
        || e.is_timeout()
        || e.is_connection_dropped()
        || e.is_connection_refusal()
        || e.is_unrecoverable_error()
}

struct Worker {
    shared: Arc<Shared>,
    conn: Option<Conn>,
}

impl Worker {
    fn run(mut self) {
        loop {
            let work = {
                let mut q = self.shared.queue.lock();
                loop {
                    if let Some(w) = q.pop() {
                        break w;
                    }
                    if q.stop {
                        return;
                    }
                    self.shared.queue_cond.wait(&mut q);
                }
            };
            match work {
                Work::Lookup(keys) => {
                    let replies = catch_unwind(AssertUnwindSafe(|| self.exists(&keys)))
                        .unwrap_or_else(|_| self.panicked());
                    self.answer(&keys, replies.as_deref());
                }
                Work::Transfer(batch) => {
                    let job = Arc::clone(batch.job());
                    let idx = batch.indices();
                    // A panic in the client must not lose a job: its batch is settled failed.
                    let outcomes = catch_unwind(AssertUnwindSafe(|| match batch {
                        Batch::Store(_, items) => self.store(&job, items),
                        Batch::Load(_, items) => self.load(&job, items),
                    }))
                    .unwrap_or_else(|_| {
                        self.panicked::<()>();
                        idx.into_iter().map(|i| (i, false)).collect()
                    });
                    self.shared.settle(&job, &outcomes);
                }
                Work::Info => {
                    if catch_unwind(AssertUnwindSafe(|| self.refresh_info())).is_err() {
                        self.panicked::<()>();
                    }
                }
            }
        }
    }

    fn panicked<T>(&mut self) -> Option<T> {
        self.conn = None;
        self.shared.log.warn(
            &self.shared.name,
            "panic",
            "redis tier: a worker recovered from a panic in the client",
        );
        None
    }

    /// The connection, opened if needed; `None` while backing off or when connecting fails.
    fn conn(&mut self) -> Option<&mut Conn> {
        if self.conn.is_none() {
            if self.shared.backing_off() {
                return None;
            }
            match self.shared.endpoint.connect() {
                Ok(c) => {
                    Counters::add(&self.shared.counters.connects, 1);
                    self.conn = Some(c);
                }
                Err(e) => {
                    self.shared.connection_failed("connecting", &e);
                    return None;
                }
            }
        }
        self.conn.as_mut()
    }

    /// Runs `cmds` as one pipeline; `None` on a failure (the connection is dropped when the
    /// failure was the connection's).
    fn pipeline(&mut self, what: &str, cmds: Vec<redis::Cmd>) -> Option<Vec<Value>> {
        let conn = self.conn()?;
        match conn.pipeline(cmds) {
            Ok(values) => {
                self.shared.connection_ok();
                Some(values)
            }
            Err(e) => {
                if breaks_connection(&e) {
                    self.conn = None;
                    self.shared.connection_failed(what, &e);
                } else {
                    Counters::add(&self.shared.counters.server_errors, 1);
                    self.shared.log.warn(
                        &self.shared.name,
                        "server",
                        format_args!("redis tier: {what} failed: {e}"),
                    );
                }
                None
            }
        }
    }

    /// One pipelined `EXISTS` per key.
    fn exists(&mut self, keys: &[OffloadKey]) -> Option<Vec<Value>> {
        let cmds = keys
            .iter()
            .map(|k| {
                let mut c = redis::cmd("EXISTS");
                c.arg(self.shared.scheme.name(k));
                c
            })
            .collect();
        self.pipeline("EXISTS", cmds)
    }

    /// Records the answers (no reply: the keys count as absent until the answer goes stale).
    fn answer(&self, keys: &[OffloadKey], replies: Option<&[Value]>) {
        let now = Instant::now();
        {
            let mut p = self.shared.presence.lock();
            for (i, k) in keys.iter().enumerate() {
                let present = matches!(replies.and_then(|r| r.get(i)), Some(Value::Int(n)) if *n > 0);
                p.set(*k, present, now);
            }
        }
        self.shared.lookups_running.fetch_sub(1, Ordering::AcqRel);
        self.shared.wake();
    }

    fn store(&mut self, job: &JobState, items: Vec<(usize, RowRead)>) -> Vec<(usize, bool)> {
        let shared = Arc::clone(&self.shared);
        let scheme = &shared.scheme;
        let cmds = items
            .iter()
            .map(|(i, row)| {
                let key = &job.keys[*i];
                let mut c = redis::cmd("SET");
                c.arg(scheme.name(key)).arg(ValueArg::new(scheme, key, row));
                c
            })
            .collect();
        let indices: Vec<usize> = items.iter().map(|(i, _)| *i).collect();
        // The rows are copied into the commands: release them before the round trip.
        drop(items);
        let replies = self.pipeline("SET", cmds);
        let now = Instant::now();
        let mut out = Vec::with_capacity(indices.len());
        let mut refused = None;
        {
            let mut p = self.shared.presence.lock();
            for (n, i) in indices.into_iter().enumerate() {
                let reply = replies.as_ref().and_then(|r| r.get(n));
                let ok = matches!(reply, Some(Value::Okay));
                if ok {
                    p.set(job.keys[i], true, now);
                } else if let Some(Value::ServerError(e)) = reply {
                    refused = Some(format!("{e:?}"));
                }
                out.push((i, ok));
            }
        }
        if let Some(e) = refused {
            Counters::add(&self.shared.counters.server_errors, 1);
            self.shared.log.warn(
                &self.shared.name,
                "store",
                format_args!(
                    "redis tier: the server refused SET ({e}); with maxmemory, use allkeys-lru or allkeys-lfu, not noeviction"
                ),
            );
        }
        out
    }

    fn load(&mut self, job: &JobState, mut items: Vec<(usize, RowWrite)>) -> Vec<(usize, bool)> {
        let shared = Arc::clone(&self.shared);
        let scheme = &shared.scheme;
        let cmds = items
            .iter()
            .map(|(i, _)| {
                let mut c = redis::cmd("GET");
                c.arg(scheme.name(&job.keys[*i]));
                c
            })
            .collect();
        let replies = self.pipeline("GET", cmds);
        let Some(replies) = replies else {
            return items.into_iter().map(|(i, _)| (i, false)).collect();
        };
        let mut out = Vec::with_capacity(items.len());
        let mut bad = Vec::new();
        let mut absent = Vec::new();
        for (n, (i, row)) in items.iter_mut().enumerate() {
            let key = job.keys[*i];
            let checked = match replies.get(n) {
                Some(Value::Nil) => Err(ValueDefect::Missing),
                Some(Value::BulkString(v)) => scheme.decode(&key, v).map(|payload| {
                    // Only a verified payload reaches the row.
                    row.copy_from_slice(payload);
                }),
                _ => Err(ValueDefect::Type),
            };
            match checked {
                Ok(()) => out.push((*i, true)),
                Err(ValueDefect::Missing) => {
                    Counters::add(&self.shared.counters.missing_values, 1);
                    absent.push(key);
                    out.push((*i, false));
                }
                Err(defect) => {
                    Counters::add(&self.shared.counters.bad_values, 1);
                    self.shared.log.warn(
                        &self.shared.name,
                        "bad-value",
                        format_args!(
                            "redis tier: the value of {key} is not served ({defect}); it is deleted"
                        ),
                    );
                    absent.push(key);
                    bad.push(key);
                    out.push((*i, false));
                }
            }
        }
        drop(items);
        {
            let now = Instant::now();
            let mut p = self.shared.presence.lock();
            for k in absent {
                p.set(k, false, now);
            }
        }
        if !bad.is_empty() {
            // Best effort: a bad value would fail every later load of its key.
            let cmds = bad
                .iter()
                .map(|k| {
                    let mut c = redis::cmd("UNLINK");
                    c.arg(scheme.name(k));
                    c
                })
                .collect();
            let _ = self.pipeline("UNLINK", cmds);
        }
        out
    }

    fn refresh_info(&mut self) {
        if self.shared.backing_off() {
            return;
        }
        match info::fetch(&self.shared.endpoint) {
            Ok(figures) => {
                let mut i = self.shared.info.lock();
                i.used_memory = figures.used_memory;
                i.maxmemory = figures.maxmemory;
                i.evicted_keys = figures.evicted_keys;
                i.keys = figures.keys;
                i.refreshed = Some(Instant::now());
            }
            Err(e) => {
                self.shared.log.warn(
                    &self.shared.name,
                    "info",
                    format_args!("redis tier: INFO failed: {e}"),
                );
            }
        }
    }
}
