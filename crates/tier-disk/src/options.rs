//! The disk tier's options table (`[[secondary]] type = "disk"`) and the arena geometry it is
//! opened with.

use std::fmt;
use std::path::PathBuf;

use serde::Deserialize;
use serde::de::{self, Deserializer, Visitor};
use tiering_core::arena::ChunkArena;
use tiering_core::options::{ByteSize, HumanDuration};

/// When the tier calls `fdatasync` on the slab file.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum SyncPolicy {
    /// Never: a chunk becomes visible as soon as its write returns. A `kill -9` loses nothing
    /// that was acknowledged (the page cache survives the process); a power loss may lose recent
    /// chunks, which the checksums then turn into misses. The right trade-off for a cache.
    #[default]
    Never,
    /// Once per job: every slot of a store job is written, one `fdatasync`, then all of them
    /// become visible together.
    Batch,
    /// After every slot: write, `fdatasync`, then the chunk becomes visible.
    Always,
}

/// Whether slab I/O bypasses the page cache (`O_DIRECT`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum DirectIo {
    /// Use `O_DIRECT` when the filesystem accepts it and the chunk size is 4 KiB aligned;
    /// otherwise buffered I/O, with a log line saying why.
    #[default]
    Auto,
    /// Require `O_DIRECT`: opening fails when it cannot be used.
    On,
    /// Always buffered I/O.
    Off,
}

impl<'de> Deserialize<'de> for DirectIo {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        struct DirectVisitor;

        impl Visitor<'_> for DirectVisitor {
            type Value = DirectIo;

            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("true, false or \"auto\"")
            }

            fn visit_bool<E: de::Error>(self, v: bool) -> Result<DirectIo, E> {
                Ok(if v { DirectIo::On } else { DirectIo::Off })
            }

            fn visit_str<E: de::Error>(self, v: &str) -> Result<DirectIo, E> {
                match v.to_ascii_lowercase().as_str() {
                    "auto" => Ok(DirectIo::Auto),
                    "true" | "on" => Ok(DirectIo::On),
                    "false" | "off" => Ok(DirectIo::Off),
                    _ => Err(E::invalid_value(de::Unexpected::Str(v), &self)),
                }
            }
        }

        deserializer.deserialize_any(DirectVisitor)
    }
}

const fn default_io_threads() -> usize {
    4
}

const fn default_true() -> bool {
    true
}

fn default_name() -> String {
    "disk".to_owned()
}

/// Options of a [`DiskTier`](crate::DiskTier), as read from its TOML table.
///
/// ```toml
/// [[secondary]]
/// type = "disk"
/// path = "/var/tmp/kvtier"
/// capacity = "64GiB"
/// sync = "never"        # never | batch | always
/// direct_io = "auto"    # true | false | "auto"
/// io_threads = 4
/// ```
#[derive(Clone, Debug, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct DiskTierOptions {
    /// Directory holding the slab file; created when missing.
    pub path: PathBuf,
    /// Upper bound of the slab file's size, seal blocks included.
    pub capacity: ByteSize,
    /// The `fdatasync` policy.
    #[serde(default)]
    pub sync: SyncPolicy,
    /// Whether to bypass the page cache.
    #[serde(default)]
    pub direct_io: DirectIo,
    /// Worker threads doing the reads and writes (1 to 256).
    #[serde(default = "default_io_threads")]
    pub io_threads: usize,
    /// The tier's name in stats, events and logs.
    #[serde(default = "default_name")]
    pub name: String,
    /// Check at open that the filesystem has room for the whole capacity (a clear `NoSpace`
    /// error otherwise, leaving nothing behind), then reserve the file with `fallocate` in
    /// 64 MiB steps as slots are first used, so a large, mostly empty tier does not take its
    /// whole capacity on disk. `false`: no check, the file grows sparse as it is written.
    #[serde(default = "default_true")]
    pub preallocate: bool,
    /// When the slab on disk was written for another chunk size or format version: `false`
    /// (default) refuses to open; `true` deletes its contents and starts empty.
    #[serde(default)]
    pub wipe_on_mismatch: bool,
    /// Fault injection for benchmarks: every slot read or write submission sleeps this long
    /// on its I/O thread before it touches the file, emulating a slow device (`"5ms"`). Zero,
    /// the default, adds nothing; a production chain never sets it.
    #[serde(default)]
    pub inject_io_delay: HumanDuration,
}

