//! Workloads: named lists of requests ([`Workload`]), generated here — seeded and reproducible:
//! multi-turn `chat`, `shared-prefix` and `scan` — or replayed from a trace
//! ([`Workload::from_trace`], with the trace format in `super::trace`).
//!
//! A request ([`RequestSpec`]) is an arrival time, prompt token ids and the token ids the
//! model will generate. Output tokens are fixed up front so a chat session's next turn contains
//! exactly what the previous turn produced, and its chunk keys match.

use std::fmt;
use std::str::FromStr;
use std::sync::Arc;

use serde::Serialize;

use super::rng::{SimRng, Zipf};

/// A named list of requests to run.
#[derive(Clone, Debug, PartialEq)]
pub struct Workload {
    /// What the requests are (`chat`, `trace FILE`, …), for the report.
    pub label: String,
    /// The requests, in arrival order.
    pub requests: Vec<RequestSpec>,
}

impl Workload {
    /// A generated workload.
    #[must_use]
    pub fn generate(spec: &WorkloadSpec) -> Self {
        Self {
            label: format!("{} ({} requests, seed {})", spec.kind, spec.requests, spec.seed),
            requests: spec.generate(),
        }
    }
}

/// One request of a workload.
#[derive(Clone, Debug, PartialEq)]
pub struct RequestSpec {
    /// A readable name (session and turn, or trace line).
    pub name: String,
    /// Arrival time in seconds from the start of the run.
    pub arrival: f64,
    /// The prompt's token ids.
    pub prompt: Arc<[u32]>,
    /// The token ids the model generates (at least one: the first token).
    pub output: Arc<[u32]>,
}

/// The built-in workload generators.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum WorkloadKind {
    /// Multi-turn sessions returning with longer contexts; Zipf session popularity.
    Chat,
    /// A few long system prompts shared by many short questions.
    SharedPrefix,
    /// Unique prompts, no reuse: offloading can only cost.
    Scan,
}

impl WorkloadKind {
    /// The name used on the command line.
    #[must_use]
    pub fn name(self) -> &'static str {
        match self {
            Self::Chat => "chat",
            Self::SharedPrefix => "shared-prefix",
            Self::Scan => "scan",
        }
    }
}

impl fmt::Display for WorkloadKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl FromStr for WorkloadKind {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "chat" => Ok(Self::Chat),
            "shared-prefix" => Ok(Self::SharedPrefix),
            "scan" => Ok(Self::Scan),
            other => Err(format!(
                "unknown workload `{other}` (expected chat, shared-prefix or scan)"
            )),
        }
    }
}

/// What to generate.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct WorkloadSpec {
    /// Which generator.
    pub kind: WorkloadKind,
    /// Number of requests.
    pub requests: usize,
    /// Seed: the same seed gives the same requests.
    pub seed: u64,
    /// Mean arrival rate in requests per second (Poisson arrivals).
    pub rate: f64,
    /// Chat: number of sessions.
    pub sessions: usize,
    /// Chat: Zipf exponent of session popularity.
    pub zipf_s: f64,
    /// Shared-prefix: number of distinct system prompts.
    pub prefixes: usize,
    /// Longest context (prompt + output) a request may have.
    pub max_context: usize,
}

impl WorkloadSpec {
    /// The defaults for `kind`: `requests` requests with seed `seed`.
    #[must_use]
    pub fn new(kind: WorkloadKind, requests: usize, seed: u64) -> Self {
        Self {
            kind,
            requests,
            seed,
            rate: 300.0,
            sessions: 400,
            zipf_s: 0.9,
            prefixes: 16,
            max_context: 3072,
        }
    }

    /// Generates the requests.
    #[must_use]
    pub fn generate(&self) -> Vec<RequestSpec> {
        let mut arrivals = SimRng::derive(self.seed, 0);
        let mut t = 0.0;
        let mut times = (0..self.requests).map(|_| {
            t += arrivals.exponential(self.rate);
            t
        });
        match self.kind {
            WorkloadKind::Chat => self.chat(&mut times),
            WorkloadKind::SharedPrefix => self.shared_prefix(&mut times),
            WorkloadKind::Scan => self.scan(&mut times),
        }
    }

    fn chat(&self, times: &mut dyn Iterator<Item = f64>) -> Vec<RequestSpec> {
        let sessions = self.sessions.max(1);
        let zipf = Zipf::new(sessions, self.zipf_s);
        let mut pick = SimRng::derive(self.seed, 1);
        let system: Vec<u32> = SimRng::derive(self.seed, 2).tokens(256);
        let mut history: Vec<Vec<u32>> = vec![Vec::new(); sessions];
        let mut turns = vec![0u32; sessions];
        let mut conversations = vec![0u32; sessions];
        let mut out = Vec::with_capacity(self.requests);
        for (i, arrival) in times.enumerate() {
            let s = zipf.sample(&mut pick);
            let mut rng = SimRng::derive(self.seed, 1_000_000 + i as u64);
            let user = rng.range(32, 256) as usize;
            let output_len = rng.range(16, 96) as usize;
            if history[s].len() + user + output_len > self.max_context {
                // The conversation got too long: the user starts a new one.
                history[s].clear();
                turns[s] = 0;
                conversations[s] += 1;
            }
            if history[s].is_empty() {
                history[s].extend_from_slice(&system);
            }
            let mut prompt = history[s].clone();
            prompt.extend(rng.tokens(user));
            let output = rng.tokens(output_len);
            history[s].clone_from(&prompt);
            history[s].extend_from_slice(&output);
            out.push(RequestSpec {
                name: format!("chat-s{s}-c{}-t{}", conversations[s], turns[s]),
                arrival,
                prompt: prompt.into(),
                output: output.into(),
            });
            turns[s] += 1;
        }
        out
    }

