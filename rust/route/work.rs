//! The time cost on plain Rust data: the engine model's formulas, one worker's requests in
//! flight and its queued prompt work (python/kvbridge/routing/work.py's module doc gives the
//! model; `EngineModel` there is the same formulas for Python callers, and
//! tests/test_router_native.py holds the two equal).
//!
//! Every formula is written in the order Python evaluates it, so a router's costs, and a
//! replay's every decision, are the same bits either way.

use std::collections::VecDeque;

#[derive(Clone, Copy)]
pub struct Engine {
    pub prefill: [f64; 3],
    pub decode: [f64; 3],
    /// max_num_batched_tokens
    pub budget: f64,
    /// kv_capacity_tokens (None: unknown)
    pub capacity: Option<f64>,
    /// `prefill_ms(budget)`: a full pass (made by `new`).
    full_pass_ms: f64,
}

impl Engine {
    pub fn new(prefill: [f64; 3], decode: [f64; 3], budget: f64, capacity: Option<f64>) -> Engine {
        let mut e = Engine {
            prefill,
            decode,
            budget,
            capacity,
            full_pass_ms: 0.0,
        };
        e.full_pass_ms = e.prefill_ms(budget);
        e
    }

    pub fn prefill_ms(&self, tokens: f64) -> f64 {
        if tokens <= 0.0 {
            return 0.0;
        }
        let [c0, c1, c2] = self.prefill;
        c0 + c1 * tokens + c2 * tokens * tokens
    }

    pub fn decode_ms(&self, context: f64) -> f64 {
        let u = match self.capacity {
            Some(cap) => (context / cap).min(1.0),
            None => 0.0,
        };
        let [d0, d1, d2] = self.decode;
        (d0 + d1 * u + d2 * u * u).max(1.0)
    }

    pub fn prompt_ms(&self, tokens: f64, step: f64) -> f64 {
        if tokens <= 0.0 {
            return 0.0;
        }
        if tokens <= self.budget {
            return self.prefill_ms(tokens) + step;
        }
        tokens / self.budget * (self.full_pass_ms + step)
    }

    pub fn tokens_per_ms(&self, step: f64) -> f64 {
        self.budget / (self.full_pass_ms + step)
    }

    /// The decode step a worker's queue drains with while it is sent more (an idle batch's:
    /// what the router knows at a routing).
    pub fn routing_step(&self) -> f64 {
        self.decode_ms(0.0)
    }
}

/// A request sent to a worker: its decision's id, prompt length, the tokens it was expected to
/// compute, when it was sent (clock seconds) and when its first token came.
#[derive(Clone, Copy)]
pub struct Flight {
    pub id: u64,
    pub prompt: i64,
    pub uncached: f64,
    pub sent: f64,
    pub first_token: Option<f64>,
}

/// One worker's requests in flight, oldest first, and its queued prompt work: an estimate
/// anchored at the last event (a routing adds the prompt's uncached tokens, time drains it at
/// the engine's speed, a first token resets it to what is still waiting for one).
#[derive(Default)]
pub struct Work {
    pub flights: VecDeque<Flight>,
    /// Prompt tokens of the requests past their first token (their KV cache, output left out).
    pub decoding: i64,
    queued: f64,
    anchor: f64,
}

impl Work {
    /// Prompt tokens still to compute before a prompt routed at `now`, the queue drained since
    /// the last event as the engine computes it, each pass taking a decode step of `step` ms:
    /// past a pass's worth, at the full passes' speed; within one pass, over that pass's whole
    /// time, its fixed cost included (at the full passes' speed, a short queue would be done
    /// well before its pass ends, and its worker taken for idle while it is still busy).
    pub fn queued(&self, now: f64, engine: &Engine, step: f64) -> f64 {
        let mut q = self.queued;
        if q > 0.0 && now > self.anchor {
            if q > engine.budget {
                q -= (now - self.anchor) * (engine.tokens_per_ms(step) * 1000.0);
            } else {
                let pass_ms = engine.prompt_ms(q, step);
                // (a fitted model may say a short pass takes no time: then it is done)
                q = if pass_ms > 0.0 {
                    q * (1.0 - (now - self.anchor) * 1000.0 / pass_ms)
                } else {
                    0.0
                };
            }
            if q < 0.0 {
                q = 0.0;
            }
        }
        q
    }

    pub fn add(&mut self, flight: Flight, now: f64, engine: &Engine) {
        self.queued = self.queued(now, engine, engine.routing_step()) + flight.uncached;
        self.anchor = now;
        self.flights.push_back(flight);
    }

