//! Typed construction options of the CPU tier and the errors construction can report.

use std::fmt;
use std::path::PathBuf;

use serde::Deserialize;
use tiering_core::{TierError, arena::ArenaError};

use crate::policy::{PolicyKind, UnknownPolicy};

/// How big the tier is: a number of chunks, or a byte size (`"2GiB"`, `"512 MiB"`, `"10GB"`).
///
/// In configuration files an integer is a chunk count and a string is a byte size (a string
/// `"N chunks"` is a chunk count too). A byte size becomes `size / row_stride` chunks, where the
/// row stride is the chunk size rounded up to the page size — the memory a row really takes.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Deserialize)]
#[serde(try_from = "CapacityRepr")]
pub enum Capacity {
    /// A number of chunks.
    Chunks(u64),
    /// A number of bytes.
    Bytes(u64),
}

#[derive(Deserialize)]
#[serde(untagged)]
enum CapacityRepr {
    Count(u64),
    Text(String),
}

impl TryFrom<CapacityRepr> for Capacity {
    type Error = String;

    fn try_from(r: CapacityRepr) -> Result<Self, String> {
        match r {
            CapacityRepr::Count(n) => Ok(Self::Chunks(n)),
            CapacityRepr::Text(s) => s.parse(),
        }
    }
}

impl std::str::FromStr for Capacity {
    type Err = String;

    /// Parses `"4096"`/`"4096 chunks"` (chunks) or a byte size with a unit: `B`, `KB`/`MB`/`GB`/
    /// `TB` (powers of 1000) or `KiB`/`MiB`/`GiB`/`TiB` (powers of 1024), case-insensitive,
    /// fractions allowed (`"1.5GiB"`).
    fn from_str(s: &str) -> Result<Self, String> {
        let text = s.trim();
        let split = text
            .find(|c: char| !(c.is_ascii_digit() || c == '.' || c == '_'))
            .unwrap_or(text.len());
        let (number, unit) = (text[..split].replace('_', ""), text[split..].trim());
        let bad = || format!("invalid capacity {s:?}: expected a chunk count or a size like \"2GiB\"");
        if number.is_empty() {
            return Err(bad());
        }
        let unit_lower = unit.to_ascii_lowercase();
        if unit_lower.is_empty() || unit_lower == "chunks" || unit_lower == "chunk" {
            return number.parse::<u64>().map(Self::Chunks).map_err(|_| bad());
        }
        let scale: u64 = match unit_lower.as_str() {
            "b" => 1,
            "kb" | "k" => 1_000,
            "mb" | "m" => 1_000_000,
            "gb" | "g" => 1_000_000_000,
            "tb" | "t" => 1_000_000_000_000,
            "kib" => 1 << 10,
            "mib" => 1 << 20,
            "gib" => 1 << 30,
            "tib" => 1 << 40,
            _ => return Err(bad()),
        };
        if let Ok(whole) = number.parse::<u64>() {
            return whole.checked_mul(scale).map(Self::Bytes).ok_or_else(bad);
        }
        let value: f64 = number.parse().map_err(|_| bad())?;
        let bytes = value * scale as f64;
        if !bytes.is_finite() || bytes < 0.0 || bytes >= u64::MAX as f64 {
            return Err(bad());
        }
        Ok(Self::Bytes(bytes as u64))
    }
}

impl fmt::Display for Capacity {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Chunks(n) => write!(f, "{n} chunks"),
            Self::Bytes(b) => write!(f, "{b} bytes"),
        }
    }
}

impl Capacity {
    /// The number of chunks for rows of `row_stride` bytes.
    #[must_use]
    pub fn chunks(self, row_stride: usize) -> u64 {
        match self {
            Self::Chunks(n) => n,
            Self::Bytes(b) => b / (row_stride.max(1) as u64),
        }
    }
}

/// The options table of a `cpu` tier (`[primary]` in a tier-chain file).
///
/// ```toml
/// capacity = "2GiB"        # or a chunk count: capacity = 4096
/// eviction = "arc"         # lru (default) | arc | s3fifo
/// shared_memory = "/dev/shm/kvtier-arena"   # optional
/// events = true            # default true
/// prefault = false         # touch every page at start-up (no page faults while serving)
/// huge_pages = false       # try 2 MiB pages, fall back silently
/// ```
#[derive(Clone, Debug, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct CpuTierOptions {
    /// Size of the tier.
    pub capacity: Capacity,
    /// The eviction policy.
    #[serde(default)]
    pub eviction: PolicyKind,
    /// Back the arena with this file (for example under `/dev/shm`) so another process can map
    /// the same rows; anonymous memory when absent.
    #[serde(default)]
    pub shared_memory: Option<PathBuf>,
    /// Queue store and removal events for `take_events`.
    #[serde(default = "default_true")]
    pub events: bool,
    /// Touch every page at start-up, so a machine that cannot back the arena fails at once and
    /// no copy or peer receive later pays a first-touch page fault (measured in
    /// `kvtier bench fetch-rtt`: faulting rows in on the way cost a fetch's p50 about 0.3 ms
    /// and held other threads off their core for milliseconds). An engine that registers the
    /// arena for DMA gets the same from the registration.
    #[serde(default)]
    pub prefault: bool,
    /// Ask for huge pages (anonymous arenas only), falling back to normal pages.
    #[serde(default)]
    pub huge_pages: bool,
}

fn default_true() -> bool {
    true
}

