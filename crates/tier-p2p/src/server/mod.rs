//! The producer role of a session: serve the peer's lookups through the `ParentManager` (pin
//! before answering), keep the pinned chunks per round until the peer's fetch binds them, push
//! them over the data plane, and answer `transfer_done` with per-key success once the consumer
//! acknowledged every row.

use std::collections::{BTreeMap, HashMap};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Instant;

use tiering_core::{
    JobId, KeyMap, LookupResult, OffloadKey, ParentManager, ReqContext, RequestId, RowGrant, RowRead,
};

use crate::core::Core;
use crate::dataplane::frame::ChunkStatus;
use crate::dataplane::sender::{SenderHandle, WriteItem, WriteJob};
use crate::stats::P2pCounters;
use crate::wire::{Message, encode_keys};

/// A pinned chunk waiting for a fetch.
pub(crate) struct Supply {
    pub(crate) job: JobId,
    pub(crate) src: RowRead,
}

struct ActiveLookup {
    round: u64,
    keys: Vec<OffloadKey>,
    answers: KeyMap<Option<bool>>,
    ctx: ReqContext,
    deadline: Instant,
}

struct Transfer {
    id: u64,
    keys: Vec<OffloadKey>,
    key_ok: Vec<bool>,
    /// (position in the fetch, store job) of each chunk sent, in send order.
    sent: Vec<(usize, JobId)>,
    cancel: Arc<AtomicBool>,
    abort_requested: bool,
}

#[derive(Default)]
struct ServerRound {
    supply: KeyMap<Supply>,
    since: Option<Instant>,
    transfer: Option<Transfer>,
}

#[derive(Default)]
struct ServerReq {
    raw: Vec<(u64, Vec<OffloadKey>)>,
    active: Vec<ActiveLookup>,
    rounds: BTreeMap<u64, ServerRound>,
}

/// A fetch that breaks the protocol.
pub(crate) struct FetchViolation(pub(crate) String);

/// The producer side of one session.
#[derive(Default)]
pub(crate) struct ServerRole {
    reqs: HashMap<String, ServerReq>,
    transfers: HashMap<u64, (String, u64)>,
}

pub(crate) fn release(core: &mut Core, supply: KeyMap<Supply>) {
    P2pCounters::add(&core.counters.supply_released, supply.len() as u64);
    for (key, s) in supply {
        drop(s.src);
        core.resolve_store_key(s.job, &key, false);
    }
}

