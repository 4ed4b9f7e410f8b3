//! The soak's summary: what ran, the faults injected, what was checked, and every violation.

use std::fmt;
use std::time::Duration;

use super::checks::{Growth, ProcSample, TtftBound};
use super::schedule::FaultKind;

/// One row of the fault table.
#[derive(Clone, Debug)]
pub struct FaultRow {
    /// The kind.
    pub kind: FaultKind,
    /// How many were injected.
    pub injected: u64,
    /// What they did, or why they were skipped.
    pub note: String,
}

/// Everything one soak measured.
#[derive(Clone, Debug, Default)]
pub struct SoakReport {
    /// The soak's length (faults and checks), without the reference phase.
    pub duration: Duration,
    /// The seed of the workloads and the fault schedule.
    pub seed: u64,
    /// The chain of each node.
    pub chain: String,
    /// Faults by kind.
    pub faults: Vec<FaultRow>,
    /// Rounds this node ran.
    pub rounds: u64,
    /// Requests this node submitted.
    pub submitted: u64,
    /// Requests this node completed.
    pub completed: u64,
    /// Rounds and requests the peer node completed (over all its restarts).
    pub peer_rounds: u64,
    /// Requests the peer node completed.
    pub peer_requests: u64,
    /// Bytes loaded into the simulated device and verified, this node and the peer.
    pub verified_bytes: [u64; 2],
    /// Wrong bytes loaded, this node and the peer.
    pub wrong_bytes: [u64; 2],
    /// Idle arena rows given a flipped byte on purpose (`--inject-wrong-bytes`; 0 otherwise).
    pub arena_rows_corrupted: u64,
    /// Slab audits after the run: bytes verified, this node's slab and the peer's.
    pub audit_verified_bytes: [u64; 2],
    /// Slab audits: wrong bytes behind a valid checksum.
    pub audit_wrong_bytes: [u64; 2],
    /// Slab audits: slots failing their checksum (never served; from injected corruption).
    pub audit_bad_checksum: [u64; 2],
    /// Disk-tier store acknowledgements (events) and the keys held at the end.
    pub acknowledged: (u64, u64),
    /// Acknowledged stores the slab no longer holds.
    pub lost_stores: u64,
    /// Corrupt slots the disk tier detected on load (its `corrupt_slots`).
    pub corrupt_detected: u64,
    /// Write/read errors of the disk tier (its `io_errors`: the full filesystem).
    pub disk_io_errors: u64,
    /// Prompt tokens of this node by source: device cache, then each tier, then computed.
    pub sources: Vec<(String, u64)>,
    /// Prompt tokens the peer loaded through its p2p tier.
    pub peer_p2p_tokens: u64,
    /// Slots the peer's disk tier recovered at its (re)starts.
    pub peer_recovered_slots: u64,
    /// Process samples: start, after warm-up, end.
    pub proc: [ProcSample; 3],
    /// The warm-up's length.
    pub warm_up: Duration,
    /// The growth allowed after warm-up.
    pub growth: Growth,
    /// TTFT of the offloading-off reference (p50, p99), ms.
    pub ttft_reference: (f64, f64),
    /// TTFT of this node during the soak (p50, p99), ms.
    pub ttft_soak: (f64, f64),
    /// The TTFT bound.
    pub ttft_bound: Option<TtftBound>,
    /// Scratch paths checked at the end, and those still there.
    pub scratch_checked: usize,
    /// Paths left behind.
    pub leftovers: Vec<String>,
    /// Every violation, in words.
    pub violations: Vec<String>,
}

fn mib(bytes: u64) -> String {
    format!("{:.1} MiB", bytes as f64 / (1u64 << 20) as f64)
}

impl fmt::Display for SoakReport {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        writeln!(
            f,
            "kvtier soak — {:?}, seed {}, two nodes on loopback; chain {}",
            self.duration, self.seed, self.chain
        )?;
        writeln!(f, "\nfaults injected")?;
        for r in &self.faults {
            writeln!(f, "  {:<34} {:>6}   {}", r.kind.name(), r.injected, r.note)?;
        }
        let total: u64 = self.faults.iter().map(|r| r.injected).sum();
        writeln!(f, "  {:<34} {:>6}", "total", total)?;