    fn shared_prefix(&self, times: &mut dyn Iterator<Item = f64>) -> Vec<RequestSpec> {
        let n = self.prefixes.max(1);
        let len = (self.max_context / 2).max(1);
        let prefixes: Vec<Vec<u32>> = (0..n)
            .map(|p| SimRng::derive(self.seed, 10 + p as u64).tokens(len))
            .collect();
        let mut pick = SimRng::derive(self.seed, 1);
        times
            .enumerate()
            .map(|(i, arrival)| {
                let p = pick.range(0, n as u64 - 1) as usize;
                let mut rng = SimRng::derive(self.seed, 1_000_000 + i as u64);
                let question = rng.range(64, 512) as usize;
                let output_len = rng.range(16, 64) as usize;
                let mut prompt = prefixes[p].clone();
                prompt.extend(rng.tokens(question));
                RequestSpec {
                    name: format!("prefix{p}-q{i}"),
                    arrival,
                    prompt: prompt.into(),
                    output: rng.tokens(output_len).into(),
                }
            })
            .collect()
    }

    fn scan(&self, times: &mut dyn Iterator<Item = f64>) -> Vec<RequestSpec> {
        let longest = self.max_context.saturating_sub(64).max(256) as u64;
        times
            .enumerate()
            .map(|(i, arrival)| {
                let mut rng = SimRng::derive(self.seed, 1_000_000 + i as u64);
                let len = rng.range(256, longest) as usize;
                let output_len = rng.range(16, 64) as usize;
                RequestSpec {
                    name: format!("scan-{i}"),
                    arrival,
                    prompt: rng.tokens(len).into(),
                    output: rng.tokens(output_len).into(),
                }
            })
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn same_seed_same_workload_other_seed_differs() {
        for kind in [WorkloadKind::Chat, WorkloadKind::SharedPrefix, WorkloadKind::Scan] {
            let a = WorkloadSpec::new(kind, 50, 9).generate();
            let b = WorkloadSpec::new(kind, 50, 9).generate();
            let c = WorkloadSpec::new(kind, 50, 10).generate();
            assert_eq!(a, b, "{kind}");
            assert_ne!(a, c, "{kind}");
            assert_eq!(a.len(), 50);
            assert!(a.windows(2).all(|w| w[0].arrival <= w[1].arrival));
            assert!(a.iter().all(|r| !r.output.is_empty() && !r.prompt.is_empty()));
        }
    }

    #[test]
    fn chat_turns_extend_the_previous_context() {
        let reqs = WorkloadSpec::new(WorkloadKind::Chat, 300, 1).generate();
        let mut continued = 0;
        for (i, r) in reqs.iter().enumerate() {
            let Some(session) = r.name.rsplit_once("-t").map(|(s, _)| s) else {
                continue;
            };
            // The latest earlier turn of the same conversation is a strict prefix of this one.
            if let Some(prev) = reqs[..i]
                .iter()
                .rev()
                .find(|p| p.name.starts_with(&format!("{session}-t")))
            {
                let mut ctx = prev.prompt.to_vec();
                ctx.extend_from_slice(&prev.output);
                assert!(
                    r.prompt.starts_with(&ctx),
                    "{} does not extend {}",
                    r.name,
                    prev.name
                );
                continued += 1;
            }
        }
        assert!(continued > 100, "only {continued} continued turns");
        let max = WorkloadSpec::new(WorkloadKind::Chat, 1, 1).max_context;
        assert!(reqs.iter().all(|r| r.prompt.len() + r.output.len() <= max));
    }

    #[test]
    fn shared_prefix_requests_share_one_of_few_prefixes_and_scan_shares_nothing() {
        let spec = WorkloadSpec::new(WorkloadKind::SharedPrefix, 40, 2);
        let reqs = spec.generate();
        let len = spec.max_context / 2;
        let distinct: std::collections::HashSet<&[u32]> = reqs.iter().map(|r| &r.prompt[..len]).collect();
        assert!(distinct.len() <= spec.prefixes && distinct.len() > 1);
        let scan = WorkloadSpec::new(WorkloadKind::Scan, 40, 2).generate();
        let firsts: std::collections::HashSet<&[u32]> = scan.iter().map(|r| &r.prompt[..16]).collect();
        assert_eq!(firsts.len(), 40);
    }

    #[test]
    fn kind_parses_its_names_and_rejects_others() {
        for kind in [WorkloadKind::Chat, WorkloadKind::SharedPrefix, WorkloadKind::Scan] {
            assert_eq!(kind.name().parse::<WorkloadKind>(), Ok(kind));
        }
        assert!("bogus".parse::<WorkloadKind>().unwrap_err().contains("bogus"));
    }
}
