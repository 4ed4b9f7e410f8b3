//! # tier-example — the template for kvtier tier authors
//!
//! A complete secondary tier written only against the public APIs of `tiering-core` (the
//! contracts) and `tier-kit` (the threaded-tier plumbing): a bounded in-memory store with
//! least-recently-used eviction, cache events, stats, an I/O worker thread, and a small peer
//! protocol that exercises `serve_external_requests`. Copy this crate to start your own tier.
//!
//! ## The pieces
//! - [`tier::ExampleOptions`] — the tier's options, deserialised from its chain-file section with
//!   `#[serde(deny_unknown_fields)]` through `tiering_core::options::parse_options`, so a typo is
//!   an error naming the key and its line. Sizes use `tiering_core::options::ByteSize`
//!   (`"64MiB"`).
//! - [`tier::ExampleTier`] — the `SecondaryTier` implementation. Manager-facing methods return at
//!   once; copies run on the tier's worker thread, which reports every job exactly once and wakes
//!   the control plane through the `ControlWaker`.
//! - [`store::LruStore`] — the storage: `tiering-core`'s `LruMap`, bounded by a chunk count.
//! - the plumbing (worker thread, exactly-once results, bounded shutdown) comes from `tier-kit`.
//! - [`peer`] — how a peer asks this node for chunks; the tier answers through the
//!   `ParentManager`, so a question is answered from the whole node (the primary tier and the
//!   other secondaries), not only from this tier.
//! - [`tier::build`] — the factory, registered twice below with [`tier::validate`], which checks
//!   a table without building anything, for `kvtier check` (in the `.so` it is the library's
//!   validate entry, tier ABI 5: `kvtier check` loads the library and calls it, and no tier is
//!   built):
//!
//! ```ignore
//! tiering_core::register_tier!(secondary "example" => tier::build, validate = tier::validate); // linked in
//! tiering_plugin::export_tier!("example" => tier::build, validate = tier::validate);             // loaded from the .so
//! ```
//!
//! ## Using it
//! Linked in: depend on the crate and name it once in the final binary (`use tier_example as
//! _;`) so the linker keeps the registration; then `type = "example"` in a chain. Loaded at run
//! time: `cargo build -p tier-example --release` and point a chain at the shared library:
//!
//! ```toml
//! [[secondary]]
//! type = "example"
//! library = "target/release/libtier_example.so"
//! capacity = "256MiB"
//! inbox = "/tmp/kvtier-example.sock"   # optional: serve peers
//! ```
//!
//! The same code runs both ways: in the library, `export_tier!` wraps the tier behind a C ABI,
//! and it receives ordinary `TransferJob`s whose row grants lock the host's arena.

pub mod peer;
pub mod store;
pub mod tier;

pub use tier::{ExampleOptions, ExampleTier, build};

tiering_core::register_tier!(secondary "example" => tier::build, validate = tier::validate);
tiering_plugin::export_tier!("example" => tier::build, validate = tier::validate);
