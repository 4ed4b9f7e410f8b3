//! Helpers shared by the integration tests: small-integer keys, a tier constructor, and an
//! interpreter for the op-script language of the recorded vLLM 0.33.0 transcripts.

#![allow(dead_code)]

use std::collections::HashMap;

use tier_cpu::{CpuTier, PolicyKind};
use tiering_core::{LookupResult, OffloadKey, OffloadingEvent, PrimaryTier, ReqContext};

/// Key `n` (group 0), as the transcripts name it.
pub fn k(n: u64) -> OffloadKey {
    OffloadKey::from_u64(n)
}

/// Key `n` of KV group `g`.
pub fn kg(n: u64, g: u32) -> OffloadKey {
    OffloadKey::from_u64(n).with_group(g)
}

/// Keys `ns` (group 0).
pub fn ks(ns: &[u64]) -> Vec<OffloadKey> {
    ns.iter().map(|&n| k(n)).collect()
}

/// The transcript name of a key: `n`, or `ngG` for group G > 0.
pub fn name(key: &OffloadKey) -> String {
    let b = key.hash_bytes();
    let n = u64::from_be_bytes(b[24..32].try_into().unwrap());
    if key.group() == 0 {
        n.to_string()
    } else {
        format!("{n}g{}", key.group())
    }
}

/// The numbers of `keys` (group 0 assumed).
pub fn nums(keys: &[OffloadKey]) -> Vec<u64> {
    keys.iter()
        .map(|key| u64::from_be_bytes(key.hash_bytes()[24..32].try_into().unwrap()))
        .collect()
}

/// A tier of `cap` chunks of 64 bytes with events on.
pub fn tier(cap: usize, policy: PolicyKind) -> CpuTier {
    CpuTier::new(cap, 64, policy).unwrap()
}

/// Events as `(removed, metadata_only, key numbers)`.
pub fn event_summary(events: &[OffloadingEvent]) -> Vec<(bool, bool, Vec<u64>)> {
    events
        .iter()
        .map(|e| (e.removed, e.metadata_only, nums(&e.keys)))
        .collect()
}

fn parse_key(tok: &str) -> OffloadKey {
    match tok.split_once('g') {
        Some((n, g)) => kg(n.parse().unwrap(), g.parse().unwrap()),
        None => k(tok.parse().unwrap()),
    }
}

fn join(keys: &[OffloadKey]) -> String {
    keys.iter().map(name).collect::<Vec<_>>().join(" ")
}

/// ARC's target in units of 1e-9, as the recorder prints it.
fn nano(x: f64) -> String {
    format!("{}e-9", (x * 1e9).round() as i64)
}

/// Runs one op-script line and returns its transcript output (see `tests/data/README.md`).
pub struct ScriptRunner {
    tier: Option<CpuTier>,
    ctxs: HashMap<String, ReqContext>,
}

impl Default for ScriptRunner {
    fn default() -> Self {
        Self::new()
    }
}

impl ScriptRunner {
    pub fn new() -> Self {
        Self {
            tier: None,
            ctxs: HashMap::new(),
        }
    }

    pub fn tier(&mut self) -> &mut CpuTier {
        self.tier.as_mut().expect("script must start with `new`")
    }

    fn ctx(&mut self, r: &str) -> ReqContext {
        self.ctxs
            .entry(r.to_owned())
            .or_insert_with(|| ReqContext::local(r))
            .clone()
    }