impl ServerRole {
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
                .retain(|_, r| !r.supply.is_empty() || r.transfer.is_some());
        }
        out
    }

    /// A fetch: bind the round's pinned chunks to the consumer's rows and push them.
    pub(crate) fn on_fetch(
        &mut self,
        core: &mut Core,
        sender: Option<&SenderHandle>,
        kv: &str,
        round: u64,
        keys: &[OffloadKey],
        rows: &[u32],
    ) -> Result<Vec<Message>, FetchViolation> {
        let req = self.reqs.entry(kv.to_owned()).or_default();
        if keys.is_empty() {
            // The consumer is done with this id: release every round nobody fetched.
            for lu in std::mem::take(&mut req.active) {
                core.finish_ctxs.push(lu.ctx);
            }
            req.raw.clear();
            let idle: Vec<u64> = req
                .rounds
                .iter()
                .filter(|(_, r)| r.transfer.is_none())
                .map(|(k, _)| *k)
                .collect();
            for r in idle {
                if let Some(round) = req.rounds.remove(&r) {
                    release(core, round.supply);
                }
            }
            return Ok(Vec::new());
        }
        let mut round_state = req.rounds.remove(&round).unwrap_or_default();
        if round_state.transfer.is_some() {
            req.rounds.insert(round, round_state);
            return Err(FetchViolation(format!("a second fetch for {kv} round {round}")));
        }
        if round_state.supply.is_empty()
            && let Some(parked) = core.parked.remove(kv)
        {
            // A `remote_decoder` request: its stored chunks were parked for this fetch.
            for (key, s) in parked.items {
                if let Some(dup) = round_state.supply.insert(key, s) {
                    let mut one = KeyMap::default();
                    one.insert(key, dup);
                    release(core, one);
                }
            }
        }
        let mut key_ok = vec![false; keys.len()];
        let mut items = Vec::new();
        let mut sent = Vec::new();
        for (i, (key, &row)) in keys.iter().zip(rows).enumerate() {
            if let Some(s) = round_state.supply.remove(key) {
                sent.push((i, s.job));
                items.push(WriteItem {
                    key: *key,
                    dst_row: row,
                    src: s.src,
                });
            } else {
                key_ok[i] = false;
            }
        }
        // Chunks answered but not fetched: the consumer chose not to take them.
        release(core, std::mem::take(&mut round_state.supply));
        if items.is_empty() {
            return Ok(vec![Message::TransferDone {
                kv_request_id: kv.to_owned(),
                round_seq: round,
                success: false,
                key_ok,
            }]);
        }
        let transfer_id = core.transfer_id();
        let cancel = Arc::new(AtomicBool::new(false));
        let job = WriteJob {
            transfer_id,
            req: kv.to_owned(),
            round,
            items,
            cancel: Arc::clone(&cancel),
        };
        let submitted = match sender {
            Some(s) => s.submit(job),
            None => Err(job),
        };
        if let Err(job) = submitted {
            for (item, (_, jid)) in job.items.into_iter().zip(&sent) {
                let key = item.key;
                drop(item.src);
                core.resolve_store_key(*jid, &key, false);
            }
            return Ok(vec![Message::TransferDone {
                kv_request_id: kv.to_owned(),
                round_seq: round,
                success: false,
                key_ok,
            }]);
        }
        round_state.transfer = Some(Transfer {
            id: transfer_id,
            keys: keys.to_vec(),
            key_ok,
            sent,
            cancel,
            abort_requested: false,
        });
        req.rounds.insert(round, round_state);
        self.transfers.insert(transfer_id, (kv.to_owned(), round));
        tracing::debug!(transfer_id, %kv, round, "transfer submitted");
        Ok(Vec::new())
    }

    /// The consumer cancels a round; the ack goes out only once nothing of it is in flight.
    pub(crate) fn on_abort_fetch(&mut self, core: &mut Core, kv: &str, round: u64) -> Vec<Message> {
        tracing::debug!(%kv, round, known = self.reqs.contains_key(kv), "abort_fetch");
        let ack = Message::AbortAck {
            kv_request_id: kv.to_owned(),
            round_seq: round,
        };
        let Some(req) = self.reqs.get_mut(kv) else {
            return vec![ack];
        };
        if let Some(r) = req.rounds.get_mut(&round)
            && let Some(t) = r.transfer.as_mut()
        {
            t.cancel.store(true, Ordering::Release);
            t.abort_requested = true;
            return Vec::new();
        }
        if let Some(r) = req.rounds.remove(&round) {
            release(core, r.supply);
        }
        vec![ack]
    }

    /// The data plane finished a transfer: settle the store jobs, then answer the consumer.
    pub(crate) fn on_transfer_finished(
        &mut self,
        core: &mut Core,
        transfer_id: u64,
        statuses: &[ChunkStatus],
        answer: bool,
    ) -> Vec<Message> {
        let Some((kv, round)) = self.transfers.remove(&transfer_id) else {
            tracing::debug!(transfer_id, "finished transfer unknown to the session");
            return Vec::new();
        };
        let Some(t) = self
            .reqs
            .get_mut(&kv)
            .and_then(|r| r.rounds.remove(&round))
            .and_then(|r| r.transfer)
        else {
            tracing::error!(transfer_id, %kv, round, "finished transfer lost its round");
            return Vec::new();
        };
        debug_assert_eq!(t.id, transfer_id);
        let mut key_ok = t.key_ok;
        for (j, (i, jid)) in t.sent.iter().enumerate() {
            let ok = statuses.get(j) == Some(&ChunkStatus::Ok);
            key_ok[*i] = ok;
            core.resolve_store_key(*jid, &t.keys[*i], ok);
        }
        if !answer {
            return Vec::new();
        }
        if t.abort_requested {
            return vec![Message::AbortAck {
                kv_request_id: kv,
                round_seq: round,
            }];
        }
        vec![Message::TransferDone {
            kv_request_id: kv,
            round_seq: round,
            success: key_ok.iter().all(|&o| o),
            key_ok,
        }]
    }

    /// Releases pinned chunks that no fetch bound in time.
    pub(crate) fn collect(&mut self, core: &mut Core, now: Instant) {
        let limit = core.opts.deadlines.unbound_park();
        for (kv, req) in &mut self.reqs {
            let stale: Vec<u64> = req
                .rounds
                .iter()
                .filter(|(_, r)| {
                    r.transfer.is_none() && r.since.is_some_and(|s| now.duration_since(s) >= limit)
                })
                .map(|(k, _)| *k)
                .collect();
            for r in stale {
                tracing::warn!(%kv, round = r, "pinned chunks were never fetched; releasing them");
                if let Some(round) = req.rounds.remove(&r) {
                    release(core, round.supply);
                }
            }
        }
        self.reqs
            .retain(|_, r| !r.raw.is_empty() || !r.active.is_empty() || !r.rounds.is_empty());
    }

    /// The session died: release every pin not in flight and hand the lookup contexts over for
    /// release. In-flight transfers end when their (now cut) connection reports.
    pub(crate) fn on_session_lost(&mut self, core: &mut Core) {
        for req in self.reqs.values_mut() {
            req.raw.clear();
            for lu in std::mem::take(&mut req.active) {
                core.finish_ctxs.push(lu.ctx);
            }
            let idle: Vec<u64> = req
                .rounds
                .iter()
                .filter(|(_, r)| r.transfer.is_none())
                .map(|(k, _)| *k)
                .collect();
            for r in idle {
                if let Some(round) = req.rounds.remove(&r) {
                    release(core, round.supply);
                }
            }
        }
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