impl CpuTierOptions {
    /// Options for `capacity` with every other field at its default.
    #[must_use]
    pub fn new(capacity: Capacity) -> Self {
        Self {
            capacity,
            eviction: PolicyKind::default(),
            shared_memory: None,
            events: true,
            prefault: false,
            huge_pages: false,
        }
    }

    /// The same options with another eviction policy.
    #[must_use]
    pub fn with_eviction(mut self, eviction: PolicyKind) -> Self {
        self.eviction = eviction;
        self
    }
}

/// Why a CPU tier could not be built.
#[derive(Debug, thiserror::Error)]
pub enum CpuTierError {
    /// The capacity comes to zero chunks.
    #[error("cpu tier capacity {capacity} holds no chunk of {row_stride} bytes (zero capacity)")]
    ZeroCapacity {
        /// The capacity asked for.
        capacity: Capacity,
        /// Bytes one chunk's row takes.
        row_stride: usize,
    },
    /// The chunk size is zero.
    #[error("cpu tier chunk size must be positive")]
    ZeroChunkBytes,
    /// The arena would not fit in this machine's memory.
    #[error(
        "cpu tier capacity {chunks} chunks × {row_stride} bytes = {bytes} bytes exceeds the {limit} bytes of memory this process may use"
    )]
    TooLarge {
        /// Chunks asked for.
        chunks: u64,
        /// Bytes per row.
        row_stride: usize,
        /// Total bytes.
        bytes: u128,
        /// The memory limit found (physical memory, or the cgroup limit when lower).
        limit: u64,
    },
    /// An unknown eviction policy name.
    #[error(transparent)]
    UnknownPolicy(#[from] UnknownPolicy),
    /// The arena could not be created (mapping or pre-faulting failed).
    #[error("cannot create the cpu tier's arena: {0}")]
    Arena(#[from] ArenaError),
}

impl From<CpuTierError> for TierError {
    fn from(e: CpuTierError) -> Self {
        match e {
            CpuTierError::Arena(a) => Self::Arena(a),
            other => Self::Config(other.to_string()),
        }
    }
}

/// The memory this process may use: physical memory, or the cgroup v2 limit when lower.
#[must_use]
pub fn memory_limit_bytes() -> u64 {
    // SAFETY: sysconf has no memory-safety preconditions.
    let pages = unsafe { libc::sysconf(libc::_SC_PHYS_PAGES) };
    let phys = u64::try_from(pages)
        .unwrap_or(0)
        .saturating_mul(tiering_core::arena::page_size() as u64);
    let cgroup = std::fs::read_to_string("/sys/fs/cgroup/memory.max")
        .ok()
        .and_then(|s| s.trim().parse::<u64>().ok());
    match (phys, cgroup) {
        (0, Some(c)) => c,
        (0, None) => u64::MAX,
        (p, Some(c)) => p.min(c),
        (p, None) => p,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes_and_counts_parse() {
        let p = |s: &str| s.parse::<Capacity>();
        assert_eq!(p("2GiB"), Ok(Capacity::Bytes(2 << 30)));
        assert_eq!(p(" 512 MiB "), Ok(Capacity::Bytes(512 << 20)));
        assert_eq!(p("10GB"), Ok(Capacity::Bytes(10_000_000_000)));
        assert_eq!(p("1.5kib"), Ok(Capacity::Bytes(1536)));
        assert_eq!(p("4096"), Ok(Capacity::Chunks(4096)));
        assert_eq!(p("1_000 chunks"), Ok(Capacity::Chunks(1000)));
        for bad in ["", "GiB", "2 parsecs", "-1GiB", "1.2.3MB", "99999999999TiB"] {
            assert!(p(bad).is_err(), "{bad:?} should not parse");
        }
        assert_eq!(Capacity::Bytes(10 * 4096 + 5).chunks(4096), 10);
        assert_eq!(Capacity::Chunks(7).chunks(4096), 7);
    }

    #[test]
    fn options_deserialize_with_defaults_and_reject_unknown_fields() {
        let o: CpuTierOptions = toml::from_str("capacity = \"1MiB\"\neviction = \"arc\"").unwrap();
        assert_eq!(o.capacity, Capacity::Bytes(1 << 20));
        assert_eq!(o.eviction, PolicyKind::Arc);
        assert!(o.events && !o.prefault && o.shared_memory.is_none());
        let o: CpuTierOptions = toml::from_str("capacity = 64\nevents = false").unwrap();
        assert_eq!(
            (o.capacity, o.eviction, o.events),
            (Capacity::Chunks(64), PolicyKind::Lru, false)
        );

        let err = toml::from_str::<CpuTierOptions>("capacity = 4\nevictoin = \"lru\"").unwrap_err();
        assert!(err.to_string().contains("unknown field `evictoin`"), "{err}");
        let err = toml::from_str::<CpuTierOptions>("capacity = 4\neviction = \"lfu\"").unwrap_err();
        assert!(
            err.to_string().contains("unknown eviction policy \"lfu\""),
            "{err}"
        );
        let err = toml::from_str::<CpuTierOptions>("capacity = \"2 parsecs\"").unwrap_err();
        assert!(err.to_string().contains("invalid capacity"), "{err}");
        assert!(toml::from_str::<CpuTierOptions>("eviction = \"lru\"").is_err());
    }

    #[test]
    fn memory_limit_is_known_and_positive() {
        assert!(memory_limit_bytes() > 0);
    }
}