    pub fn run(&mut self, line: &str) -> String {
        let t: Vec<&str> = line.split_whitespace().collect();
        let keys = |from: usize| t[from..].iter().map(|s| parse_key(s)).collect::<Vec<_>>();
        match t[0] {
            "new" => {
                self.tier = Some(tier(t[1].parse().unwrap(), t[2].parse().unwrap()));
                self.ctxs.clear();
                "ok".into()
            }
            "newctx" => {
                self.ctxs.insert(t[1].to_owned(), ReqContext::local(t[1]));
                "ok".into()
            }
            "pos" => {
                self.ctx(t[1])
                    .set_key_position(parse_key(t[2]), t[3].parse().unwrap());
                "ok".into()
            }
            "lookup" => {
                let ctx = self.ctx(t[1]);
                match self.tier().lookup(&parse_key(t[2]), &ctx) {
                    LookupResult::Hit => "HIT",
                    LookupResult::HitPending => "HIT_PENDING",
                    LookupResult::Miss => "MISS",
                    LookupResult::Retry => "RETRY",
                }
                .into()
            }
            "load" | "read" => {
                let ctx = self.ctx(t[1]);
                let ks = keys(2);
                let r = if t[0] == "load" {
                    self.tier().prepare_load(&ks, &ctx)
                } else {
                    self.tier().prepare_read(&ks, &ctx)
                };
                match r {
                    Ok(ids) => format!(
                        "chunks {}",
                        ids.iter().map(u32::to_string).collect::<Vec<_>>().join(" ")
                    ),
                    Err(_) => "assert".into(),
                }
            }
            "cload" => {
                let ctx = self.ctx(t[1]);
                match self.tier().complete_load(&keys(2), &ctx) {
                    Ok(()) => "ok".into(),
                    Err(_) => "assert".into(),
                }
            }
            "touch" => {
                let ctx = self.ctx(t[1]);
                self.tier().touch(&keys(2), &ctx);
                "ok".into()
            }
            "store" => {
                let ctx = self.ctx(t[1]);
                match self.tier().prepare_store(&keys(2), &ctx) {
                    None => "none".into(),
                    Some(o) => format!(
                        "keys {} | chunks {} | evicted {}",
                        join(&o.keys_to_store),
                        o.chunk_ids
                            .iter()
                            .map(u32::to_string)
                            .collect::<Vec<_>>()
                            .join(" "),
                        join(&o.evicted)
                    ),
                }
            }
            "cstore" => {
                let ctx = self.ctx(t[1]);
                self.tier().complete_store(&keys(3), &ctx, t[2] == "1");
                "ok".into()
            }
            "finish" => {
                let ctx = self.ctx(t[1]);
                self.tier().on_request_finished(&ctx);
                "ok".into()
            }
            "events" => {
                let evs = self.tier().take_events();
                let parts: Vec<String> = evs
                    .iter()
                    .map(|e| {
                        format!(
                            "{}{} {}",
                            if e.removed { "-" } else { "+" },
                            if e.metadata_only { "m" } else { "" },
                            join(&e.keys)
                        )
                    })
                    .collect();
                format!("events {}", parts.join(" ; "))
            }
            "reset" => {
                self.tier().reset();
                "ok".into()
            }
            "order" => {
                let s = self.tier().policy_snapshot();
                match s.target {
                    Some(p) => format!(
                        "t1 {} | t2 {} | b1 {} | b2 {} | p {}",
                        join(&s.list("t1")),
                        join(&s.list("t2")),
                        join(&s.list("b1")),
                        join(&s.list("b2")),
                        nano(p)
                    ),
                    None => format!("lru {}", join(&s.list("lru"))),
                }
            }
            other => format!("?{other}"),
        }
    }
}

/// Runs a transcript (`op` lines each followed by `= expected` lines); panics at the first
/// difference with the preceding ops for context.
pub fn check_transcript(label: &str, text: &str) {
    let mut runner = ScriptRunner::new();
    let mut history: Vec<String> = Vec::new();
    let mut lines = text
        .lines()
        .filter(|l| !l.trim().is_empty() && !l.starts_with('#'));
    while let Some(op) = lines.next() {
        let expected = lines
            .next()
            .and_then(|l| l.strip_prefix("= "))
            .unwrap_or_else(|| {
                panic!("{label}: op {op:?} has no `= expected` line");
            });
        let got = runner.run(op);
        history.push(format!("{op}  => {got}"));
        if got.trim_end() != expected.trim_end() {
            let start = history.len().saturating_sub(12);
            panic!(
                "{label}: op #{} {op:?}\n  expected: {expected}\n  got:      {got}\n  recent ops:\n    {}",
                history.len(),
                history[start..].join("\n    ")
            );
        }
        runner
            .tier()
            .check_invariants()
            .unwrap_or_else(|e| panic!("{label}: after {op:?}: {e}"));
    }
}
