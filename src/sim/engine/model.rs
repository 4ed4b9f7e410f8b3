//! Step phase (d), the model: it computes chunks into device blocks and sleeps its modelled
//! time while the copy worker and the control thread run; and the drain at the end of a run.

use super::*;

impl Engine<'_> {
    /// Runs the step's model work. Returns whether there was any, and how far the simulated
    /// clock moves before the next step is scheduled: the scheduler thread's CPU time (scaled)
    /// plus the modelled model time, or, with asynchronous scheduling, until this model starts
    /// (the next step is scheduled while it runs); an idle tick costs up to `step_base`. Other
    /// load on the machine does not leak into the TTFT proxy beyond the scheduler's own work.
    /// The model time is at least the modelled transfer time of the step's device loads, which
    /// overlap it.
    ///
    /// # Errors
    /// A device load of this step never finished, or the copy worker died.
    pub(super) fn execute_model(&mut self, scheduling: Duration) -> Result<(bool, Duration), SimError> {
        let model_start = Instant::now();
        self.wait_step_loads()?;
        let prefill: Vec<usize> = std::mem::take(&mut self.prefill_now);
        let decoding: Vec<usize> = self
            .running
            .iter()
            .copied()
            .filter(|&r| self.reqs[r].generated > 0)
            .collect();
        if prefill.is_empty() && decoding.is_empty() {
            let pending =
                !self.waiting.is_empty() || self.copier.as_ref().is_some_and(|c| c.outstanding() > 0);
            if pending {
                // An idle tick: let copies and promotions progress before the next look. It
                // ends early when a copy is due or a request arrives, which a real engine
                // would act on at once.
                let lead = self.model_start_after(scheduling);
                let tick = self.idle_tick(lead);
                std::thread::sleep(tick);
                return Ok((false, lead + tick));
            }
            return Ok((false, self.model_start_after(scheduling)));
        }
        let mut prefill_tokens = 0;
        let mut loaded_bytes = 0;
        let mut first_tokens = Vec::with_capacity(prefill.len());
        for &r in &prefill {
            prefill_tokens += self.prefill_tokens(r);
            loaded_bytes += self.reqs[r].loaded.len() * self.cfg.chunk_bytes;
            self.account_prefill(r);
            let req = &self.reqs[r];
            let from = req.device_hits + req.loaded.len();
            let to = (req.prompt_len / self.tpc).min(req.keys.len());
            self.compute_chunks(r, from, to);
            let req = &mut self.reqs[r];
            req.kv_tokens = req.prompt_len;
            req.generated = 1;
            first_tokens.push(r);
        }
        for &r in &decoding {
            let req = &mut self.reqs[r];
            req.generated += 1;
            req.kv_tokens += 1;
            if req.kv_tokens % self.tpc == 0 && req.kv_tokens / self.tpc <= req.keys.len() {
                let c = req.kv_tokens / self.tpc - 1;
                self.compute_chunks(r, c, c + 1);
            }
        }
        let model = self
            .cfg
            .model_time(prefill_tokens, decoding.len())
            .max(self.cfg.device_copy_time(loaded_bytes));
        self.m.model_time += model;
        if let Some(rest) = model.checked_sub(model_start.elapsed()) {
            std::thread::sleep(rest);
        }
        let timing = StepTiming::of(self.cfg.async_scheduling, scheduling, self.model_in_flight, model);
        self.model_in_flight = timing.in_flight;
        let end = self.now + (timing.model_start + model).as_secs_f64();
        for r in first_tokens {
            self.m.ttft.push(end - self.reqs[r].arrival);
        }
        let finished: Vec<usize> = self
            .running
            .iter()
            .copied()
            .filter(|&r| self.reqs[r].generated >= self.reqs[r].output_len)
            .collect();
        if !finished.is_empty() {
            self.running.retain(|r| !finished.contains(r));
            for r in finished {
                self.m.output_tokens += self.reqs[r].output_len as u64;
                self.reqs[r].phase = Phase::Finishing;
                self.finishing.push(r);
            }
        }
        Ok((true, timing.advance))
    }

    /// How long after the step's start its model starts when the step has no model work:
    /// after the scheduling and after the model still in flight, which it takes.
    fn model_start_after(&mut self, scheduling: Duration) -> Duration {
        scheduling.max(std::mem::take(&mut self.model_in_flight))
    }

    /// How long an idle step waits once its scheduling (`lead`) is done; see [`idle_wait`].
    fn idle_tick(&self, lead: Duration) -> Duration {
        let now = self.now;
        let next_due = self.jobs.values().map(|j| j.due).filter(|&t| t > now);
        let next_arrival = self.reqs.get(self.next_arrival).map(|r| r.arrival);
        let soonest = next_due.chain(next_arrival).fold(f64::INFINITY, f64::min);
        let until = Duration::try_from_secs_f64(soonest - now).unwrap_or(Duration::MAX);
        idle_wait(lead, until, self.cfg.step_base)
    }

    pub(super) fn account_prefill(&mut self, r: usize) {
        let tpc = self.tpc as u64;
        let req = &self.reqs[r];
        self.m.add_served(Source::Device, req.device_hits as u64 * tpc);
        for &s in &req.loaded {
            self.m.add_served(s, tpc);
        }
        self.m.computed_tokens += (req.prompt_len - (req.device_hits + req.loaded.len()) * self.tpc) as u64;
    }

    /// The model writes chunks `from..to` of request `r` into its device blocks.
    pub(super) fn compute_chunks(&mut self, r: usize, from: usize, to: usize) {
        for c in from..to {
            let (key, block) = (self.reqs[r].keys[c], self.reqs[r].blocks[c]);
            self.memory.with_block(block, |b| fill_chunk(&key, b));
            self.device.register(block, key);
        }
    }

    // ----- the end of the run ----------------------------------------------------------------

    /// The tiers' counters that say what pending work is left (the `pending_*` ones a tier
    /// reports, and sessions with work), for a stall's message; empty when none is nonzero.
    fn pending_summary(&mut self) -> String {
        let Some(Ok(stats)) = self.off.as_mut().map(Offload::stats) else {
            return String::new();
        };
        let mut parts = Vec::new();
        for t in &stats.secondaries {
            let mut keys: Vec<_> = t
                .extra
                .iter()
                .filter(|(k, v)| (k.starts_with("pending_") || k.ends_with("_with_work")) && **v > 0.0)
                .map(|(k, v)| format!("{k} {v}"))
                .collect();
            keys.sort();
            if !keys.is_empty() {
                parts.push(format!("{}: {}", t.name, keys.join(", ")));
            }
        }
        if parts.is_empty() {
            String::new()
        } else {
            format!(" ({})", parts.join("; "))
        }
    }

    /// Waits for outstanding copies, then steps idly until the manager has no pending work.
    pub(super) fn drain(&mut self) -> Result<(), SimError> {
        let deadline = Instant::now() + self.cfg.drain_timeout;
        loop {
            let copies = self.copier.as_ref().map_or(0, Copier::outstanding);
            let pending = match &mut self.off {
                Some(off) => off.has_pending_work()?,
                None => false,
            };
            if copies == 0 && !pending {
                return Ok(());
            }
            if Instant::now() > deadline {
                let what = self.pending_summary();
                return Err(SimError::Stalled(format!(
                    "after the last request, {copies} device copies and the tiers' pending work \
                     did not finish within {:?}{what}",
                    self.cfg.drain_timeout
                )));
            }
            if let Some(c) = &mut self.copier
                && copies > 0
                && let Some(d) = c.wait_one(Duration::from_millis(50))?
            {
                self.apply_copy(&d)?;
            }
            self.apply_copies()?;
            let start = Instant::now();
            self.end_schedule()?;
            let scheduling = start.elapsed();
            std::thread::sleep(self.cfg.step_base);
            self.m.steps += 1;
            self.now += (scheduling + self.cfg.step_base).as_secs_f64();
        }
    }
}

