//! A fault-injection tier for the vLLM-in-the-loop tests (cargo feature `fault-injection`, off
//! by default and never in a published wheel): an in-memory secondary tier, `type = "faulty"`,
//! that panics on purpose in the calls a chain names, so the suite can check that a panicking
//! tier under vLLM's real scheduler is quarantined while vLLM keeps scheduling.
//!
//! ```toml
//! [[secondary]]
//! type = "faulty"
//! name = "faulty"            # default "faulty"
//! panic_in = "lookup"        # one call, or several: ["lookup", "on_request_finished"]
//! panic_after = 40           # calls of that method that succeed first (default 0)
//! capacity = 4096            # chunks kept, oldest dropped first (default 1024)
//! control_plane = false      # opt in to the control thread (default false)
//! ```
//!
//! Jobs complete at submission (the copy is a memcpy) and are reported at the next poll.

use std::collections::{HashMap, VecDeque};
use std::time::Instant;

use parking_lot::Mutex;
use tiering_core::{
    JobResult, Locality, LookupResult, Medium, OffloadKey, ReqContext, SecondaryTier, TierError, TierInfo,
    TierStats, TransferJob, registry::SecondaryContext,
};

/// The methods `panic_in` may name.
const CALLS: [&str; 12] = [
    "lookup",
    "submit_store",
    "submit_load",
    "poll_finished",
    "has_pending_work",
    "touch",
    "on_new_request",
    "on_request_finished",
    "serve_external_requests",
    "on_schedule_end",
    "take_events",
    "stats",
];

struct Options {
    name: String,
    panic_in: Vec<String>,
    panic_after: u64,
    capacity: usize,
    control_plane: bool,
}

fn parse(options: &toml::Table) -> Result<Options, Vec<TierError>> {
    let mut o = Options {
        name: "faulty".to_owned(),
        panic_in: Vec::new(),
        panic_after: 0,
        capacity: 1024,
        control_plane: false,
    };
    let mut errors = Vec::new();
    let mut bad = |key: &str, what: &str| errors.push(TierError::Config(format!("`{key}`: {what}")));
    for (key, value) in options {
        match (key.as_str(), value) {
            ("name", toml::Value::String(s)) => o.name.clone_from(s),
            ("panic_in", toml::Value::String(s)) => o.panic_in = vec![s.clone()],
            ("panic_in", toml::Value::Array(items)) => {
                for item in items {
                    match item.as_str() {
                        Some(s) => o.panic_in.push(s.to_owned()),
                        None => bad(key, "expected method names"),
                    }
                }
            }
            ("panic_after", toml::Value::Integer(n)) if *n >= 0 => o.panic_after = n.unsigned_abs(),
            ("capacity", toml::Value::Integer(n)) if *n > 0 => {
                o.capacity = usize::try_from(*n).unwrap_or(usize::MAX);
            }
            ("control_plane", toml::Value::Boolean(b)) => o.control_plane = *b,
            ("name" | "panic_in" | "panic_after" | "capacity" | "control_plane", _) => {
                bad(key, "a value of the wrong type");
            }
            _ => bad(key, "unknown option of the faulty tier"),
        }
    }
    for call in &o.panic_in {
        if !CALLS.contains(&call.as_str()) {
            bad(
                "panic_in",
                &format!("unknown method `{call}` (one of {})", CALLS.join(", ")),
            );
        }
    }
    if errors.is_empty() { Ok(o) } else { Err(errors) }
}

/// The in-memory tier that panics on request.
struct FaultyTier {
    info: TierInfo,
    control_plane: bool,
    panic_in: Vec<String>,
    panic_after: u64,
    capacity: usize,
    data: HashMap<OffloadKey, Vec<u8>>,
    order: VecDeque<OffloadKey>,
    finished: Vec<JobResult>,
    /// Calls per method so far (a mutex: `has_pending_work` and `stats` take `&self`).
    calls: Mutex<HashMap<&'static str, u64>>,
    stats: TierStats,
}

impl FaultyTier {
    /// Counts a call of `call` and panics if the chain asked for it.
    fn count(&self, call: &'static str) {
        if !self.panic_in.iter().any(|c| c == call) {
            return;
        }
        let n = {
            let mut calls = self.calls.lock();
            let n = calls.entry(call).or_insert(0);
            *n += 1;
            *n
        };
        assert!(
            n <= self.panic_after,
            "faulty tier `{}`: injected panic in {call} (call {n})",
            self.info.name
        );
    }

