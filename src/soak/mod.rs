//! `kvtier soak`: the simulator over cpu + disk + redis + p2p on two nodes for a given time,
//! while a seeded fault injector breaks what the tiers depend on, and checks that nothing is
//! lost, nothing wrong is served, every request completes, time to first token stays bounded,
//! memory and descriptors stay flat and nothing is left behind.
//!
//! - [`schedule`]: which fault when, from the seed;
//! - [`faults`]: the processes and files the soak breaks (its own `redis-server`, the peer
//!   node, a tmpfs for the disk tiers, the slab file, the arena) and how;
//! - [`checks`]: `/proc/self` samples, the disk tier's ledger of acknowledged stores, the slab
//!   audit, the TTFT bound, the scratch check;
//! - [`report`]: the summary table;
//! - [`command`]: the command itself, and the peer node's process (`kvtier soak-node`).

pub mod checks;
pub mod command;
pub mod faults;
pub mod report;
pub mod schedule;

pub use command::{NodeArgs, SoakArgs, SoakConfig, node_command, run_soak, soak_command};
pub use report::SoakReport;
pub use schedule::{Fault, FaultKind, Schedule};