    /// Request `id` (None: the oldest without one) has its first token: the queue is reset to
    /// the uncached tokens of the requests still waiting for theirs. False if there is no such
    /// request waiting.
    pub fn first_token(&mut self, id: Option<u64>, now: f64) -> bool {
        let found = match id {
            Some(id) => self.flights.iter_mut().find(|f| f.id == id),
            None => self.flights.iter_mut().find(|f| f.first_token.is_none()),
        };
        let Some(flight) = found.filter(|f| f.first_token.is_none()) else {
            return false;
        };
        flight.first_token = Some(now);
        self.decoding += flight.prompt;
        self.requeue(now);
        true
    }

    /// Request `id` (None: the oldest) ended: it leaves; None if unknown.
    pub fn done(&mut self, id: Option<u64>, now: f64) -> Option<Flight> {
        let at = match id {
            Some(id) => self.flights.iter().position(|f| f.id == id)?,
            None => 0,
        };
        let flight = self.flights.remove(at)?;
        if flight.first_token.is_some() {
            self.decoding -= flight.prompt;
        } else {
            // ended without a first token seen (an error, a cancel)
            self.requeue(now);
        }
        if self.flights.is_empty() {
            *self = Work::default();
        }
        Some(flight)
    }

    fn requeue(&mut self, now: f64) {
        let mut q = 0.0;
        for f in self.flights.iter().filter(|f| f.first_token.is_none()) {
            q += f.uncached;
        }
        self.queued = q;
        self.anchor = now;
    }
}

/// The leading blocks of a prompt of `num_tokens` that vLLM can hit: its full blocks, a token
/// short of the prompt (the last token is computed for its logits).
pub fn hit_cap(num_tokens: i64, block_size: usize) -> usize {
    if num_tokens > 0 {
        ((num_tokens - 1) / block_size as i64) as usize
    } else {
        0
    }
}

/// What the time cost reads of one candidate.
pub struct Candidate {
    /// Leading blocks held, tier-weighted (0: none).
    pub held: f64,
    /// Whether anything was sent there and is still in flight.
    pub busy: bool,
    pub decoding: f64,
    /// Its latest LoadReport, if any: (running requests, KV-cache use).
    pub report: Option<(i64, f64)>,
}

/// What the time cost says of one candidate.
#[derive(Clone, Copy)]
pub struct Cost {
    /// Predicted ms to first token.
    pub ms: f64,
    /// The prompt tokens it would compute.
    pub uncached: f64,
    /// Nothing held, sent or reported running there: every idle candidate costs the same.
    pub idle: bool,
}

