//! `kvtier run --nodes N`: N simulated engines in one process, each with its own manager and
//! primary tier, built from one chain whose shared tier (a Redis server) they all use.
//!
//! The workload is dealt round-robin (request `i` goes to node `i mod N`, at its original
//! arrival time), so the nodes see the same shared prefixes and the same chat sessions turn by
//! turn, as a fleet without session affinity does. The engines run at once, one thread each.
//!
//! Who stored a chunk is known only to the simulator: a [`StoreLedger`] records, per key, the
//! nodes whose engine stored it into its own primary tier. When a node loads a chunk promoted
//! from a secondary tier, the ledger says whether that node ever stored it itself; if not and
//! another node did, the chunk's tokens count as **cross-node**: served to this node from what
//! another one stored. Chunks no node of the run stored (an earlier run's, still in the server)
//! are counted apart. Both are counted when the load is prepared (a load that then fails is
//! recomputed, and its tokens are not served, so the counts are upper bounds by those chunks —
//! the report's `failed load chunks` says how many).

use std::fmt;
use std::sync::Arc;

use serde::Serialize;

use super::chain::ChainFactory;
use super::config::SimConfig;
use super::engine::{Engine, check_workload};
use super::error::SimError;
use super::offload::Offload;
use super::report::Report;
use super::workload::Workload;
// Part of a multi-node run's interface; defined apart because each node's `Offload` records
// into the ledger and reads it.
pub use super::store_ledger::{MAX_NODES, StoreLedger, Storer};

/// One node's share of a multi-node run.
#[derive(Clone, Debug, Serialize)]
pub struct NodeReport {
    /// The node's index.
    pub node: usize,
    /// Prompt tokens this node loaded from a secondary tier that only other nodes had stored.
    pub cross_node_tokens: u64,
    /// Prompt tokens this node loaded from a secondary tier that no node of the run stored.
    pub foreign_tokens: u64,
    /// The node's full report (its own engine, manager and tiers).
    pub report: Report,
}

/// The report of `kvtier run --nodes N`.
#[derive(Clone, Debug, Serialize)]
pub struct NodesReport {
    /// What ran, before it was dealt to the nodes.
    pub workload: String,
    /// The chain every node built.
    pub chain: Vec<String>,
    /// Per node.
    pub nodes: Vec<NodeReport>,
}

impl NodesReport {
    /// Cross-node tokens over every node.
    #[must_use]
    pub fn cross_node_tokens(&self) -> u64 {
        self.nodes.iter().map(|n| n.cross_node_tokens).sum()
    }

    /// Whether every node's consistency identities hold.
    #[must_use]
    pub fn identities_hold(&self) -> bool {
        self.nodes.iter().all(|n| n.report.identities_hold())
    }
}

/// Deals `workload` round-robin to `nodes` engines.
fn deal(workload: &Workload, nodes: usize) -> Vec<Workload> {
    (0..nodes)
        .map(|n| Workload {
            label: format!("{} — node {n} of {nodes}", workload.label),
            requests: workload.requests.iter().skip(n).step_by(nodes).cloned().collect(),
        })
        .collect()
}

