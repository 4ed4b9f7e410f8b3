//! Fetches on the producer side: bind a round's pinned chunks to the consumer's rows and push
//! them over the data plane.
//!
//! A hand-off fetch (`await_stores`, sent by a `remote_prefiller` consumer) may arrive before
//! this node stored the chunks it names (prefill/decode split, concurrent dispatch). Its missing
//! keys then wait for the stores that bring them: `submit_store` offers each stored chunk to the
//! waiting fetch first ([`ServerRole::offer`]) and the chunks leave at once, from inside that
//! call. The wait is bounded by this node's **load deadline** (`deadlines.load_ms`, counted from
//! the fetch's arrival): the consumer gives up on the whole fetch at its own load deadline, so a
//! producer waiting longer could only push into rows nobody waits for. Keys still missing then
//! fail; the rest are reported per key (a `Partial` result on the consumer). A fetch without
//! `await_stores` (after a lookup, whose answers were pinned first) fails its missing keys at
//! once: waiting could not produce them.
//!
//! A round's demand ends with one `transfer_done` (or `abort_ack`) once every key is answered
//! (delivered and acknowledged by the consumer, or failed) and no transfer of the round is in
//! flight. A round may carry several transfers: what is there when the fetch arrives, then each
//! later store's share.

use std::collections::HashMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Instant;

use tiering_core::fetch_trace::{self, Point};
use tiering_core::{KeyMap, OffloadKey};

use super::demand::{Demand, InFlight};
use super::{Fetch, FetchViolation, ServerReq, ServerRole, release};
use crate::core::Core;
use crate::dataplane::frame::ChunkStatus;
use crate::dataplane::sender::{SenderHandle, WriteItem, WriteJob};
use crate::stats::P2pCounters;
use crate::supply::Supply;
use crate::wire::Message;

/// Pushes `ready` (position in the fetch, key, pinned chunk) as one transfer of the round. A
/// sender that is gone fails those keys at once.
fn start_transfer(
    core: &mut Core,
    transfers: &mut HashMap<u64, InFlight>,
    sender: Option<&SenderHandle>,
    (kv, round): (&str, u64),
    demand: &mut Demand,
    ready: Vec<(usize, OffloadKey, Supply)>,
) {
    if ready.is_empty() {
        return;
    }
    fetch_trace::record_request(kv, Point::TransferSubmitted);
    let transfer_id = core.transfer_id();
    let mut record = Vec::with_capacity(ready.len());
    let mut items = Vec::with_capacity(ready.len());
    for (pos, key, s) in ready {
        record.push((pos, key, s.job));
        items.push(WriteItem {
            key,
            dst_row: demand.rows[pos],
            src: s.src,
        });
    }
    let job = WriteJob {
        transfer_id,
        req: kv.to_owned(),
        round,
        items,
        cancel: Arc::clone(&demand.cancel),
    };
    let submitted = match sender {
        Some(s) => s.submit(job),
        None => Err(job),
    };
    if let Err(job) = submitted {
        // The source rows are released before their store jobs can be reported.
        drop(job);
        for (_, key, jid) in record {
            core.resolve_store_key(jid, &key, false);
        }
        return;
    }
    demand.in_flight += 1;
    tracing::debug!(transfer_id, %kv, round, chunks = record.len(), "transfer submitted");
    transfers.insert(
        transfer_id,
        InFlight {
            kv: kv.to_owned(),
            round,
            items: record,
        },
    );
}