/// Per candidate (in order) its [`Cost`] for a prompt of `num_tokens`; `queued(i, step)` reads
/// candidate i's queued work, drained with decode steps of `step` ms.
#[allow(clippy::too_many_arguments)]
pub fn time_costs(
    engine: &Engine,
    candidates: &[Candidate],
    mut queued: impl FnMut(usize, f64) -> f64,
    num_tokens: i64,
    block_size: usize,
    weight: f64,
    backlog_weight: f64,
    costs: &mut Vec<Cost>,
    rows: &mut Vec<(f64, f64, f64)>,
) {
    let cap = hit_cap(num_tokens, block_size) as f64;
    let bs = block_size as f64;
    let n = num_tokens as f64;
    costs.clear();
    // (todo, queued, step) per candidate; idle ones are NaN until the backlog is known.
    rows.clear();
    let mut any_idle = false;
    let mut backlog = f64::INFINITY;
    let mut last_step = (f64::NAN, 0.0);
    for (i, c) in candidates.iter().enumerate() {
        let running = c.report.is_some_and(|r| r.0 != 0);
        if c.held == 0.0 && !c.busy && !running {
            any_idle = true;
            rows.push((f64::NAN, 0.0, 0.0));
            continue;
        }
        let todo = n - (if c.held < cap { c.held } else { cap }) * bs;
        let mut decoding = c.decoding;
        if let (Some((running, usage)), Some(capacity)) = (c.report, engine.capacity) {
            if running != 0 {
                decoding = decoding.max(usage * capacity);
            }
        }
        // Workers report alike (a fleet's KV use moves together): the last step is reused.
        let step = if decoding == 0.0 {
            0.0
        } else if decoding == last_step.0 {
            last_step.1
        } else {
            last_step = (decoding, engine.decode_ms(decoding));
            last_step.1
        };
        let q = if c.busy { queued(i, step) } else { 0.0 };
        backlog = backlog.min(q);
        rows.push((todo, q, step));
    }
    // When every worker has a backlog, a token of prefill added anywhere also delays the
    // requests that will queue behind it: the prompt's own work weighs more.
    let mut weight = weight;
    if !any_idle {
        let shortest = if backlog.is_finite() { backlog } else { 0.0 };
        weight *= 1.0 + backlog_weight * (shortest / engine.budget);
    }
    let idle_cost = engine.prompt_ms(weight * n, 0.0);
    // Most workers hold nothing of a prompt and have nothing queued: their rows repeat.
    let mut last: ((f64, f64, f64), f64) = ((f64::NAN, 0.0, 0.0), 0.0);
    for &row in rows.iter() {
        let (todo, q, step) = row;
        costs.push(if todo.is_nan() {
            Cost {
                ms: idle_cost,
                uncached: n,
                idle: true,
            }
        } else {
            if row != last.0 {
                last = (row, engine.prompt_ms(q + weight * todo, step));
            }
            Cost {
                ms: last.1,
                uncached: todo,
                idle: false,
            }
        });
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn dynamo() -> Engine {
        Engine::new(
            [16.50142, 1.518344e-02, 4.209989e-07],
            [5.74, 54.01, -25.74],
            8192.0,
            Some((16384 * 64) as f64),
        )
    }

    #[test]
    fn a_first_token_resets_the_queue_to_the_prompts_still_waiting() {
        let mut w = Work::default();
        let e = dynamo();
        for id in 0..3 {
            w.add(
                Flight {
                    id,
                    prompt: 1000,
                    uncached: 500.0,
                    sent: 0.0,
                    first_token: None,
                },
                0.0,
                &e,
            );
        }
        assert_eq!(w.queued(0.0, &e, 0.0), 1500.0);
        assert!(w.first_token(Some(1), 0.01));
        assert_eq!(w.queued(0.01, &e, 0.0), 1000.0);
        assert_eq!(w.decoding, 1000);
        assert!(!w.first_token(Some(1), 0.02));
        assert_eq!(w.done(Some(1), 0.02).map(|f| f.id), Some(1));
        assert_eq!(w.decoding, 0);
        assert!(w.done(None, 0.03).is_some());
        assert!(w.done(None, 0.03).is_some());
        assert!(w.flights.is_empty() && w.queued(1.0, &e, 0.0) == 0.0);
    }

    #[test]
    fn a_queue_within_one_pass_drains_over_the_pass_its_fixed_cost_included() {
        let e = dynamo();
        let mut w = Work::default();
        let flight = Flight {
            id: 0,
            prompt: 654,
            uncached: 654.0,
            sent: 0.0,
            first_token: None,
        };
        w.add(flight, 0.0, &e);
        let pass_ms = e.prompt_ms(654.0, 0.0); // ~26.6 ms, 16.5 of them fixed
        let half = w.queued(pass_ms / 2000.0, &e, 0.0);
        assert!((half - 327.0).abs() < 1e-9, "{half}");
        // at the full passes' speed it would be gone in ~13.5 ms, half the pass
        assert!(654.0 / e.tokens_per_ms(0.0) < pass_ms / 2.0 + 0.5);
        assert_eq!(w.queued(pass_ms / 1000.0, &e, 0.0), 0.0);
        // past a pass's worth the full passes' speed holds
        w.add(
            Flight {
                id: 1,
                uncached: 20000.0,
                ..flight
            },
            0.0,
            &e,
        );
        let rate = e.tokens_per_ms(0.0) * 1000.0;
        assert_eq!(w.queued(0.1, &e, 0.0), 20654.0 - 0.1 * rate);
        // a fitted model whose short pass takes no time: that queue is done, not growing
        let fitted = Engine::new([-30.0, 0.05, 0.0], [5.74, 54.01, -25.74], 8192.0, None);
        let mut w = Work::default();
        w.add(
            Flight {
                id: 2,
                uncached: 100.0,
                ..flight
            },
            0.0,
            &fitted,
        );
        assert_eq!(w.queued(1.0, &fitted, 0.0), 0.0);
    }

    #[test]
    fn idle_workers_cost_the_prompt_alone() {
        let cands = [
            Candidate {
                held: 0.0,
                busy: false,
                decoding: 0.0,
                report: None,
            },
            Candidate {
                held: 10.0,
                busy: false,
                decoding: 0.0,
                report: None,
            },
        ];
        let mut costs = Vec::new();
        time_costs(
            &dynamo(),
            &cands,
            |_, _| 0.0,
            1000,
            64,
            1.0,
            2.0,
            &mut costs,
            &mut Vec::new(),
        );
        assert!(costs[0].idle && !costs[1].idle);
        assert_eq!((costs[0].uncached, costs[1].uncached), (1000.0, 360.0));
        assert_eq!(costs[0].ms, dynamo().prompt_ms(1000.0, 0.0));
        assert!(costs[1].ms < costs[0].ms);
    }
}
