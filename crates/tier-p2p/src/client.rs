//! The consumer role of a session: probes (lookups) batched per step, fetch rounds, and the
//! loads they carry until the data plane is quiescent.

use std::collections::{BTreeMap, HashMap};
use std::time::{Duration, Instant};

use tiering_core::{JobId, JobResult, KeyMap, LookupResult, OffloadKey, TransferJob, arena::RowGrant};

use crate::core::Core;
use crate::dataplane::dest::{AuthSlot, DestKey};
use crate::stats::P2pCounters;
use crate::wire::{Message, encode_keys};

/// One outstanding fetch round.
struct Load {
    job: JobId,
    keys: Vec<OffloadKey>,
    submitted: Instant,
    aborting: Option<Instant>,
    /// The producer answered (`transfer_done`/`abort_ack`) or the session died: no more
    /// writes are expected, the load ends once its rows are quiescent.
    done: bool,
    producer_ok: Option<Vec<bool>>,
}

/// One consumer request pulling from this session's peer.
#[derive(Default)]
struct ClientReq {
    probes: KeyMap<Option<bool>>,
    unsent: Vec<OffloadKey>,
    round: u64,
    /// A terminal empty fetch is owed (a lookup went out and no fetch closed it since).
    lookup_open: bool,
    /// Since when some probe has been waiting for an answer.
    waiting_since: Option<Instant>,
    /// Probes without an answer.
    unresolved: usize,
    loads: BTreeMap<u64, Load>,
    finished: bool,
}

/// A lookup that ran past its deadline.
pub(crate) struct LookupTimedOut;

/// The consumer side of one session.
#[derive(Default)]
pub(crate) struct ClientRole {
    reqs: HashMap<String, ClientReq>,
}

impl ClientRole {
    /// The verdict for one key; registers a probe for the next flush when it is new.
    pub(crate) fn probe(
        &mut self,
        kv: &str,
        key: &OffloadKey,
        now: Instant,
        deadline: Duration,
    ) -> Result<LookupResult, LookupTimedOut> {
        let req = self.reqs.entry(kv.to_owned()).or_default();
        if let Some(since) = req.waiting_since
            && now.duration_since(since) >= deadline
        {
            return Err(LookupTimedOut);
        }
        Ok(match req.probes.get(key) {
            Some(Some(true)) => LookupResult::Hit,
            Some(Some(false)) => LookupResult::Miss,
            Some(None) => LookupResult::Retry,
            None => {
                req.probes.insert(*key, None);
                req.unresolved += 1;
                req.unsent.push(*key);
                req.waiting_since.get_or_insert(now);
                LookupResult::Retry
            }
        })
    }

    /// Whether `key` already failed to load for this request (an eager source skips probing
    /// but must not fetch such a key again).
    pub(crate) fn failed_before(&self, kv: &str, key: &OffloadKey) -> bool {
        self.reqs
            .get(kv)
            .is_some_and(|r| r.probes.get(key) == Some(&Some(false)))
    }

    /// One `lookup` per request with new probes (called once per step).
    pub(crate) fn flush(&mut self) -> Vec<Message> {
        let mut out = Vec::new();
        for (kv, req) in &mut self.reqs {
            if req.unsent.is_empty() {
                continue;
            }
            let keys = std::mem::take(&mut req.unsent);
            req.lookup_open = true;
            out.push(Message::Lookup {
                kv_request_id: kv.clone(),
                keys: encode_keys(&keys),
                round_seq: req.round,
            });
        }
        out
    }

    pub(crate) fn on_lookup_resp(&mut self, kv: &str, keys: &[OffloadKey], hits: &[bool]) {
        let Some(req) = self.reqs.get_mut(kv) else {
            return;
        };
        for (k, &h) in keys.iter().zip(hits) {
            if let Some(slot) = req.probes.get_mut(k)
                && slot.is_none()
            {
                *slot = Some(h);
                req.unresolved -= 1;
            }
        }
        if req.unresolved == 0 {
            req.waiting_since = None;
        }
    }