impl ServerRole {
    /// A fetch: bind the round's pinned chunks (or the request's parked ones) to the consumer's
    /// rows and push them; a hand-off fetch's missing keys wait for later stores.
    pub(crate) fn on_fetch(
        &mut self,
        core: &mut Core,
        sender: Option<&SenderHandle>,
        f: &Fetch<'_>,
    ) -> Result<Vec<Message>, FetchViolation> {
        if f.keys.len() != f.rows.len() {
            return Err(FetchViolation(format!(
                "a fetch of {} keys into {} rows",
                f.keys.len(),
                f.rows.len()
            )));
        }
        fetch_trace::record_request(f.kv, Point::FetchBound);
        let Self { reqs, transfers } = self;
        let req = reqs.entry(f.kv.to_owned()).or_default();
        if f.keys.is_empty() {
            end_request(core, req);
            return Ok(Vec::new());
        }
        let mut out = req.answer_stale_lookups(core, f.kv, f.round);
        let mut rs = req.rounds.remove(&f.round).unwrap_or_default();
        if rs.demand.is_some() {
            req.rounds.insert(f.round, rs);
            return Err(FetchViolation(format!(
                "a second fetch for {} round {}",
                f.kv, f.round
            )));
        }
        if rs.supply.is_empty()
            && let Some(parked) = core.parked.remove(f.kv)
        {
            // A `remote_decoder` request: its stored chunks were parked for this fetch.
            for (key, s) in parked.items {
                if let Some(dup) = rs.supply.insert(key, s) {
                    let mut one = KeyMap::default();
                    one.insert(key, dup);
                    release(core, one);
                }
            }
        }
        let mut demand = Demand {
            rows: f.rows.to_vec(),
            key_ok: vec![false; f.keys.len()],
            missing: KeyMap::default(),
            deadline: Instant::now() + core.opts.deadlines.load(),
            cancel: Arc::new(AtomicBool::new(false)),
            abort_requested: false,
            in_flight: 0,
        };
        let mut ready = Vec::new();
        for (pos, key) in f.keys.iter().enumerate() {
            if let Some(s) = rs.supply.remove(key) {
                ready.push((pos, *key, s));
            } else if f.await_stores {
                demand.missing.entry(*key).or_insert(pos);
            }
        }
        // Chunks answered but not fetched: the consumer chose not to take them.
        release(core, std::mem::take(&mut rs.supply));
        rs.since = None;
        if !demand.missing.is_empty() {
            P2pCounters::bump(&core.counters.fetches_waited);
            tracing::debug!(
                kv = %f.kv,
                round = f.round,
                missing = demand.missing.len(),
                "fetch waits for chunks not stored yet"
            );
        }
        start_transfer(core, transfers, sender, (f.kv, f.round), &mut demand, ready);
        if let Some(answer) = demand.answer(f.kv, f.round) {
            out.push(answer);
            return Ok(out);
        }
        rs.demand = Some(demand);
        req.rounds.insert(f.round, rs);
        Ok(out)
    }

    /// Whether a fetch for `kv` waits for chunks.
    pub(crate) fn waits_for(&self, kv: &str) -> bool {
        self.reqs.get(kv).is_some_and(|r| {
            r.rounds
                .values()
                .any(|rs| rs.demand.as_ref().is_some_and(Demand::waiting))
        })
    }

    /// Chunks just stored for `kv`: those a waiting fetch names leave now, in one transfer per
    /// round; the rest are handed back (for parking). Returns the answers to send and the rest.
    pub(crate) fn offer(
        &mut self,
        core: &mut Core,
        sender: Option<&SenderHandle>,
        kv: &str,
        items: Vec<(OffloadKey, Supply)>,
    ) -> (Vec<Message>, Vec<(OffloadKey, Supply)>) {
        let Self { reqs, transfers } = self;
        let Some(req) = reqs.get_mut(kv) else {
            return (Vec::new(), items);
        };
        let mut rest = items;
        let mut out = Vec::new();
        let mut answered = Vec::new();
        for (round, rs) in &mut req.rounds {
            if rest.is_empty() {
                break;
            }
            let Some(demand) = rs.demand.as_mut().filter(|d| d.waiting()) else {
                continue;
            };
            let mut ready = Vec::new();
            let mut keep = Vec::new();
            for (key, s) in rest {
                match demand.missing.remove(&key) {
                    Some(pos) => ready.push((pos, key, s)),
                    None => keep.push((key, s)),
                }
            }
            rest = keep;
            if !ready.is_empty() {
                fetch_trace::record_request(kv, Point::StoreOffered);
            }
            P2pCounters::add(&core.counters.keys_handed_off, ready.len() as u64);
            start_transfer(core, transfers, sender, (kv, *round), demand, ready);
            if let Some(answer) = demand.answer(kv, *round) {
                out.push(answer);
                answered.push(*round);
            }
        }
        for r in answered {
            req.rounds.remove(&r);
        }
        (out, rest)
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
        if let Some(rs) = req.rounds.get_mut(&round)
            && let Some(d) = rs.demand.as_mut()
        {
            d.cancel.store(true, Ordering::Release);
            d.abort_requested = true;
            d.missing.clear();
            if d.in_flight > 0 {
                return Vec::new();
            }
        }
        if let Some(rs) = req.rounds.remove(&round) {
            release(core, rs.supply);
        }
        vec![ack]
    }

