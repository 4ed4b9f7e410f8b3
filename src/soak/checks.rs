//! What the soak checks, and the measurements behind each check: process samples from
//! `/proc/self`, the ledger of what the disk tier acknowledged, the audit of a slab file after
//! the run, the TTFT bound, and the scratch left behind.

use std::fs::File;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};

use anyhow::{Context, Result};
use tier_disk::format::{BLOCK, SlabLayout, SlotSeal};
use tiering_core::{KeyMap, KeySet, OffloadKey, OffloadingEvent};

use crate::sim::chunk_matches;

/// Resident memory and open descriptors of this process.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct ProcSample {
    /// `VmRSS`, KiB.
    pub rss_kib: u64,
    /// Entries of `/proc/self/fd`.
    pub fds: u64,
}

impl ProcSample {
    /// Samples `/proc/self` (zeros where it cannot be read).
    #[must_use]
    pub fn now() -> Self {
        let rss_kib = std::fs::read_to_string("/proc/self/status")
            .ok()
            .and_then(|s| {
                s.lines()
                    .find_map(|l| l.strip_prefix("VmRSS:"))
                    .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
            })
            .unwrap_or(0);
        let fds = std::fs::read_dir("/proc/self/fd").map_or(0, |d| d.count() as u64);
        Self { rss_kib, fds }
    }
}

/// How much RSS and descriptors may grow between the end of the warm-up and the end of the run.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Growth {
    /// RSS growth allowed: this fraction of the warm-up RSS …
    pub rss_fraction: f64,
    /// … or this many KiB, whichever is larger.
    pub rss_floor_kib: u64,
    /// Descriptors allowed beyond the warm-up count.
    pub fds: u64,
}

impl Default for Growth {
    fn default() -> Self {
        Self {
            rss_fraction: 0.10,
            rss_floor_kib: 32 * 1024,
            fds: 8,
        }
    }
}

impl Growth {
    /// The RSS allowed at the end for `warm` at the end of the warm-up, KiB.
    #[must_use]
    pub fn rss_limit(&self, warm: ProcSample) -> u64 {
        let frac = (warm.rss_kib as f64 * self.rss_fraction) as u64;
        warm.rss_kib + frac.max(self.rss_floor_kib)
    }

    /// What grew too much from `warm` to `end`, if anything.
    #[must_use]
    pub fn violations(&self, warm: ProcSample, end: ProcSample) -> Vec<String> {
        let mut v = Vec::new();
        if end.rss_kib > self.rss_limit(warm) {
            v.push(format!(
                "RSS grew after warm-up: {} KiB → {} KiB (limit {} KiB)",
                warm.rss_kib,
                end.rss_kib,
                self.rss_limit(warm)
            ));
        }
        if end.fds > warm.fds + self.fds {
            v.push(format!(
                "open descriptors grew after warm-up: {} → {} (limit +{})",
                warm.fds, end.fds, self.fds
            ));
        }
        v
    }
}

/// The bound on time to first token: the soak's p99 must stay within `factor` × the
/// offloading-off p99 plus `slack_ms`.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct TtftBound {
    /// Multiplier of the reference p99.
    pub factor: f64,
    /// Added milliseconds.
    pub slack_ms: f64,
}

impl TtftBound {
    /// The largest p99 allowed for a reference p99 of `reference_ms`.
    #[must_use]
    pub fn limit_ms(&self, reference_ms: f64) -> f64 {
        reference_ms * self.factor + self.slack_ms
    }
}

/// The keys a disk tier acknowledged (its store events) and has not reported removed since,
/// from the manager's event stream: what it must still hold.
#[derive(Debug, Default)]
pub struct DiskLedger {
    tier: String,
    held: KeySet,
    /// Store events seen.
    pub stored: u64,
    /// Removal events seen.
    pub removed: u64,
}

impl DiskLedger {
    /// A ledger of the tier named `tier`.
    #[must_use]
    pub fn new(tier: &str) -> Self {
        Self {
            tier: tier.to_owned(),
            ..Self::default()
        }
    }

    /// Applies events in the order they were emitted (other tiers' are ignored).
    pub fn apply(&mut self, events: &[OffloadingEvent]) {
        for e in events {
            if e.ownership.as_deref() != Some(self.tier.as_str()) {
                continue;
            }
            for k in &e.keys {
                if e.removed {
                    self.removed += 1;
                    self.held.remove(k);
                } else {
                    self.stored += 1;
                    self.held.insert(*k);
                }
            }
        }
    }

    /// The keys held now.
    #[must_use]
    pub fn held(&self) -> &KeySet {
        &self.held
    }
}

/// What a slab file held at the end of a run, every sealed slot read back in full.
#[derive(Debug, Default)]
pub struct SlabAudit {
    /// Slots with an intact seal.
    pub sealed: u64,
    /// Payload bytes whose checksum held and that equal the content of their key.
    pub verified_bytes: u64,
    /// Slots whose checksum held but whose bytes are not their key's content: wrong bytes the
    /// tier would serve.
    pub wrong_slots: u64,
    /// Their bytes that differ.
    pub wrong_bytes: u64,
    /// Slots whose payload fails its checksum (a load would reject them).
    pub bad_checksum: u64,
    /// Keys by state: `true` intact, `false` present but failing the checksum.
    pub keys: KeyMap<bool>,
}