    /// Starts a fetch round for `job`: whitelists its rows and returns the `fetch` (a hand-off
    /// fetch with `await_stores`: the producer may not have stored the chunks yet). On failure
    /// the job's result is returned instead.
    pub(crate) fn start_load(
        &mut self,
        core: &mut Core,
        peer: &str,
        kv: &str,
        job: TransferJob,
        await_stores: bool,
        auth: AuthSlot,
    ) -> Result<Message, JobResult> {
        let grants = match job.rows {
            RowGrant::Write(w) if w.len() == job.keys.len() => w,
            _ => return Err(JobResult::failed(job.id, Duration::ZERO)),
        };
        let req = self.reqs.entry(kv.to_owned()).or_default();
        let round = req.round;
        req.round += 1;
        req.lookup_open = false;
        // Once a round is fetched the producer releases its pins and may evict: cached hits go
        // stale. Resolved misses stay, or the same keys would be probed again and again.
        req.probes.retain(|_, v| *v != Some(true));
        req.unsent.retain(|k| req.probes.contains_key(k));
        if req.unresolved == 0 {
            req.waiting_since = None;
        }
        let dk = DestKey {
            peer: peer.to_owned(),
            req: kv.to_owned(),
            round,
        };
        if let Err(grants) = core.dest.register(dk, &job.keys, grants, auth) {
            // The grants are released before the job is reported failed.
            drop(grants);
            return Err(JobResult::failed(job.id, Duration::ZERO));
        }
        let msg = Message::Fetch {
            kv_request_id: kv.to_owned(),
            round_seq: round,
            keys: encode_keys(&job.keys),
            block_indexes: job.chunk_ids.clone(),
            await_stores,
        };
        req.loads.insert(
            round,
            Load {
                job: job.id,
                keys: job.keys,
                submitted: Instant::now(),
                aborting: None,
                done: false,
                producer_ok: None,
            },
        );
        Ok(msg)
    }

    pub(crate) fn on_transfer_done(&mut self, kv: &str, round: u64, key_ok: Vec<bool>) {
        match self.reqs.get_mut(kv).and_then(|r| r.loads.get_mut(&round)) {
            Some(load) if !load.done => {
                load.done = true;
                load.producer_ok = Some(key_ok);
            }
            _ => tracing::debug!(%kv, round, "transfer_done for an unknown round; dropped"),
        }
    }

    pub(crate) fn on_abort_ack(&mut self, kv: &str, round: u64) {
        match self.reqs.get_mut(kv).and_then(|r| r.loads.get_mut(&round)) {
            Some(load) if !load.done => load.done = true,
            _ => tracing::debug!(%kv, round, "abort_ack for an unknown round; dropped"),
        }
    }

    /// Load deadlines, abort deadlines and completions. Returns the messages to send and
    /// whether some peer's data connections must be cut (an abort that was never acked).
    pub(crate) fn collect(&mut self, core: &mut Core, peer: &str, now: Instant) -> (Vec<Message>, bool) {
        let load_deadline = core.opts.deadlines.load();
        let abort_deadline = core.opts.deadlines.abort();
        let mut out = Vec::new();
        let mut cut = false;
        for (kv, req) in &mut self.reqs {
            for (round, load) in &mut req.loads {
                if load.done {
                    continue;
                }
                match load.aborting {
                    None if now.duration_since(load.submitted) >= load_deadline => {
                        tracing::warn!(%peer, %kv, round, "fetch timed out; aborting");
                        core.failures.record(crate::PeerFailure::Deadline {
                            peer: peer.to_owned(),
                            what: "load",
                        });
                        P2pCounters::bump(&core.counters.aborts_sent);
                        load.aborting = Some(now);
                        out.push(Message::AbortFetch {
                            kv_request_id: kv.clone(),
                            round_seq: *round,
                        });
                    }
                    Some(since) if now.duration_since(since) >= abort_deadline => {
                        tracing::warn!(%peer, %kv, round, "no abort_ack; cutting the data connection");
                        core.dest.close(&dest_key(peer, kv, *round));
                        load.done = true;
                        cut = true;
                    }
                    _ => {}
                }
            }
        }
        self.finish_quiescent(core, peer);
        (out, cut)
    }

