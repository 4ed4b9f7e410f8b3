//! # tier-redis
//!
//! A shared remote secondary tier on Redis or Valkey, standalone or cluster: a fleet of
//! engines, each with its own CPU tier, shares one KV cache that outlives any one of them.
//!
//! - **Keys**: `kvtier:<namespace>:<layout>:<key hex>`. The namespace separates models or
//!   deployments sharing a server; the layout (16 hex digits) is derived from the chunk size and
//!   the `layout_fingerprint` option, so two layouts never read each other's chunks. No hash
//!   tag: a cluster spreads chunks over every master. See [`format`](mod@format).
//! - **Values**: an 88-byte header (magic, format version, chunk size, layout id, the key, and
//!   an xxh3 checksum over header and payload) followed by the chunk. A load whose value is
//!   missing, short, of another layout or key, or fails its checksum fails that key only
//!   (`Partial`); its bytes never reach the row, and the bad value is deleted.
//! - **Lookups never block the scheduler**: an unknown key answers `Retry` and is queued; the
//!   queue goes to a worker as one pipelined `EXISTS` batch at the end of the step (or once it
//!   reaches `max_lookup_batch`); the answer is cached for `presence_ttl`. A question left
//!   unanswered for `lookup_timeout` becomes a `Miss`. A successful store marks its keys present.
//! - **Stores and loads** are split into pipelined `SET`/`GET` batches run by `workers`
//!   threads, each with its own connection: a job is spread over every worker (one batch each)
//!   down to 512 KiB per batch and up to `pipeline_bytes`, so the server parses one batch
//!   while the others' replies travel. Connections turn Nagle's algorithm off. Queues are
//!   bounded (`max_queued_jobs` per worker, in batches): a job that does not fit is failed at
//!   once and counted. On a
//!   standalone server a worker encodes a batch's commands itself, once, into a buffer it
//!   reuses, sends a store's values as it encodes them, and checks each `GET` reply into its
//!   row as it arrives.
//! - **A slow or dead server degrades to misses**: every read and write is bounded by
//!   `io_timeout` (connecting by `connect_timeout`); after a connection failure the workers
//!   back off (`reconnect_backoff`, doubling up to `reconnect_backoff_max`) and fail work at
//!   once meanwhile; warnings are rate-limited and failures counted. `drain_jobs` cancels
//!   queued work and waits only for batches already on the wire, which the timeouts bound.
//!   While the server counts as unreachable (a connection failure since the last successful
//!   round trip) every lookup answers `Miss`, whatever the presence cache holds, and a load
//!   that fails drops its keys' cached `Hit`s. A worker probes the server (`PING`) each time
//!   the backoff expires; when it answers, the cache is cleared (a restarted server may have
//!   lost its keys) and `SecondaryTier::health` reports the recovery, so the manager uses the
//!   tier again at once.
//! - **Eviction is the server's.** The tier never deletes chunks to make room. Run the server
//!   with a memory limit and an all-keys eviction policy:
//!
//!   ```text
//!   maxmemory 64gb
//!   maxmemory-policy allkeys-lru     # or allkeys-lfu for skewed reuse
//!   save ""                          # a cache: no RDB snapshots
//!   appendonly no
//!   ```
//!
//!   With `noeviction` a full server refuses `SET`s (counted as `server_errors`, stores fail);
//!   `volatile-*` policies evict nothing because the tier sets no TTLs. An evicted key is a
//!   miss (a load that finds it gone fails that key). The stats report the server's
//!   `used_memory`, `maxmemory`, `evicted_keys` and key count (`INFO`, every `info_interval`,
//!   summed over the masters).
//! - **Credentials**: `password_env` names an environment variable holding the password (never
//!   the password itself); a missing variable is an error when the tier is built, and refused
//!   credentials are an error when it connects.
//! - **TLS** (`rediss://host:port`, the `tls` feature, rustls with the ring provider): server
//!   certificates are verified against the system's trust store and the webpki roots, so a
//!   private CA goes into the host's trust store; `rediss://host:port/#insecure` skips
//!   verification (test servers with self-signed certificates only).
//! - **Invalidation**: [`invalidate_namespace`] deletes every key of a namespace (`SCAN` +
//!   `UNLINK` in batches, on every master); the `kvtier redis invalidate` command uses it. Do
//!   it after a model or weights update that keeps the layout.
//!
//! Registered as type `redis`; the final binary must name the crate (`use tier_redis as _;`).
//! Architecture: `docs/ARCHITECTURE.md`.
//!
//! ```toml
//! [[secondary]]
//! type = "redis"
//! url = "redis://127.0.0.1:6379"     # or: urls = ["redis://10.0.0.1:7000", …] and cluster = true
//! namespace = "llama-3-8b"
//! layout_fingerprint = "bf16-tp1"
//! password_env = "KVTIER_REDIS_PASSWORD"
//! ```

mod conn;
pub mod error;
pub mod format;
mod info;
mod invalidate;
pub mod options;
mod packed;
mod presence;
mod registration;
mod shared;
mod split;
mod tier;
mod worker;

pub use conn::with_nodelay;
pub use error::RedisTierError;
pub use format::{KeyScheme, LayoutId};
pub use info::ServerFigures;
pub use invalidate::invalidate_namespace;
pub use options::RedisTierOptions;
pub use tier::RedisTier;