impl SlabAudit {
    /// Reads every slot of the slab in `dir` (written for `chunk_bytes` in `capacity` bytes).
    ///
    /// # Errors
    /// The file cannot be opened or read.
    pub fn of(dir: &Path, chunk_bytes: usize, capacity: u64) -> Result<Self> {
        let path = dir.join(super::faults::SLAB_FILE);
        let mut audit = Self::default();
        let Some(layout) = SlabLayout::for_capacity(chunk_bytes, capacity) else {
            return Ok(audit);
        };
        let f = match File::open(&path) {
            Ok(f) => f,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(audit),
            Err(e) => return Err(e).with_context(|| format!("opening {}", path.display())),
        };
        let len = f.metadata()?.len();
        let mut seal = vec![0u8; BLOCK];
        let mut payload = vec![0u8; chunk_bytes];
        for slot in 0..layout.num_slots {
            if layout.seal_offset(slot) + BLOCK as u64 > len {
                break;
            }
            f.read_exact_at(&mut seal, layout.seal_offset(slot))?;
            let Some(s) = SlotSeal::decode(&seal) else {
                continue;
            };
            audit.sealed += 1;
            f.read_exact_at(&mut payload, layout.slot_offset(slot))?;
            if !s.payload_matches(&seal, &payload) {
                audit.bad_checksum += 1;
                audit.keys.entry(s.key).or_insert(false);
                continue;
            }
            if chunk_matches(&s.key, &payload) {
                audit.verified_bytes += payload.len() as u64;
            } else {
                audit.wrong_slots += 1;
                audit.wrong_bytes += wrong_bytes(&s.key, &payload);
            }
            audit.keys.insert(s.key, true);
        }
        Ok(audit)
    }

    /// The keys of `ledger` this slab does not hold at all: acknowledged stores lost.
    #[must_use]
    pub fn lost(&self, ledger: &DiskLedger) -> Vec<OffloadKey> {
        ledger
            .held()
            .iter()
            .filter(|k| !self.keys.contains_key(*k))
            .copied()
            .collect()
    }
}

/// How many bytes of `data` differ from the content of `key`.
#[must_use]
pub fn wrong_bytes(key: &OffloadKey, data: &[u8]) -> u64 {
    let mut expect = vec![0u8; data.len()];
    crate::sim::fill_chunk(key, &mut expect);
    expect.iter().zip(data).filter(|(a, b)| a != b).count() as u64
}

/// Paths the run created that still exist.
#[must_use]
pub fn leftovers(paths: &[PathBuf]) -> Vec<PathBuf> {
    paths.iter().filter(|p| p.exists()).cloned().collect()
}

/// Whether `dir` is a mount point in this process's mount table.
#[must_use]
pub fn is_mounted(dir: &Path) -> bool {
    let Ok(table) = std::fs::read_to_string("/proc/self/mounts") else {
        return false;
    };
    let want = dir.to_string_lossy();
    table
        .lines()
        .any(|l| l.split_whitespace().nth(1).is_some_and(|m| m == want))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn growth_allows_the_floor_or_the_fraction() {
        let g = Growth::default();
        let warm = ProcSample {
            rss_kib: 100_000,
            fds: 40,
        };
        assert!(g.violations(warm, warm).is_empty());
        let end = ProcSample {
            rss_kib: 100_000 + 32 * 1024,
            fds: 48,
        };
        assert!(g.violations(warm, end).is_empty());
        let end = ProcSample {
            rss_kib: 100_000 + 32 * 1024 + 1,
            fds: 49,
        };
        assert_eq!(g.violations(warm, end).len(), 2);
        let big = ProcSample {
            rss_kib: 1_000_000,
            fds: 0,
        };
        assert_eq!(g.rss_limit(big), 1_100_000);
    }

    #[test]
    fn the_ledger_follows_one_tiers_stores_and_removals_in_order() {
        let (a, b) = (OffloadKey::from_u64(1), OffloadKey::from_u64(2));
        let mut l = DiskLedger::new("disk");
        l.apply(&[
            OffloadingEvent::stored(vec![a, b], None, None).owned_by("disk"),
            OffloadingEvent::removed(vec![a], None, None).owned_by("disk"),
            OffloadingEvent::removed(vec![b], None, None).owned_by("redis"),
            OffloadingEvent::stored(vec![a], None, None),
        ]);
        assert_eq!(l.held().len(), 1);
        assert!(l.held().contains(&b));
        let mut audit = SlabAudit::default();
        assert_eq!(audit.lost(&l), vec![b]);
        audit.keys.insert(b, false);
        assert!(audit.lost(&l).is_empty());
    }

    #[test]
    fn the_proc_sample_sees_this_process() {
        let s = ProcSample::now();
        assert!(s.rss_kib > 0 && s.fds >= 3, "{s:?}");
    }
}
