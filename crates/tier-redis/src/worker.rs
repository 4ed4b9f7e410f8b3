//! What a worker thread (of the tier's `tier_kit::WorkerPool`) does: each owns one connection,
//! takes work from the shared queue by priority, and runs it as pipelined round trips. A connection error drops the connection;
//! the next batch reconnects once the shared backoff allows it, and until then batches fail at
//! once instead of waiting on a dead server.

use std::sync::Arc;
use std::time::Instant;

use redis::{RedisError, RedisResult, Value};
use tier_kit::JobKeys;
use tiering_core::{
    OffloadKey,
    arena::{RowRead, RowWrite},
};

use crate::conn::Conn;
use crate::format::{KeyScheme, ValueArg, ValueDefect};
use crate::info;
use crate::packed::PackedPipeline;
use crate::shared::{Batch, Shared, Work};

/// Encoded `SET` bytes sent per write: small enough that the server starts on a batch's first
/// values while the worker encodes the rest, large enough that a write's fixed cost is small.
const SEND_BYTES: usize = 256 << 10;

/// Checks `reply` as the value of `key` and copies its payload into `row` when it is intact
/// (only a verified payload reaches the row).
fn check_into(
    scheme: &KeyScheme,
    key: &OffloadKey,
    reply: &Value,
    row: &mut [u8],
) -> Result<(), ValueDefect> {
    match reply {
        Value::Nil => Err(ValueDefect::Missing),
        Value::BulkString(v) => scheme.decode(key, v).map(|payload| row.copy_from_slice(payload)),
        _ => Err(ValueDefect::Type),
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

/// One worker thread's own state: its connection and its encoding buffer.
pub(crate) struct Worker {
    shared: Arc<Shared>,
    conn: Option<Conn>,
    /// The tier's connection-failure count when `conn` was opened: a later failure on any
    /// worker means the server may have gone away since, so the connection is not trusted.
    conn_epoch: u64,
    /// The next pipeline's bytes (standalone servers), reused from batch to batch.
    packed: PackedPipeline,
}

impl tier_kit::Worker<Work> for Worker {
    fn run(&mut self, work: Work) {
        match work {
            Work::Lookup(check) => {
                let replies = self.exists(check.keys());
                check.answer(replies.as_deref());
            }
            Work::Transfer(Batch::Store(part, items)) => {
                let outcomes = self.store(part.job(), items);
                part.settle(outcomes);
            }
            Work::Transfer(Batch::Load(part, items)) => {
                let outcomes = self.load(part.job(), items);
                part.settle(outcomes);
            }
            Work::Info => self.refresh_info(),
            Work::Probe => self.probe(),
        }
    }

    /// A panic in the client must not lose work: the unwind dropped the batch, whose keys
    /// failed, or the presence check, whose keys count as absent (the pool logged the panic).
    /// The connection may be in the middle of a reply, so it goes.
    fn after_panic(&mut self, _message: &str) {
        self.conn = None;
    }
}

impl Worker {
    /// A worker of `shared`, not connected yet (the first batch connects).
    pub(crate) fn new(shared: Arc<Shared>) -> Self {
        Self {
            shared,
            conn: None,
            conn_epoch: 0,
            packed: PackedPipeline::default(),
        }
    }

    /// The connection, opened if needed; `None` while backing off or when connecting fails.
    ///
    /// A connection opened before another worker saw the server fail is dropped unused: after
    /// a restart it is most likely dead, and finding out by failing a batch on it would fail
    /// work the server could do (the restart is only seen by the worker that reconnected).
    fn conn(&mut self) -> Option<&mut Conn> {
        let epoch = self.shared.connection_failures();
        if self.conn.is_some() && self.conn_epoch != epoch {
            self.conn = None;
        }
        if self.conn.is_none() {
            if self.shared.backing_off() {
                return None;
            }
            // Read before connecting: a failure seen while connecting makes this one suspect.
            self.conn_epoch = epoch;
            match self.shared.endpoint.connect() {
                Ok(c) => {
                    self.shared.counters.connects.add(1);
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

    /// Whether the connection takes encoded commands (see [`PackedPipeline`]); `None` when
    /// there is no connection.
    fn packs(&mut self) -> Option<bool> {
        self.conn().map(|c| c.takes_packed())
    }

    /// Runs `f` on the open connection and the worker's encoding buffer; `None` on a failure.
    /// A connection-level failure drops the connection, and so does any failure when `strict`
    /// (`f` streams replies and may have left some unread).
    fn io<T>(
        &mut self,
        what: &str,
        strict: bool,
        f: impl FnOnce(&mut Conn, &mut PackedPipeline) -> RedisResult<T>,
    ) -> Option<T> {
        let conn = self.conn.as_mut()?;
        match f(conn, &mut self.packed) {
            Ok(values) => {
                self.shared.connection_ok();
                Some(values)
            }
            Err(e) => {
                let broken = breaks_connection(&e);
                if broken || strict {
                    self.conn = None;
                }
                if broken {
                    self.shared.connection_failed(what, &e);
                } else {
                    self.shared.counters.server_errors.add(1);
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

    /// One pipelined `command <key>` per key (`EXISTS`, `UNLINK`, and `GET` on a cluster).
    fn keyed<'k>(
        &mut self,
        command: &'static str,
        keys: impl ExactSizeIterator<Item = &'k OffloadKey>,
    ) -> Option<Vec<Value>> {
        let shared = Arc::clone(&self.shared);
        let scheme = &shared.scheme;
        if self.packs()? {
            return self.io(command, false, |conn, packed| {
                packed.clear();
                packed.reserve(keys.len(), scheme.name_len() + 32);
                for k in keys {
                    packed.keyed(command.as_bytes(), scheme, k);
                }
                conn.pipeline_packed(packed)
            });
        }
        let cmds = keys
            .map(|k| {
                let mut c = redis::cmd(command);
                c.arg(scheme.name(k));
                c
            })
            .collect();
        self.io(command, false, |conn, _| conn.pipeline(cmds))
    }

    /// One pipelined `EXISTS` per key.
    fn exists(&mut self, keys: &[OffloadKey]) -> Option<Vec<Value>> {
        self.keyed("EXISTS", keys.iter())
    }

    /// One `SET` per row; the rows are released once their bytes are sent. On a standalone
    /// server the values are encoded into the worker's buffer and sent every [`SEND_BYTES`],
    /// so the server parses the first values while the worker encodes the next (one
    /// connection, one pipeline: the replies are read after the last value is sent).
    fn set_all(&mut self, job: &JobKeys, items: Vec<(usize, RowRead)>) -> Option<Vec<Value>> {
        let shared = Arc::clone(&self.shared);
        let scheme = &shared.scheme;
        if self.packs()? {
            return self.io("SET", true, |conn, packed| {
                let n = items.len();
                packed.clear();
                packed.reserve(1, SEND_BYTES + PackedPipeline::set_len(scheme));
                for (i, row) in &items {
                    packed.set(scheme, &job.keys[*i], row);
                    if packed.bytes().len() >= SEND_BYTES {
                        conn.send_packed(packed.bytes())?;
                        packed.clear();
                    }
                }
                drop(items);
                if !packed.bytes().is_empty() {
                    conn.send_packed(packed.bytes())?;
                }
                packed.clear();
                (0..n).map(|_| conn.recv()).collect()
            });
        }
        let cmds = items
            .iter()
            .map(|(i, row)| {
                let key = &job.keys[*i];
                let mut c = redis::cmd("SET");
                c.arg(scheme.name(key)).arg(ValueArg::new(scheme, key, row));
                c
            })
            .collect();
        // The rows are copied into the commands: release them before the round trip.
        drop(items);
        self.io("SET", false, |conn, _| conn.pipeline(cmds))
    }

    fn store(&mut self, job: &JobKeys, items: Vec<(usize, RowRead)>) -> Vec<(usize, bool)> {
        let indices: Vec<usize> = items.iter().map(|(i, _)| *i).collect();
        let replies = self.set_all(job, items);
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
            self.shared.counters.server_errors.add(1);
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

    /// `GET`s every key and checks each reply into its row; returns one check per reply
    /// received, in order (fewer than the items when the round trip failed part way). On a
    /// standalone server each reply is checked and copied as it arrives, while the server
    /// still sends the next ones.
    fn get_all(&mut self, job: &JobKeys, items: &mut [(usize, RowWrite)]) -> Vec<Result<(), ValueDefect>> {
        let shared = Arc::clone(&self.shared);
        let scheme = &shared.scheme;
        let mut checked = Vec::with_capacity(items.len());
        match self.packs() {
            None => {}
            Some(true) => {
                let _ = self.io("GET", true, |conn, packed| {
                    packed.clear();
                    packed.reserve(items.len(), scheme.name_len() + 32);
                    for (i, _) in items.iter() {
                        packed.keyed(b"GET", scheme, &job.keys[*i]);
                    }
                    conn.send_packed(packed.bytes())?;
                    packed.clear();
                    for (i, row) in items.iter_mut() {
                        let reply = conn.recv()?;
                        checked.push(check_into(scheme, &job.keys[*i], &reply, row));
                    }
                    Ok(())
                });
            }
            Some(false) => {
                let keys = items.iter().map(|(i, _)| &job.keys[*i]);
                if let Some(replies) = self.keyed("GET", keys) {
                    for ((i, row), reply) in items.iter_mut().zip(&replies) {
                        checked.push(check_into(scheme, &job.keys[*i], reply, row));
                    }
                }
            }
        }
        checked
    }

    fn load(&mut self, job: &JobKeys, mut items: Vec<(usize, RowWrite)>) -> Vec<(usize, bool)> {
        let checked = self.get_all(job, &mut items);
        let mut out = Vec::with_capacity(items.len());
        let mut bad = Vec::new();
        let mut absent = Vec::new();
        for (n, (i, _)) in items.iter().enumerate() {
            let key = job.keys[*i];
            match checked.get(n) {
                Some(Ok(())) => out.push((*i, true)),
                // Not received: the round trip failed (already counted and logged).
                None => out.push((*i, false)),
                Some(Err(ValueDefect::Missing)) => {
                    self.shared.counters.missing_values.add(1);
                    absent.push(key);
                    out.push((*i, false));
                }
                Some(Err(defect)) => {
                    self.shared.counters.bad_values.add(1);
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
            let _ = self.keyed("UNLINK", bad.iter());
        }
        out
    }

    /// Connects if needed and sends `PING`: success clears the unreachable state (see
    /// [`Shared::connection_ok`]), failure starts the next backoff.
    fn probe(&mut self) {
        if self.conn().is_some() {
            let _ = self.io("PING", false, |conn, _| conn.pipeline(vec![redis::cmd("PING")]));
        }
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