/// Runs `workload` dealt over `nodes` engines at once, each over its own chain from `factory`
/// (which must share a tier between its builds for the nodes to share anything), and reports per
/// node. With `cfg.compare_baseline`, each node then runs its share with offloading off.
///
/// # Errors
/// `nodes` out of range, a workload too small to give every node a request, a chain that cannot
/// be built, or a node's run failing (the first failure is returned; the other nodes finish).
pub fn run_nodes(
    factory: &dyn ChainFactory,
    cfg: &SimConfig,
    workload: &Workload,
    nodes: usize,
) -> Result<NodesReport, SimError> {
    if !(1..=MAX_NODES).contains(&nodes) {
        return Err(SimError::InvalidSetting {
            name: "nodes",
            reason: format!("{nodes} is not between 1 and {MAX_NODES}"),
        });
    }
    cfg.validate()?;
    check_workload(cfg, workload)?;
    if workload.requests.len() < nodes {
        return Err(SimError::InvalidSetting {
            name: "nodes",
            reason: format!(
                "{} requests cannot give each of {nodes} nodes one",
                workload.requests.len()
            ),
        });
    }
    let shares = deal(workload, nodes);
    let mut chains = Vec::with_capacity(nodes);
    for _ in 0..nodes {
        chains.push(factory.build(cfg.chunk_bytes).map_err(SimError::Chain)?);
    }
    let chain_names: Vec<String> = chains
        .first()
        .map(|c| {
            std::iter::once(c.primary.clone())
                .chain(c.secondaries.iter().cloned())
                .collect()
        })
        .unwrap_or_default();
    let ledger = Arc::new(StoreLedger::default());
    let results: Vec<Result<NodeReport, SimError>> = std::thread::scope(|scope| {
        let handles: Vec<_> = chains
            .into_iter()
            .zip(&shares)
            .enumerate()
            .map(|(node, (chain, share))| {
                let ledger = Arc::clone(&ledger);
                std::thread::Builder::new()
                    .name(format!("kvtier-node-{node}"))
                    .spawn_scoped(scope, move || run_node(node, chain, cfg, share, ledger))
            })
            .collect();
        handles
            .into_iter()
            .map(|h| match h {
                Ok(h) => h
                    .join()
                    .unwrap_or_else(|_| Err(SimError::Worker("a node's engine thread panicked".into()))),
                Err(e) => Err(SimError::Worker(format!("cannot start a node's thread: {e}"))),
            })
            .collect()
    });
    let nodes = results.into_iter().collect::<Result<Vec<_>, _>>()?;
    Ok(NodesReport {
        workload: workload.label.clone(),
        chain: chain_names,
        nodes,
    })
}

fn run_node(
    node: usize,
    chain: super::Chain,
    cfg: &SimConfig,
    share: &Workload,
    ledger: Arc<StoreLedger>,
) -> Result<NodeReport, SimError> {
    let off = Offload::new(chain.manager, chain.arena, chain.secondaries.len())?.on_node(node, ledger);
    let (metrics, off) = Engine::new(cfg, &share.requests, Some(off), None)?.run()?;
    let Some(mut off) = off else {
        return Err(SimError::Worker("the engine lost its manager".into()));
    };
    let stats = off.stats()?;
    let control_thread = stats.manager.sweeps > 0 && off.control_thread_running();
    off.shutdown()?;
    let baseline = if cfg.compare_baseline {
        Some(Engine::new(cfg, &share.requests, None, None)?.run()?.0)
    } else {
        None
    };
    let tpc = cfg.tokens_per_chunk as u64;
    Ok(NodeReport {
        node,
        cross_node_tokens: off.cross_node_chunks * tpc,
        foreign_tokens: off.foreign_chunks * tpc,
        report: Report::build(
            share.label.clone(),
            cfg,
            &metrics,
            &stats,
            control_thread,
            baseline.as_ref(),
        ),
    })
}

#[allow(clippy::cast_precision_loss)] // shares of token counts, for display
fn pct(part: u64, whole: u64) -> f64 {
    if whole == 0 {
        0.0
    } else {
        100.0 * part as f64 / whole as f64
    }
}

