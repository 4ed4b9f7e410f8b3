//! The producer role of a session: serve the peer's lookups through the `ParentManager` (pin
//! before answering), keep the pinned chunks per round until the peer's fetch binds them, push
//! them over the data plane, and answer `transfer_done` with per-key success once the consumer
//! acknowledged every row.
//!
//! Lookups are served here; fetches, the chunks that wait for them and the ones they wait for
//! (the prefill→decode hand-off) live in [`fetch`], and what a fetched round owes the consumer in
//! [`demand`]. The role's state is defined here and only `fetch` reaches back into it, so the
//! dependencies run one way: `fetch` → this module → `demand`.

mod demand;
mod fetch;

use std::collections::{BTreeMap, HashMap};
use std::time::Instant;

use tiering_core::{KeyMap, LookupResult, OffloadKey, ParentManager, ReqContext, RequestId, arena::RowGrant};

use crate::core::Core;
use crate::stats::P2pCounters;
use crate::supply::Supply;
use crate::wire::{Message, encode_keys};

use demand::{Demand, InFlight};

struct ActiveLookup {
    round: u64,
    keys: Vec<OffloadKey>,
    answers: KeyMap<Option<bool>>,
    ctx: ReqContext,
    deadline: Instant,
}

/// One round of a peer request: chunks pinned by its lookups until a fetch binds them, then the
/// fetch's demand until every key is answered.
#[derive(Default)]
struct ServerRound {
    supply: KeyMap<Supply>,
    since: Option<Instant>,
    demand: Option<Demand>,
}

#[derive(Default)]
struct ServerReq {
    raw: Vec<(u64, Vec<OffloadKey>)>,
    active: Vec<ActiveLookup>,
    rounds: BTreeMap<u64, ServerRound>,
}

impl ServerReq {
    /// The consumer fetched `round`: its lookups read before the fetch and not answered yet
    /// (queued, or parked across serves) are answered as misses now. Served later, they would
    /// pin chunks into a round nobody fetches any more, held until the park deadline (60 s);
    /// the consumer's drain then waits for them.
    fn answer_stale_lookups(&mut self, core: &mut Core, kv: &str, round: u64) -> Vec<Message> {
        let miss = |keys: &[OffloadKey]| Message::LookupResp {
            kv_request_id: kv.to_owned(),
            round_seq: round,
            keys: encode_keys(keys),
            hits: vec![false; keys.len()],
        };
        let mut out = Vec::new();
        self.raw.retain(|(r, keys)| {
            let stale = *r == round;
            if stale {
                out.push(miss(keys));
            }
            !stale
        });
        for lu in std::mem::take(&mut self.active) {
            if lu.round == round {
                out.push(miss(&lu.keys));
                core.finish_ctxs.push(lu.ctx);
            } else {
                self.active.push(lu);
            }
        }
        out
    }
}

/// A fetch as received.
pub(crate) struct Fetch<'a> {
    /// The kv request id the fetch is for.
    pub(crate) kv: &'a str,
    /// The round whose pinned chunks the fetch binds.
    pub(crate) round: u64,
    /// The keys the consumer wants, in the order of `rows`.
    pub(crate) keys: &'a [OffloadKey],
    /// The consumer's reserved row for each key.
    pub(crate) rows: &'a [u32],
    /// Missing keys wait for later stores (a hand-off fetch).
    pub(crate) await_stores: bool,
}

/// A fetch that breaks the protocol.
pub(crate) struct FetchViolation(pub(crate) String);

/// The producer side of one session.
#[derive(Default)]
pub(crate) struct ServerRole {
    reqs: HashMap<String, ServerReq>,
    transfers: HashMap<u64, InFlight>,
}

/// Releases pinned chunks no fetch will take: each pin is dropped and its store job's key
/// resolved as not delivered, so the job can report once all its keys have an outcome.
pub(crate) fn release(core: &mut Core, supply: KeyMap<Supply>) {
    P2pCounters::add(&core.counters.supply_released, supply.len() as u64);
    for (key, s) in supply {
        drop(s.src);
        core.resolve_store_key(s.job, &key, false);
    }
}

impl ServerRole {
    /// Queues a peer's lookup; it is served (pinned and answered) at the next `serve`, which
    /// runs with the `ParentManager` at hand.
    pub(crate) fn on_lookup(&mut self, kv: String, round: u64, keys: Vec<OffloadKey>) {
        self.reqs.entry(kv).or_default().raw.push((round, keys));
    }

    /// Whether a lookup waits to be served.
    pub(crate) fn wants_serving(&self) -> bool {
        self.reqs
            .values()
            .any(|r| !r.raw.is_empty() || !r.active.is_empty())
    }