    /// Reports every answered load whose rows are quiescent.
    pub(crate) fn finish_quiescent(&mut self, core: &mut Core, peer: &str) {
        for (kv, req) in &mut self.reqs {
            let mut finished = Vec::new();
            let mut lost = Vec::new();
            for (round, load) in &req.loads {
                let dk = dest_key(peer, kv, *round);
                // An answered load ends once its rows are quiescent; an unanswered one ends
                // early when every row arrived and verified (the producer's `transfer_done`
                // can only agree, and arrives a control hop later).
                let fin = if load.done {
                    core.dest.try_finish(&dk)
                } else {
                    core.dest.try_finish_delivered(&dk)
                };
                let Some(fin) = fin else {
                    continue;
                };
                // A key the table did not report (a fetch whose entry was gone) did not verify.
                let ok: Vec<bool> = (0..load.keys.len())
                    .map(|i| {
                        fin.verified.get(i).copied().unwrap_or(false)
                            && load
                                .producer_ok
                                .as_ref()
                                .is_none_or(|p| p.get(i).copied().unwrap_or(false))
                    })
                    .collect();
                let good = ok.iter().filter(|&&o| o).count() as u64;
                lost.extend(load.keys.iter().zip(&ok).filter(|(_, o)| !**o).map(|(k, _)| *k));
                P2pCounters::bump(&core.counters.loads_finished);
                P2pCounters::add(&core.counters.keys_loaded, good);
                P2pCounters::add(&core.counters.keys_failed, load.keys.len() as u64 - good);
                core.finished.push(JobResult::from_key_outcomes(
                    load.job,
                    &load.keys,
                    &ok,
                    fin.bytes,
                    load.submitted.elapsed(),
                ));
                finished.push(*round);
            }
            for r in finished {
                req.loads.remove(&r);
            }
            // A key that failed to load misses for the rest of the request: probing it again
            // would fetch it again and fail the same way.
            if !req.finished {
                for k in lost {
                    if req.probes.insert(k, Some(false)) == Some(None) {
                        req.unresolved -= 1;
                    }
                }
            }
        }
        self.reqs.retain(|_, r| !(r.finished && r.loads.is_empty()));
    }

    /// The local request is over: abort its loads, send the terminal empty fetch if owed and
    /// forget its probes.
    pub(crate) fn finish(&mut self, core: &Core, kv: &str) -> Vec<Message> {
        let mut out = Vec::new();
        let Some(req) = self.reqs.get_mut(kv) else {
            return out;
        };
        for (round, load) in &mut req.loads {
            if !load.done && load.aborting.is_none() {
                P2pCounters::bump(&core.counters.aborts_sent);
                load.aborting = Some(Instant::now());
                out.push(Message::AbortFetch {
                    kv_request_id: kv.to_owned(),
                    round_seq: *round,
                });
            }
        }
        if req.lookup_open {
            out.push(Message::Fetch {
                kv_request_id: kv.to_owned(),
                round_seq: req.round,
                keys: Vec::new(),
                block_indexes: Vec::new(),
                await_stores: false,
            });
        }
        req.probes.clear();
        req.unsent.clear();
        req.waiting_since = None;
        req.unresolved = 0;
        req.lookup_open = false;
        req.finished = true;
        if req.loads.is_empty() {
            self.reqs.remove(kv);
        }
        out
    }

    /// The session died: no more answers will come. Closes every load (it ends once its rows
    /// are quiescent) and returns the requests that must now miss.
    pub(crate) fn on_session_lost(&mut self, core: &Core, peer: &str) -> Vec<String> {
        let mut failed = Vec::new();
        for (kv, req) in &mut self.reqs {
            for (round, load) in &mut req.loads {
                if !load.done {
                    core.dest.close(&dest_key(peer, kv, *round));
                    load.done = true;
                }
            }
            req.probes.clear();
            req.unsent.clear();
            req.waiting_since = None;
            req.unresolved = 0;
            req.finished = true;
            failed.push(kv.clone());
        }
        failed
    }

    /// Forgets a request that timed out (its loads, if any, still end normally).
    pub(crate) fn fail(&mut self, kv: &str) {
        if let Some(req) = self.reqs.get_mut(kv) {
            req.probes.clear();
            req.unsent.clear();
            req.waiting_since = None;
            req.unresolved = 0;
        }
    }

    /// Loads not yet reported.
    pub(crate) fn loads_in_flight(&self) -> usize {
        self.reqs.values().map(|r| r.loads.len()).sum()
    }

    /// Whether anything is waiting on the peer.
    pub(crate) fn has_work(&self) -> bool {
        self.reqs
            .values()
            .any(|r| !r.loads.is_empty() || r.waiting_since.is_some() || !r.unsent.is_empty())
    }
}

fn dest_key(peer: &str, kv: &str, round: u64) -> DestKey {
    DestKey {
        peer: peer.to_owned(),
        req: kv.to_owned(),
        round,
    }
}
