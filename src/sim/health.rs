//! The "health" section of `kvtier run`'s text report: what an operator must see without
//! `RUST_LOG` or `--json` — slots recovered, discarded and found corrupt by a tier at open, I/O
//! errors, failed jobs, failed promotions and store refusals, quarantined tiers.

use tiering_core::{ManagerCounters, TierStats};

/// A tier's `extra` counters that belong in the health section, with their labels. Any other
/// extra counter whose name says it counts failures, errors, timeouts or corruption is listed
/// under its own name.
const TIER_COUNTERS: [(&str, &str); 4] = [
    ("recovered_at_open", "slots recovered at open"),
    ("discarded_at_open", "slots discarded at open"),
    ("corrupt_slots", "corrupt slots"),
    ("io_errors", "I/O errors"),
];

fn is_failure_counter(name: &str) -> bool {
    [
        "fail",
        "error",
        "corrupt",
        "timeout",
        "timed_out",
        "refused",
        "lost",
    ]
    .iter()
    .any(|w| name.contains(w))
}

/// The lines of the health section: one for the manager, one per tier with anything to say.
#[must_use]
pub fn health_lines(manager: &ManagerCounters, store_refusals: u64, tiers: &[TierStats]) -> Vec<String> {
    let mut lines = vec![format!(
        "  manager: {} failed promotion keys, {} promotions refused for room, {} store refusals, \
         {} tiers quarantined, {} control-plane failures",
        manager.failed_promotion_keys,
        manager.promotion_alloc_failures,
        store_refusals,
        manager.tiers_quarantined,
        manager.control_failures
    )];
    for t in tiers {
        let mut parts = vec![format!("{} failed jobs", t.failures)];
        for (key, label) in TIER_COUNTERS {
            if let Some(v) = t.extra.get(key) {
                parts.push(format!("{v} {label}"));
            }
        }
        for (key, v) in &t.extra {
            if !TIER_COUNTERS.iter().any(|(k, _)| k == key) && is_failure_counter(key) {
                parts.push(format!("{v} {key}"));
            }
        }
        lines.push(format!("  {}: {}", t.name, parts.join(", ")));
    }
    lines
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn health_lists_recovery_corruption_io_errors_failures_and_quarantine() {
        let manager = ManagerCounters {
            failed_promotion_keys: 7,
            tiers_quarantined: 1,
            ..ManagerCounters::default()
        };
        let mut disk = TierStats::named("disk");
        disk.failures = 3;
        disk.extra.insert("recovered_at_open".into(), 12.0);
        disk.extra.insert("discarded_at_open".into(), 2.0);
        disk.extra.insert("corrupt_slots".into(), 5.0);
        disk.extra.insert("io_errors".into(), 1.0);
        disk.extra.insert("queued_chunks".into(), 9.0);
        let mut p2p = TierStats::named("p2p");
        p2p.extra.insert("transfer_failures".into(), 4.0);
        let lines = health_lines(&manager, 6, &[TierStats::named("cpu"), disk, p2p]);
        assert!(lines[0].contains("7 failed promotion keys"), "{lines:?}");
        assert!(lines[0].contains("6 store refusals"), "{lines:?}");
        assert!(lines[0].contains("1 tiers quarantined"), "{lines:?}");
        assert_eq!(lines[1], "  cpu: 0 failed jobs");
        assert_eq!(
            lines[2],
            "  disk: 3 failed jobs, 12 slots recovered at open, 2 slots discarded at open, 5 corrupt slots, 1 I/O errors"
        );
        assert_eq!(lines[3], "  p2p: 0 failed jobs, 4 transfer_failures");
    }
}