    /// Serves queued lookups and re-polls parked ones; returns the answers to send.
    pub(crate) fn serve(
        &mut self,
        core: &mut Core,
        peer: &str,
        parent: &mut dyn ParentManager,
    ) -> Vec<Message> {
        let mut out = Vec::new();
        let now = Instant::now();
        for (kv, req) in &mut self.reqs {
            for (round, keys) in std::mem::take(&mut req.raw) {
                let seq = core.lookup_seq();
                let ctx = ReqContext::new(RequestId::remote(peer, format!("{kv}/lu{seq}")));
                P2pCounters::bump(&core.counters.lookups_served);
                if let Err(e) = parent.on_new_request(&ctx) {
                    tracing::error!(error = %e, "announcing a peer lookup failed");
                }
                let mut answers: KeyMap<Option<bool>> = KeyMap::default();
                for k in &keys {
                    answers.entry(*k).or_insert(None);
                }
                req.active.push(ActiveLookup {
                    round,
                    keys,
                    answers,
                    ctx,
                    deadline: now + core.opts.deadlines.straggler(),
                });
            }
            let mut still = Vec::new();
            for mut lu in std::mem::take(&mut req.active) {
                let round = req.rounds.entry(lu.round).or_default();
                resolve_lookup(core, parent, &mut lu, round, now);
                if lu.answers.values().all(Option::is_some) {
                    let hits: Vec<bool> = lu
                        .keys
                        .iter()
                        .map(|k| lu.answers.get(k) == Some(&Some(true)))
                        .collect();
                    out.push(Message::LookupResp {
                        kv_request_id: kv.clone(),
                        round_seq: lu.round,
                        keys: encode_keys(&lu.keys),
                        hits,
                    });
                    if let Err(e) = parent.on_request_finished(&lu.ctx) {
                        tracing::error!(error = %e, "finishing a peer lookup failed");
                    }
                } else {
                    still.push(lu);
                }
            }
            req.active = still;
            req.rounds
                .retain(|_, r| !r.supply.is_empty() || r.demand.is_some());
        }
        out
    }

    /// Transfers in flight.
    pub(crate) fn transfers_in_flight(&self) -> usize {
        self.transfers.len()
    }

    /// Whether anything is pinned or in flight for the peer.
    pub(crate) fn has_work(&self) -> bool {
        !self.transfers.is_empty()
            || self
                .reqs
                .values()
                .any(|r| !r.rounds.is_empty() || !r.raw.is_empty() || !r.active.is_empty())
    }
}

/// Answers what can be answered now: hits are pinned (one store job per call) before the
/// answer can leave; pending keys become misses at the straggler deadline.
fn resolve_lookup(
    core: &mut Core,
    parent: &mut dyn ParentManager,
    lu: &mut ActiveLookup,
    round: &mut ServerRound,
    now: Instant,
) {
    if round.demand.is_some() {
        // The round was fetched before this lookup was served (a fetch is bound when read, a
        // lookup waits for the next serve): nothing pinned now could be fetched, and a pin
        // left in a fetched round was never released (its store job kept the tier pending).
        for v in lu.answers.values_mut() {
            v.get_or_insert(false);
        }
        return;
    }
    let mut hits = Vec::new();
    let pending: Vec<OffloadKey> = lu
        .answers
        .iter()
        .filter(|(_, v)| v.is_none())
        .map(|(k, _)| *k)
        .collect();
    for k in pending {
        if round.supply.contains_key(&k) {
            lu.answers.insert(k, Some(true));
            continue;
        }
        match parent.lookup(&k, &lu.ctx) {
            Ok(LookupResult::Hit) => hits.push(k),
            Ok(LookupResult::Miss) => {
                lu.answers.insert(k, Some(false));
            }
            Ok(LookupResult::HitPending | LookupResult::Retry) => {
                if now >= lu.deadline {
                    lu.answers.insert(k, Some(false));
                }
            }
            Err(e) => {
                tracing::error!(error = %e, "peer lookup failed");
                lu.answers.insert(k, Some(false));
            }
        }
    }
    if hits.is_empty() {
        return;
    }
    match parent.create_store_job(&hits, &lu.ctx) {
        Ok(job) => {
            let reads = match job.rows {
                RowGrant::Read(r) if r.len() == job.keys.len() => r,
                _ => {
                    tracing::error!(job = %job.id, "a peer store job came without read grants");
                    core.add_store_job(job.id, job.keys.clone());
                    for k in &job.keys {
                        core.resolve_store_key(job.id, k, false);
                        lu.answers.insert(*k, Some(false));
                    }
                    return;
                }
            };
            core.add_store_job(job.id, job.keys.clone());
            P2pCounters::add(&core.counters.keys_offered, job.keys.len() as u64);
            round.since.get_or_insert(now);
            for (k, src) in job.keys.iter().zip(reads) {
                lu.answers.insert(*k, Some(true));
                round.supply.insert(*k, Supply { job: job.id, src });
            }
        }
        Err(e) => {
            tracing::warn!(error = %e, "pinning peer hits failed; answering miss");
            for k in hits {
                lu.answers.insert(k, Some(false));
            }
        }
    }
}
