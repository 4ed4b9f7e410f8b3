//! Hit-ratio comparison of the eviction policies on skewed synthetic traces, printed as a table
//! (`cargo bench -p tier-cpu --bench hit_ratio`). Measured, not asserted.
//!
//! Every request goes through the tier as an engine drives it: look the request's chunks up in
//! prefix order, load the hit prefix, store the rest, finish the request. A chunk counts as a hit
//! only when it and every chunk before it in the request hit (prefix reuse). Keys carry their
//! token positions, as vLLM's scheduler records them.
//!
//! Traces (capacity as a share of the distinct chunks of the reused population):
//! - `zipf`: single-chunk requests over a Zipf-distributed population;
//! - `zipf + scan (window)`: the same with a one-pass scan of never-reused keys (twice the
//!   capacity) in the middle of the run; hits are counted from the scan's start until shortly
//!   after its end, i.e. how much of the working set the scan left standing;
//! - `zipf + one-hit`: 30 % of requests are for keys never seen again, interleaved;
//! - `prefix-8 + scan`: 8-chunk documents (shared prefixes), Zipf over documents, plus a scan.

use tier_cpu::{CpuTier, PolicyKind};
use tiering_core::{LookupResult, OffloadKey, PrimaryTier, ReqContext};

/// splitmix64: a small, good, seedable generator (no dependency needed for a bench).
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    fn unit(&mut self) -> f64 {
        (self.next() >> 11) as f64 / (1u64 << 53) as f64
    }
}

/// Samples ranks `0..n` with probability ∝ 1/(rank+1)^alpha.
struct Zipf {
    cdf: Vec<f64>,
}

impl Zipf {
    fn new(n: usize, alpha: f64) -> Self {
        let mut acc = 0.0;
        let mut cdf: Vec<f64> = (0..n)
            .map(|i| {
                acc += 1.0 / ((i + 1) as f64).powf(alpha);
                acc
            })
            .collect();
        for c in &mut cdf {
            *c /= acc;
        }
        Self { cdf }
    }

    fn sample(&self, rng: &mut Rng) -> usize {
        let u = rng.unit();
        self.cdf.partition_point(|&c| c < u).min(self.cdf.len() - 1)
    }
}

/// One request: its chunks in prefix order, and whether they can ever be reused.
struct Request {
    doc: u64,
    chunks: u64,
    reusable: bool,
}

struct Trace {
    name: String,
    /// Distinct chunks of the reusable population.
    population_chunks: u64,
    requests: Vec<Request>,
    /// The requests whose hits are counted (all by default; around the scan for scan traces).
    measured: std::ops::Range<usize>,
}

/// Population items are scrambled over the id space so that popularity does not follow key
/// order; one-time keys live in their own range.
fn doc_id(rank: usize) -> u64 {
    (rank as u64).wrapping_mul(0x9E37_79B9_7F4A_7C15) >> 20
}

const ONE_TIME: u64 = 1 << 50;

fn zipf_trace(name: &str, docs: usize, chunks: u64, alpha: f64, len: usize, seed: u64) -> Trace {
    let zipf = Zipf::new(docs, alpha);
    let mut rng = Rng(seed);
    let requests = (0..len)
        .map(|_| Request {
            doc: doc_id(zipf.sample(&mut rng)),
            chunks,
            reusable: true,
        })
        .collect();
    Trace {
        name: name.to_owned(),
        population_chunks: docs as u64 * chunks,
        measured: 0..len,
        requests,
    }
}

/// Inserts a one-pass scan of `scan_chunks` never-reused chunks in the middle of the trace, and
/// counts hits only from the scan's start to `after` requests past its end: how much of the
/// working set survived the scan.
fn with_scan(mut t: Trace, scan_chunks: u64, chunks_per_request: u64, after: usize) -> Trace {
    let mid = t.requests.len() / 2;
    let n = (scan_chunks / chunks_per_request) as usize;
    let scan = (0..n as u64).map(|i| Request {
        doc: ONE_TIME + i,
        chunks: chunks_per_request,
        reusable: false,
    });
    t.requests.splice(mid..mid, scan);
    t.measured = mid..(mid + n + after).min(t.requests.len());
    t.name.push_str(" + scan (window)");
    t
}