    /// The data plane finished a transfer: settle its store jobs, then answer the consumer if
    /// that was the round's last outstanding work (and `answer`: the session is alive).
    pub(crate) fn on_transfer_finished(
        &mut self,
        core: &mut Core,
        transfer_id: u64,
        statuses: &[ChunkStatus],
        answer: bool,
    ) -> Vec<Message> {
        let Some(t) = self.transfers.remove(&transfer_id) else {
            tracing::debug!(transfer_id, "finished transfer unknown to the session");
            return Vec::new();
        };
        let mut demand = self
            .reqs
            .get_mut(&t.kv)
            .and_then(|r| r.rounds.get_mut(&t.round))
            .and_then(|rs| rs.demand.as_mut());
        for (j, (pos, key, jid)) in t.items.iter().enumerate() {
            let ok = statuses.get(j) == Some(&ChunkStatus::Ok);
            core.resolve_store_key(*jid, key, ok);
            if let Some(slot) = demand.as_mut().and_then(|d| d.key_ok.get_mut(*pos)) {
                *slot = ok;
            }
        }
        let Some(d) = demand else {
            tracing::error!(transfer_id, kv = %t.kv, round = t.round, "finished transfer lost its round");
            return Vec::new();
        };
        d.in_flight = d.in_flight.saturating_sub(1);
        let msg = d.answer(&t.kv, t.round);
        if msg.is_some()
            && let Some(r) = self.reqs.get_mut(&t.kv)
        {
            r.rounds.remove(&t.round);
        }
        if answer {
            msg.into_iter().collect()
        } else {
            Vec::new()
        }
    }

    /// Deadlines: waiting keys past the load deadline fail; pinned chunks no fetch bound by the
    /// unbound-park deadline are released. Returns the answers to send.
    pub(crate) fn collect(&mut self, core: &mut Core, now: Instant) -> Vec<Message> {
        let park_limit = core.opts.deadlines.unbound_park();
        let mut out = Vec::new();
        for (kv, req) in &mut self.reqs {
            let mut done = Vec::new();
            for (round, rs) in &mut req.rounds {
                match rs.demand.as_mut() {
                    Some(d) if d.waiting() && now >= d.deadline => {
                        tracing::warn!(
                            %kv,
                            round,
                            keys = d.missing.len(),
                            "chunks a fetch waited for were not stored by the load deadline; failing them"
                        );
                        P2pCounters::add(&core.counters.wait_timeouts, d.missing.len() as u64);
                        d.missing.clear();
                        if let Some(answer) = d.answer(kv, *round) {
                            out.push(answer);
                            done.push(*round);
                        }
                    }
                    Some(_) => {}
                    None => {
                        if rs.since.is_some_and(|s| now.duration_since(s) >= park_limit) {
                            tracing::warn!(%kv, round, "pinned chunks were never fetched; releasing them");
                            done.push(*round);
                        }
                    }
                }
            }
            for r in done {
                if let Some(rs) = req.rounds.remove(&r) {
                    release(core, rs.supply);
                }
            }
        }
        self.reqs
            .retain(|_, r| !r.raw.is_empty() || !r.active.is_empty() || !r.rounds.is_empty());
        out
    }

    /// Drain or session loss: release every pin not in flight, fail every waiting key, and hand
    /// the lookup contexts over for release. Returns the answers of the rounds that are now
    /// complete (for a live session); rounds with transfers in flight end when those report.
    pub(crate) fn release_idle(&mut self, core: &mut Core) -> Vec<Message> {
        let mut out = Vec::new();
        for (kv, req) in &mut self.reqs {
            req.raw.clear();
            for lu in std::mem::take(&mut req.active) {
                core.finish_ctxs.push(lu.ctx);
            }
            let mut done = Vec::new();
            for (round, rs) in &mut req.rounds {
                match rs.demand.as_mut() {
                    Some(d) => {
                        d.missing.clear();
                        if let Some(answer) = d.answer(kv, *round) {
                            out.push(answer);
                            done.push(*round);
                        }
                    }
                    None => done.push(*round),
                }
            }
            for r in done {
                if let Some(rs) = req.rounds.remove(&r) {
                    release(core, rs.supply);
                }
            }
        }
        out
    }
}

/// The terminal empty fetch: the consumer is done with this id. Every round nobody fetched is
/// released; fetched rounds end on their own (the consumer aborts what it still waits for).
fn end_request(core: &mut Core, req: &mut ServerReq) {
    for lu in std::mem::take(&mut req.active) {
        core.finish_ctxs.push(lu.ctx);
    }
    req.raw.clear();
    let idle: Vec<u64> = req
        .rounds
        .iter()
        .filter(|(_, r)| r.demand.is_none())
        .map(|(k, _)| *k)
        .collect();
    for r in idle {
        if let Some(round) = req.rounds.remove(&r) {
            release(core, round.supply);
        }
    }
}