impl fmt::Display for NodesReport {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        writeln!(
            f,
            "kvtier run --nodes {} — workload {}, dealt round-robin; every node: chain {}",
            self.nodes.len(),
            self.workload,
            self.chain.join(" → ")
        )?;
        let tier_names: Vec<&str> = self.chain.iter().map(String::as_str).collect();
        let baseline = self
            .nodes
            .iter()
            .all(|n| n.report.tokens_not_recomputed.is_some());
        write!(
            f,
            "  {:>5} {:>9} {:>12} {:>10}",
            "node", "requests", "prompt tok", "device"
        )?;
        for t in &tier_names {
            write!(f, " {t:>10}")?;
        }
        write!(
            f,
            " {:>10} {:>12} {:>9} {:>8}",
            "computed", "cross-node", "share", "foreign"
        )?;
        if baseline {
            write!(f, " {:>10}", "saved")?;
        }
        writeln!(f)?;
        let mut total = vec![0u64; tier_names.len() + 6];
        let mut total_saved = 0i64;
        for n in &self.nodes {
            let r = &n.report;
            let mut row = vec![r.requests, r.prompt_tokens, r.source_tokens("device cache")];
            row.extend(tier_names.iter().map(|t| r.source_tokens(t)));
            row.extend([r.source_tokens("computed"), n.cross_node_tokens, n.foreign_tokens]);
            for (t, v) in total.iter_mut().zip(&row) {
                *t += v;
            }
            let saved = r.tokens_not_recomputed.filter(|_| baseline);
            total_saved += saved.unwrap_or(0);
            write_row(f, &n.node.to_string(), &row, saved)?;
        }
        write_row(f, "total", &total, baseline.then_some(total_saved))?;
        writeln!(
            f,
            "  cross-node: prompt tokens a node loaded from a shared tier that only another node had \
             stored; share: of the node's prompt tokens; foreign: stored by no node of this run \
             (an earlier run's chunks in the server){}",
            if baseline {
                "; saved: prompt tokens the node's share computes with offloading off and not with it"
            } else {
                ""
            }
        )?;
        for n in &self.nodes {
            if !n.report.identities_hold() {
                writeln!(f, "\n  node {}: consistency identities do NOT hold:", n.node)?;
                for i in n.report.identities.iter().filter(|i| !i.holds) {
                    writeln!(f, "    {}: {} ≠ {}", i.name, i.left, i.right)?;
                }
            }
        }
        Ok(())
    }
}

/// `row` is requests, prompt tokens, device, one per tier, computed, cross-node, foreign;
/// `saved` the tokens not recomputed against the offloading-off baseline, when it ran.
fn write_row(f: &mut fmt::Formatter<'_>, label: &str, row: &[u64], saved: Option<i64>) -> fmt::Result {
    let n = row.len();
    write!(f, "  {label:>5}")?;
    write!(f, " {:>9} {:>12}", row[0], row[1])?;
    for v in &row[2..n - 2] {
        write!(f, " {v:>10}")?;
    }
    write!(
        f,
        " {:>12} {:>8.1}% {:>8}",
        row[n - 2],
        pct(row[n - 2], row[1]),
        row[n - 1]
    )?;
    match saved {
        Some(s) => writeln!(f, " {s:>10}"),
        None => writeln!(f),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::sim::{WorkloadKind, WorkloadSpec};

    #[test]
    fn dealing_interleaves_every_request_exactly_once() {
        let w = Workload::generate(&WorkloadSpec::new(WorkloadKind::SharedPrefix, 7, 1));
        let shares = deal(&w, 3);
        assert_eq!(
            shares.iter().map(|s| s.requests.len()).collect::<Vec<_>>(),
            [3, 2, 2]
        );
        assert_eq!(shares[1].requests[0], w.requests[1]);
        assert_eq!(shares[0].requests[2], w.requests[6]);
    }

    #[test]
    fn node_counts_out_of_range_are_named() {
        let w = Workload::generate(&WorkloadSpec::new(WorkloadKind::Chat, 2, 1));
        let factory = crate::sim::cpu_chain(1 << 20, tier_cpu::PolicyKind::Lru);
        for n in [0, MAX_NODES + 1, 3] {
            let err = run_nodes(&factory, &SimConfig::default(), &w, n)
                .unwrap_err()
                .to_string();
            assert!(err.contains("nodes"), "{err}");
        }
    }
}