/// Replaces a share of the requests by one-time keys.
fn with_one_hit(mut t: Trace, share: f64, seed: u64) -> Trace {
    let mut rng = Rng(seed);
    let mut next = ONE_TIME + (1 << 40);
    for r in &mut t.requests {
        if rng.unit() < share {
            *r = Request {
                doc: next,
                chunks: r.chunks,
                reusable: false,
            };
            next += 1;
        }
    }
    t.name.push_str(&format!(" + {:.0}% one-hit", share * 100.0));
    t
}

fn key(doc: u64, chunk: u64) -> OffloadKey {
    OffloadKey::from_u64(doc.wrapping_mul(64).wrapping_add(chunk))
}

/// Replays `trace` through a tier of `capacity` chunks; returns the chunk hit ratio over the
/// reusable requests.
fn replay(trace: &Trace, capacity: usize, policy: PolicyKind) -> f64 {
    let mut tier = CpuTier::new(capacity, 64, policy).expect("bench tier");
    let (mut hits, mut total) = (0u64, 0u64);
    let mut keys = Vec::new();
    for (i, r) in trace.requests.iter().enumerate() {
        let ctx = ReqContext::local(format!("r{i}"));
        keys.clear();
        keys.extend((0..r.chunks).map(|c| key(r.doc, c)));
        for (c, k) in keys.iter().enumerate() {
            ctx.set_key_position(*k, (c as u64 + 1) * 16);
        }
        let prefix = keys
            .iter()
            .take_while(|k| tier.lookup(k, &ctx) == LookupResult::Hit)
            .count();
        if r.reusable && trace.measured.contains(&i) {
            hits += prefix as u64;
            total += r.chunks;
        }
        if prefix > 0 {
            tier.prepare_load(&keys[..prefix], &ctx)
                .expect("hit prefix loads");
            tier.complete_load(&keys[..prefix], &ctx).expect("loads complete");
        }
        if let Some(out) = tier.prepare_store(&keys[prefix..], &ctx) {
            tier.complete_store(&out.keys_to_store, &ctx, true);
        }
        tier.on_request_finished(&ctx);
        tier.take_events();
    }
    hits as f64 / total.max(1) as f64
}

fn main() {
    // `cargo bench` passes `--bench`; there are no options.
    let single = |alpha: f64| zipf_trace(&format!("zipf α={alpha}"), 50_000, 1, alpha, 400_000, 7);
    let prefix = zipf_trace("prefix-8 zipf α=1.0", 8_000, 8, 1.0, 60_000, 11);
    let prefix_again = zipf_trace("prefix-8 zipf α=1.0", 8_000, 8, 1.0, 60_000, 11);
    let traces = [
        (single(0.8), 0.10),
        (with_scan(single(0.8), 10_000, 1, 5_000), 0.10),
        (with_one_hit(single(0.8), 0.3, 3), 0.10),
        (single(1.0), 0.02),
        (with_scan(single(1.0), 2_000, 1, 1_000), 0.02),
        (prefix, 0.10),
        (with_scan(prefix_again, 12_800, 8, 1_000), 0.10),
    ];
    println!("Chunk hit ratio over reusable requests (higher is better)\n");
    println!(
        "| {:<40} | {:>8} | {:>7} | {:>7} | {:>7} |",
        "trace", "capacity", "lru", "arc", "s3fifo"
    );
    println!("|{:-<42}|{:->10}|{:->9}|{:->9}|{:->9}|", "", "", "", "", "");
    for (trace, share) in &traces {
        let capacity = ((trace.population_chunks as f64 * share) as usize).max(1);
        let ratios: Vec<String> = PolicyKind::ALL
            .iter()
            .map(|&p| format!("{:>6.2}%", 100.0 * replay(trace, capacity, p)))
            .collect();
        println!(
            "| {:<40} | {:>7.0}% | {} | {} | {} |",
            trace.name,
            share * 100.0,
            ratios[0],
            ratios[1],
            ratios[2]
        );
    }
}
