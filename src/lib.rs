//! # kvtier
//!
//! The library half of the `kvtier` package: the engine simulator behind `kvtier run` and the
//! benchmark harness behind `kvtier bench`.
//!
//! - [`sim`]: a scheduler loop that drives a [`tiering_core::TieringManager`] exactly as an
//!   inference engine's connector does, over seeded workloads, with a device KV pool in host
//!   memory and a worker thread doing the real device↔primary copies;
//! - [`peer`]: one node of a multi-process P2P setup;
//! - [`redis_admin`]: operator commands for a shared Redis tier
//!   (`kvtier redis invalidate`);
//! - [`scratch`]: per-run scratch space, removed on every exit path;
//! - [`host_buffer`]: host buffers aligned as an engine's staging memory is;
//! - [`metrics_endpoint`]: the Prometheus endpoint of `run` and `peer`;
//! - [`bench`](mod@bench): tier throughput next to its physical reference, measured in the same run;
//! - [`soak`]: the chaos soak behind `kvtier soak` (two nodes, seeded faults, checks).

pub mod bench;
pub mod check;
pub mod host_buffer;
pub mod metrics_endpoint;
pub mod peer;
pub mod redis_admin;
pub mod scratch;
pub mod sim;
pub mod soak;