/// Where one step's model falls on the simulated clock, counted from the step's start (when
/// its scheduling began).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct StepTiming {
    /// When the model starts: after the scheduling, and not before the model in flight ends.
    model_start: Duration,
    /// How far the clock moves before the next step is scheduled: to the end of this model
    /// (synchronous), or to its start, since the next step is scheduled while it runs.
    advance: Duration,
    /// The model the next step is scheduled alongside.
    in_flight: Duration,
}

impl StepTiming {
    fn of(asynchronous: bool, scheduling: Duration, in_flight: Duration, model: Duration) -> Self {
        let model_start = scheduling.max(in_flight);
        if asynchronous {
            Self {
                model_start,
                advance: model_start,
                in_flight: model,
            }
        } else {
            Self {
                model_start,
                advance: model_start + model,
                in_flight: Duration::ZERO,
            }
        }
    }
}

/// How long an idle step waits after its scheduling: it is scheduled first (`lead`), then
/// waits up to `step_base` but no later than the next event (`until`, a copy due or an arrival,
/// from the step's start). An event that comes while the step is being scheduled is seen when
/// the scheduling ends; one that comes during the wait ends it at once: a request arriving
/// then is not charged the step's scheduling. At least 1 µs passes per step.
fn idle_wait(lead: Duration, until: Duration, step_base: Duration) -> Duration {
    let wait = step_base.min(until.saturating_sub(lead));
    if lead + wait == Duration::ZERO {
        Duration::from_micros(1)
    } else {
        wait
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const fn us(n: u64) -> Duration {
        Duration::from_micros(n)
    }

    #[test]
    fn an_idle_step_ends_at_the_next_event_counting_its_scheduling() {
        // Scheduled in 3 us, an arrival 10 us after the step's start: 7 us of waiting, so the
        // step ends when the request arrives (not 3 us after it).
        assert_eq!(idle_wait(us(3), us(10), us(1000)), us(7));
        // An event during the scheduling: no wait, the next step starts when scheduling ends.
        assert_eq!(idle_wait(us(3), us(2), us(1000)), Duration::ZERO);
        // Nothing soon: the whole step_base.
        assert_eq!(idle_wait(us(3), Duration::MAX, us(1000)), us(1000));
        // Neither scheduling nor waiting: the clock still moves.
        assert_eq!(idle_wait(Duration::ZERO, Duration::ZERO, us(1000)), us(1));
    }

    #[test]
    fn synchronous_steps_pay_scheduling_then_the_model() {
        let t = StepTiming::of(false, us(5), Duration::ZERO, us(100));
        assert_eq!(
            (t.model_start, t.advance, t.in_flight),
            (us(5), us(105), Duration::ZERO)
        );
    }

    #[test]
    fn asynchronous_scheduling_hides_behind_the_model_in_flight() {
        // Three steps of 100 us models, scheduled in 5, 30 and 150 us: only the part of the
        // scheduling that outlasts the model in flight moves a model's start.
        let first = StepTiming::of(true, us(5), Duration::ZERO, us(100));
        assert_eq!((first.model_start, first.advance), (us(5), us(5)));
        let second = StepTiming::of(true, us(30), first.in_flight, us(100));
        assert_eq!((second.model_start, second.advance), (us(100), us(100)));
        let third = StepTiming::of(true, us(150), second.in_flight, us(100));
        assert_eq!(third.model_start, us(150));
        // Models back to back: the second starts when the first ends, 100 us apart.
        let ends = [
            first.model_start + us(100),
            first.advance + second.model_start + us(100),
        ];
        assert_eq!(ends[1] - ends[0], us(100));
        // A scheduling cost added to every step changes nothing while it stays under the model.
        let slower = StepTiming::of(true, us(30) + us(20), first.in_flight, us(100));
        assert_eq!(slower, second);
    }
}