        writeln!(f, "\nchecks{:>39}{:>18}", "this node", "peer node")?;
        let row = |f: &mut fmt::Formatter<'_>, name: &str, a: String, b: String| {
            writeln!(f, "  {name:<34} {a:>10} {b:>17}")
        };
        row(
            f,
            "requests completed / submitted",
            format!("{}/{}", self.completed, self.submitted),
            format!("{} (in {} rounds)", self.peer_requests, self.peer_rounds),
        )?;
        row(f, "rounds", self.rounds.to_string(), self.peer_rounds.to_string())?;
        row(
            f,
            "bytes loaded and verified",
            mib(self.verified_bytes[0]),
            mib(self.verified_bytes[1]),
        )?;
        row(
            f,
            "wrong bytes loaded",
            self.wrong_bytes[0].to_string(),
            self.wrong_bytes[1].to_string(),
        )?;
        row(
            f,
            "slab audit: bytes verified",
            mib(self.audit_verified_bytes[0]),
            mib(self.audit_verified_bytes[1]),
        )?;
        row(
            f,
            "slab audit: wrong bytes (valid sum)",
            self.audit_wrong_bytes[0].to_string(),
            self.audit_wrong_bytes[1].to_string(),
        )?;
        row(
            f,
            "slab audit: slots failing checksum",
            self.audit_bad_checksum[0].to_string(),
            self.audit_bad_checksum[1].to_string(),
        )?;
        row(
            f,
            "lost acknowledged stores",
            format!("{}", self.lost_stores),
            "-".into(),
        )?;
        writeln!(
            f,
            "    (disk stores acknowledged {}, held at the end {}; corrupt slots detected on load {}, \
             disk I/O errors {})",
            self.acknowledged.0, self.acknowledged.1, self.corrupt_detected, self.disk_io_errors
        )?;
        write!(f, "  prompt tokens by source (this node):")?;
        for (s, t) in &self.sources {
            write!(f, " {s} {t};")?;
        }
        writeln!(
            f,
            "\n  peer node: {} prompt tokens over p2p, {} slots recovered by its disk tier at restarts",
            self.peer_p2p_tokens, self.peer_recovered_slots
        )?;

        writeln!(
            f,
            "\nprocess (this node, /proc/self)      start   after warm-up        end"
        )?;
        let [s, w, e] = self.proc;
        writeln!(
            f,
            "  RSS                         {:>10} {:>15} {:>10}",
            mib(s.rss_kib * 1024),
            mib(w.rss_kib * 1024),
            mib(e.rss_kib * 1024)
        )?;
        writeln!(
            f,
            "  open descriptors            {:>10} {:>15} {:>10}",
            s.fds, w.fds, e.fds
        )?;
        writeln!(
            f,
            "  tolerance after a {:?} warm-up: RSS +max({:.0}%, {}), descriptors +{}",
            self.warm_up,
            self.growth.rss_fraction * 100.0,
            mib(self.growth.rss_floor_kib * 1024),
            self.growth.fds
        )?;

        writeln!(f, "\ntime to first token (simulated clock)   p50        p99")?;
        writeln!(
            f,
            "  offload off (reference)        {:>8.2} ms {:>8.2} ms",
            self.ttft_reference.0, self.ttft_reference.1
        )?;
        writeln!(
            f,
            "  soak (offload on, faults)      {:>8.2} ms {:>8.2} ms",
            self.ttft_soak.0, self.ttft_soak.1
        )?;
        if let Some(b) = self.ttft_bound {
            writeln!(
                f,
                "  bound: soak p99 ≤ {} × reference p99 + {} ms = {:.2} ms",
                b.factor,
                b.slack_ms,
                b.limit_ms(self.ttft_reference.1)
            )?;
        }
        writeln!(
            f,
            "\nscratch: {} paths checked after the run, {} left behind{}",
            self.scratch_checked,
            self.leftovers.len(),
            if self.leftovers.is_empty() {
                String::new()
            } else {
                format!(": {}", self.leftovers.join(", "))
            }
        )?;
        if self.violations.is_empty() {
            writeln!(f, "\nno violation")
        } else {
            writeln!(f, "\n{} VIOLATION(S)", self.violations.len())?;
            for v in &self.violations {
                writeln!(f, "  - {v}")?;
            }
            Ok(())
        }
    }
}