    fn keep(&mut self, key: OffloadKey, bytes: Vec<u8>) {
        if self.data.insert(key, bytes).is_none() {
            self.order.push_back(key);
        }
        while self.data.len() > self.capacity {
            let Some(old) = self.order.pop_front() else {
                break;
            };
            self.data.remove(&old);
            self.stats.evictions += 1;
        }
    }
}

impl SecondaryTier for FaultyTier {
    fn info(&self) -> TierInfo {
        self.info.clone()
    }

    fn needs_control_plane(&self) -> bool {
        self.control_plane
    }

    fn lookup(&mut self, key: &OffloadKey, _ctx: &ReqContext) -> LookupResult {
        self.count("lookup");
        if self.data.contains_key(key) {
            self.stats.hits += 1;
            LookupResult::Hit
        } else {
            self.stats.misses += 1;
            LookupResult::Miss
        }
    }

    fn submit_store(&mut self, job: TransferJob) {
        self.count("submit_store");
        let start = Instant::now();
        let mut bytes = 0;
        for (i, key) in job.keys.iter().enumerate() {
            if let Some(row) = job.rows.row(i) {
                bytes += row.len() as u64;
                self.keep(*key, row.to_vec());
            }
        }
        self.stats.stores += job.keys.len() as u64;
        self.stats.bytes_written += bytes;
        self.finished.push(JobResult::ok(job.id, bytes, start.elapsed()));
    }

    fn submit_load(&mut self, mut job: TransferJob) {
        self.count("submit_load");
        let start = Instant::now();
        let mut ok = Vec::with_capacity(job.keys.len());
        let mut bytes = 0;
        for (i, key) in job.keys.iter().enumerate() {
            let done = match (self.data.get(key), job.rows.row_mut(i)) {
                (Some(src), Some(dst)) if src.len() == dst.len() => {
                    dst.copy_from_slice(src);
                    bytes += src.len() as u64;
                    true
                }
                _ => false,
            };
            ok.push(done);
        }
        self.stats.loads += ok.iter().filter(|&&b| b).count() as u64;
        self.stats.bytes_read += bytes;
        self.finished.push(JobResult::from_key_outcomes(
            job.id,
            &job.keys,
            &ok,
            bytes,
            start.elapsed(),
        ));
    }

    fn poll_finished(&mut self, out: &mut Vec<JobResult>) {
        self.count("poll_finished");
        out.append(&mut self.finished);
    }

    fn has_pending_work(&self) -> bool {
        self.count("has_pending_work");
        !self.finished.is_empty()
    }

    fn touch(&mut self, _keys: &[OffloadKey], _ctx: &ReqContext) {
        self.count("touch");
    }

    fn on_new_request(&mut self, _ctx: &ReqContext) -> tiering_core::OffloadPolicy {
        self.count("on_new_request");
        tiering_core::OffloadPolicy::ChunkLevel
    }

    fn on_request_finished(&mut self, _ctx: &ReqContext) {
        self.count("on_request_finished");
    }

    fn serve_external_requests(
        &mut self,
        _parent: &mut dyn tiering_core::ParentManager,
    ) -> Result<(), TierError> {
        self.count("serve_external_requests");
        Ok(())
    }

    fn on_schedule_end(&mut self) {
        self.count("on_schedule_end");
    }

    fn drain_jobs(&mut self) {}

    fn take_events(&mut self) -> Vec<tiering_core::OffloadingEvent> {
        self.count("take_events");
        Vec::new()
    }

    fn stats(&self) -> TierStats {
        self.count("stats");
        let mut s = self.stats.clone();
        s.resident_chunks = self.data.len() as u64;
        s.capacity_chunks = self.capacity as u64;
        s
    }
}

fn build(options: &toml::Table, _ctx: &SecondaryContext) -> Result<Box<dyn SecondaryTier>, TierError> {
    let o = parse(options).map_err(|mut errors| errors.remove(0))?;
    Ok(Box::new(FaultyTier {
        info: TierInfo::new(&o.name, Some(Medium::Cpu), Some(Locality::Local)),
        control_plane: o.control_plane,
        panic_in: o.panic_in,
        panic_after: o.panic_after,
        capacity: o.capacity,
        data: HashMap::new(),
        order: VecDeque::new(),
        finished: Vec::new(),
        calls: Mutex::new(HashMap::new()),
        stats: TierStats::named(&o.name),
    }))
}

fn validate(options: &toml::Table) -> Result<(), Vec<TierError>> {
    parse(options).map(drop)
}

tiering_core::register_tier!(secondary "faulty" => build, validate = validate);