impl DiskTierOptions {
    /// Options with defaults for everything but the path and the capacity.
    #[must_use]
    pub fn new(path: impl Into<PathBuf>, capacity: u64) -> Self {
        Self {
            path: path.into(),
            capacity: ByteSize(capacity),
            sync: SyncPolicy::default(),
            direct_io: DirectIo::default(),
            io_threads: default_io_threads(),
            name: default_name(),
            preallocate: true,
            wipe_on_mismatch: false,
            inject_io_delay: HumanDuration::default(),
        }
    }
}

/// The chunk geometry the tier stores: the arena's payload size and row stride.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct DiskGeometry {
    /// Payload bytes per chunk (what a row grant exposes).
    pub chunk_bytes: usize,
    /// The arena's row stride (page aligned, at least `chunk_bytes`).
    pub row_stride: usize,
}

impl DiskGeometry {
    /// The geometry of `arena`.
    #[must_use]
    pub fn of_arena(arena: &ChunkArena) -> Self {
        Self {
            chunk_bytes: arena.chunk_bytes(),
            row_stride: arena.row_stride(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn full_table_deserialises() {
        let opts: DiskTierOptions = toml::from_str(
            r#"
            path = "/var/tmp/kvtier"
            capacity = "64GiB"
            sync = "batch"
            direct_io = false
            io_threads = 8
            "#,
        )
        .unwrap();
        assert_eq!(opts.capacity, ByteSize(64 << 30));
        assert_eq!(opts.sync, SyncPolicy::Batch);
        assert_eq!(opts.direct_io, DirectIo::Off);
        assert_eq!(opts.io_threads, 8);
        assert_eq!(opts.name, "disk");
        assert!(opts.preallocate);
        assert!(!opts.wipe_on_mismatch);
        assert_eq!(opts.inject_io_delay.get(), std::time::Duration::ZERO);
    }

    #[test]
    fn an_injected_io_delay_is_read_with_its_unit() {
        let opts: DiskTierOptions =
            toml::from_str("path = \"/x\"\ncapacity = 1\ninject_io_delay = \"5ms\"").unwrap();
        assert_eq!(opts.inject_io_delay.get(), std::time::Duration::from_millis(5));
        let bare = toml::from_str::<DiskTierOptions>("path = \"/x\"\ncapacity = 1\ninject_io_delay = 5");
        assert!(bare.is_err(), "a delay needs a unit");
    }

    #[test]
    fn defaults_and_auto_direct_io() {
        let opts: DiskTierOptions =
            toml::from_str("path = \"/tmp/x\"\ncapacity = 1048576\ndirect_io = \"auto\"").unwrap();
        assert_eq!(opts, DiskTierOptions::new("/tmp/x", 1 << 20));
    }

    #[test]
    fn unknown_keys_and_bad_values_are_refused() {
        let unknown = toml::from_str::<DiskTierOptions>("path = \"/x\"\ncapacity = 1\nfsync = \"always\"");
        assert!(unknown.unwrap_err().to_string().contains("fsync"));
        assert!(
            toml::from_str::<DiskTierOptions>("path = \"/x\"\ncapacity = 1\nsync = \"sometimes\"").is_err()
        );
        assert!(toml::from_str::<DiskTierOptions>("path = \"/x\"\ncapacity = \"lots\"").is_err());
        assert!(
            toml::from_str::<DiskTierOptions>("path = \"/x\"\ncapacity = 1\ndirect_io = \"maybe\"").is_err()
        );
        assert!(
            toml::from_str::<DiskTierOptions>("capacity = 1").is_err(),
            "path is required"
        );
    }
}
