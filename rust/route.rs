//! `kvbridge._native.RouterCore` and `ProvisionalResidency`: a routing decision in one native
//! call. `kvbridge.routing.router.Router` is the Python face (its module doc states the cost,
//! and what each argument means); this is its state and its hot path: the prompt's keys, the
//! index's overlap per worker and storage tier (read in place, under the index's lock),
//! provisional residency, each worker's requests in flight and queued work, the cost per
//! candidate, the pick and its bookkeeping. A decision at 64 workers cost ~200 us as Python
//! loops per candidate; here it is a few microseconds beside the index's own query.
//!
//! The formulas are `EngineModel`'s (python/kvbridge/routing/work.py), evaluated in the order
//! Python evaluates them (tests/test_router_native.py holds the core to a plain model of the
//! cost). This file: the class, a decision's steps and its bookkeeping; `scoring`: the scores
//! (index, given, provisional residency merged) and the candidates; `residency`:
//! `ProvisionalResidency`'s Python face; `provisional` and `work`: the pyo3-free parts.

mod provisional;
mod residency;
mod scoring;
mod work;

use std::collections::HashMap;
use std::sync::Arc;

use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;
use pyo3::types::{PyDict, PyList, PyString, PyTuple};

pub use self::residency::ProvisionalResidency;
use self::residency::{read_keys, worker_name};
use self::scoring::{IndexRead, Medium, Score};
use self::work::{time_costs, Candidate, Cost, Engine, Flight, Work};
use crate::index::Index;

pub fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<ProvisionalResidency>()?;
    m.add_class::<RouterCore>()
}

// --- the router's core -----------------------------------------------------------------------

struct Slot {
    name: Py<PyString>,
    key: Arc<str>,
    work: Work,
    report: Option<(i64, f64)>,
    /// The index's count of its cache clears at the router's last decision for it (outer
    /// None: no decision yet).
    clears_seen: Option<Option<u64>>,
    listed: bool,
    pid: Option<u32>,
    // This decision's view (valid while `seen`/`indexed`/`asked` equal the decision's epoch).
    seen: u64,
    score: Score,
    indexed: u64,
    clears_now: u64,
    asked: u64,
    /// Its own hit (index or given scores) in the decision `hit_at`, before provisional
    /// residency: what it is not sent again.
    hit: i64,
    hit_at: u64,
}

/// The router's state and hot path (see the module doc).
#[pyclass(module = "kvbridge._native")]
pub struct RouterCore {
    index: Option<Py<Index>>,
    provisional: Py<ProvisionalResidency>,
    block_size: usize,
    time: bool,
    engine: Engine,
    overlap_weight: f64,
    backlog_weight: f64,
    remote: bool,
    weights: Vec<(String, f64)>,
    lowest: f64,
    media: Vec<Medium>,
    slots: Vec<Slot>,
    by_name: HashMap<Arc<str>, u32>,
    /// Slot ids in name order: candidates in the order Python's sorted() gives.
    order: Vec<u32>,
    index_slot: Vec<Option<(Arc<str>, u32)>>,
    prov_slot: Vec<u32>,
    /// `report(worker)` per candidate (None: the reports given by `set_reports`).
    #[pyo3(get, set)]
    report_fn: Option<Py<PyAny>>,
    epoch: u64,
    next_id: u64,
    keys: Vec<u64>,
    entries: Vec<(u32, i64)>,
    cands: Vec<u32>,
    /// The slots given a score (index or scores) in this decision, before provisional residency.
    scored: Vec<u32>,
    read: IndexRead,
    costs: Vec<Cost>,
    views: Vec<Candidate>,
    rows: Vec<(f64, f64, f64)>,
    /// Provisional residency's clock in this decision, once read.
    prov_now: Option<f64>,
}

/// What one decision is asked.
pub(super) struct Ask<'a, 'py> {
    tokens: Option<&'a Bound<'py, PyAny>>,
    scores: Option<&'a Bound<'py, PyDict>>,
    num_blocks: i64,
    num_tokens: i64,
    lora_name: Option<&'a Bound<'py, PyAny>>,
    extra_keys: Option<&'a Bound<'py, PyAny>>,
    workers: Option<&'a Bound<'py, PyAny>>,
    use_keys: bool,
    resyncing: Option<&'a Bound<'py, PyAny>>,
}

#[pymethods]
impl RouterCore {
    #[new]
    #[allow(clippy::too_many_arguments)]
    #[pyo3(signature = (index, provisional, *, block_size, time, prefill, decode, max_num_batched_tokens, kv_capacity_tokens, overlap_weight, backlog_weight, remote, medium_weights, workers))]
    fn new(
        py: Python<'_>,
        index: &Bound<'_, PyAny>,
        provisional: Py<ProvisionalResidency>,
        block_size: usize,
        time: bool,
        prefill: [f64; 3],
        decode: [f64; 3],
        max_num_batched_tokens: usize,
        kv_capacity_tokens: Option<usize>,
        overlap_weight: f64,
        backlog_weight: f64,
        remote: bool,
        medium_weights: Vec<(String, f64)>,
        workers: Vec<String>,
    ) -> PyResult<Self> {
        if block_size == 0 {
            return Err(PyValueError::new_err("block_size must be > 0"));
        }
        let lowest = medium_weights
            .iter()
            .map(|w| w.1)
            .fold(f64::INFINITY, f64::min);
        let mut core = RouterCore {
            index: index.cast::<Index>().ok().map(|i| i.clone().unbind()),
            provisional,
            block_size,
            time,
            engine: Engine::new(
                prefill,
                decode,
                max_num_batched_tokens as f64,
                kv_capacity_tokens.map(|c| c as f64),
            ),
            overlap_weight,
            backlog_weight,
            remote,
            weights: medium_weights,
            lowest: if lowest.is_finite() { lowest } else { 0.0 },
            media: Vec::new(),
            slots: Vec::new(),
            by_name: HashMap::new(),
            order: Vec::new(),
            index_slot: Vec::new(),
            prov_slot: Vec::new(),
            report_fn: None,
            epoch: 0,
            next_id: 0,
            keys: Vec::new(),
            entries: Vec::new(),
            cands: Vec::new(),
            scored: Vec::new(),
            read: IndexRead::default(),
            costs: Vec::new(),
            views: Vec::new(),
            rows: Vec::new(),
            prov_now: None,
        };
        for w in workers {
            let s = core.slot(&PyString::new(py, &w));
            core.slots[s as usize].listed = true;
        }
        Ok(core)
    }

    /// One decision (arguments positional: this is the hot path). `tokens` (with a
    /// kvbridge.Index) or `scores` (`{worker: int | {medium: int}}`, with `num_blocks` and
    /// `keys`); `now`: the router's clock. With `costs_only`, the
    /// costs `{worker: cost}` in the order the pick reads them; otherwise `(worker, leading
    /// blocks it holds, decision id, the prompt's keys if want_keys)` with the request in flight
    /// there, or None when there is no candidate. `rng`: a random.Random for ties. `load`: the
    /// "blocks" cost's load per worker (default: its requests in flight).
    #[allow(clippy::too_many_arguments)]
    #[pyo3(signature = (tokens, scores, num_blocks, num_tokens, keys, lora_name, extra_keys, workers, now, use_keys, want_keys, rng, load, resyncing, costs_only))]
    fn decide<'py>(
        &mut self,
        py: Python<'py>,
        tokens: Option<&Bound<'py, PyAny>>,
        scores: Option<&Bound<'py, PyDict>>,
        num_blocks: i64,
        num_tokens: i64,
        keys: Option<&Bound<'py, PyAny>>,
        lora_name: Option<&Bound<'py, PyAny>>,
        extra_keys: Option<&Bound<'py, PyAny>>,
        workers: Option<&Bound<'py, PyAny>>,
        now: f64,
        use_keys: bool,
        want_keys: bool,
        rng: &Bound<'py, PyAny>,
        load: Option<&Bound<'py, PyDict>>,
        resyncing: Option<&Bound<'py, PyAny>>,
        costs_only: bool,
    ) -> PyResult<Option<Bound<'py, PyAny>>> {
        self.keys.clear();
        if let Some(k) = keys {
            self.keys = read_keys(k)?;
        }
        let ask = Ask {
            tokens,
            scores,
            num_blocks,
            num_tokens,
            lora_name,
            extra_keys,
            workers,
            use_keys,
            resyncing,
        };
        let (num_blocks, num_tokens) = self.score(py, &ask)?;
        if self.cands.is_empty() {
            return Ok(None);
        }
        self.weigh(py, now, num_blocks, num_tokens, load)?;
        // The costs in the order Python's dict kept them: the time cost lists workers that
        // are not idle first (ties are drawn in that order).
        let costs = &self.costs;
        let time = self.time;
        let ordered = || {
            let n = costs.len();
            let busy = (0..n).filter(move |&i| !(time && costs[i].idle));
            busy.chain((0..n).filter(move |&i| time && costs[i].idle))
        };
        if costs_only {
            let out = PyDict::new(py);
            for i in ordered() {
                out.set_item(self.slot_name(py, self.cands[i]), costs[i].ms)?;
            }
            return Ok(Some(out.into_any()));
        }
        let best = costs.iter().map(|c| c.ms).fold(f64::INFINITY, f64::min);
        let tied = costs.iter().filter(|c| c.ms == best).count();
        let nth = if tied == 1 { 0 } else { rand_below(rng, tied)? };
        let pick = ordered()
            .filter(|&i| costs[i].ms == best)
            .nth(nth)
            .expect("a tied candidate");
        let s = self.cands[pick];
        let uncached = if self.time {
            self.costs[pick].uncached
        } else {
            num_tokens as f64
        };
        let leading = self.leading(s).min(num_blocks);
        let id = self.commit(py, s, num_tokens, uncached, now, use_keys)?;
        let keys_out = if want_keys {
            Some(PyList::new(py, &self.keys)?.into_any())
        } else {
            None
        };
        let out = PyTuple::new(
            py,
            [
                self.slot_name(py, s).into_any(),
                leading.into_pyobject(py)?.into_any(),
                id.into_pyobject(py)?.into_any(),
                keys_out.unwrap_or_else(|| py.None().into_bound(py)),
            ],
        )?;
        Ok(Some(out.into_any()))
    }

    /// Request `id` (None: its oldest without one) sent to `worker` produced its first token.
    /// False if no such request is waiting there.
    #[pyo3(signature = (worker, id, now))]
    fn first_token(&mut self, worker: &str, id: Option<u64>, now: f64) -> bool {
        match self.by_name.get(worker) {
            Some(&s) => self.slots[s as usize].work.first_token(id, now),
            None => false,
        }
    }

    /// Request `id` (None: its oldest) sent to `worker` ended: `(id, time sent)`, or None if
    /// the worker has no such request in flight.
    #[pyo3(signature = (worker, id, now))]
    fn done(&mut self, worker: &str, id: Option<u64>, now: f64) -> Option<(u64, f64)> {
        let &s = self.by_name.get(worker)?;
        let f = self.slots[s as usize].work.done(id, now)?;
        Some((f.id, f.sent))
    }

    /// Decisions made (requests put in flight).
    #[getter]
    fn decisions(&self) -> u64 {
        self.next_id
    }

    /// Every worker this core has seen, in name order.
    fn workers<'py>(&self, py: Python<'py>) -> Vec<Bound<'py, PyString>> {
        self.order.iter().map(|&s| self.slot_name(py, s)).collect()
    }

    /// `{worker: requests in flight}` for workers with any.
    fn in_flight<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let out = PyDict::new(py);
        for &s in &self.order {
            let n = self.slots[s as usize].work.flights.len();
            if n > 0 {
                out.set_item(self.slots[s as usize].name.bind(py), n)?;
            }
        }
        Ok(out)
    }

    /// Requests sent to `worker` after clock time `ts` and still in flight.
    fn routed_since(&self, worker: &str, ts: f64) -> usize {
        self.by_name.get(worker).map_or(0, |&s| {
            let flights = &self.slots[s as usize].work.flights;
            flights.iter().filter(|f| f.sent > ts).count()
        })
    }

    /// The workers' latest LoadReports (`{worker: report}`, each with `running` and
    /// `kv_cache_usage`): a worker not named has none.
    fn set_reports(&mut self, py: Python<'_>, reports: &Bound<'_, PyDict>) -> PyResult<()> {
        for slot in &mut self.slots {
            slot.report = None;
        }
        for (name, report) in reports.iter() {
            let name = worker_name("reports", &name)?;
            let s = self.slot(&name);
            self.slots[s as usize].report = read_report(&report)?;
        }
        let _ = py;
        Ok(())
    }
}

impl RouterCore {
    /// The slot of worker `name`, made on first sight (kept in name order).
    fn slot(&mut self, name: &Bound<'_, PyString>) -> u32 {
        let s = name.to_str().expect("a str");
        if let Some(&id) = self.by_name.get(s) {
            return id;
        }
        let id = self.slots.len() as u32;
        let key: Arc<str> = Arc::from(s);
        self.slots.push(Slot {
            name: name.clone().unbind(),
            key: key.clone(),
            work: Work::default(),
            report: None,
            clears_seen: None,
            listed: false,
            pid: None,
            seen: 0,
            score: Score::None,
            indexed: 0,
            clears_now: 0,
            asked: 0,
            hit: 0,
            hit_at: 0,
        });
        self.by_name.insert(key, id);
        let slots = &self.slots;
        let at = self.order.partition_point(|&o| *slots[o as usize].key < *s);
        self.order.insert(at, id);
        id
    }

    fn slot_name<'py>(&self, py: Python<'py>, s: u32) -> Bound<'py, PyString> {
        self.slots[s as usize].name.bind(py).clone()
    }

    fn medium(&mut self, name: Option<&str>) -> u32 {
        if let Some(i) = self.media.iter().position(|m| m.name.as_deref() == name) {
            return i as u32;
        }
        let weight = self.weight_of(name.unwrap_or("GPU"));
        self.media.push(Medium {
            name: name.map(str::to_string),
            weight,
            gpu: name == Some("GPU"),
        });
        (self.media.len() - 1) as u32
    }

    /// A medium's weight (`medium_weights`; one not named there counts as the lowest).
    fn weight_of(&self, medium: &str) -> f64 {
        self.weights
            .iter()
            .find(|w| w.0 == medium)
            .map_or(self.lowest, |w| w.1)
    }

    /// Each candidate's cost into `self.costs`, in candidate order.
    fn weigh(
        &mut self,
        py: Python<'_>,
        now: f64,
        num_blocks: i64,
        num_tokens: i64,
        load: Option<&Bound<'_, PyDict>>,
    ) -> PyResult<()> {
        if !self.time {
            self.costs.clear();
            for i in 0..self.cands.len() {
                let s = self.cands[i];
                let held = self.overlap(s).unwrap_or(0.0);
                let b = num_blocks as f64;
                let given = match load {
                    Some(loads) => loads.get_item(self.slot_name(py, s))?,
                    None => None,
                };
                let load = match given {
                    Some(v) => v.extract::<f64>()?,
                    None => self.slots[s as usize].work.flights.len() as f64,
                };
                self.costs.push(Cost {
                    ms: self.overlap_weight * (b - if held < b { held } else { b }) + load,
                    uncached: num_tokens as f64,
                    idle: false,
                });
            }
            return Ok(());
        }
        let mut cands = std::mem::take(&mut self.views);
        cands.clear();
        for &s in &self.cands {
            let report = match &self.report_fn {
                Some(f) => read_report(&f.bind(py).call1((self.slot_name(py, s),))?)?,
                None => self.slots[s as usize].report,
            };
            let slot = &self.slots[s as usize];
            cands.push(Candidate {
                held: self.overlap(s).unwrap_or(0.0),
                busy: !slot.work.flights.is_empty(),
                decoding: slot.work.decoding as f64,
                report,
            });
        }
        let (slots, order) = (&self.slots, &self.cands);
        time_costs(
            &self.engine,
            &cands,
            |i, step| {
                slots[order[i] as usize]
                    .work
                    .queued(now, &self.engine, step)
            },
            num_tokens,
            self.block_size,
            self.overlap_weight,
            self.backlog_weight,
            &mut self.costs,
            &mut self.rows,
        );
        self.views = cands;
        Ok(())
    }

    /// The request is in flight on slot `s` (and, with keys, provisionally held there).
    fn commit(
        &mut self,
        py: Python<'_>,
        s: u32,
        num_tokens: i64,
        uncached: f64,
        now: f64,
        use_keys: bool,
    ) -> PyResult<u64> {
        let id = self.next_id;
        self.next_id += 1;
        let flight = Flight {
            id,
            prompt: num_tokens,
            uncached,
            sent: now,
            first_token: None,
        };
        self.slots[s as usize].work.add(flight, now, &self.engine);
        if use_keys && !self.keys.is_empty() {
            let prov = self.provisional.clone_ref(py);
            let mut prov = prov.bind(py).borrow_mut();
            if prov.core.enabled() {
                // provisional residency's clock, read once a decision
                let t = match self.prov_now {
                    Some(t) => t,
                    None => prov.now(py)?,
                };
                let pid = match self.slots[s as usize].pid {
                    Some(p) => p,
                    None => {
                        let p = prov.id(py, self.slots[s as usize].name.bind(py));
                        self.link(p, s);
                        p
                    }
                };
                let slot = &self.slots[s as usize];
                let hit = if slot.hit_at == self.epoch {
                    slot.hit
                } else {
                    0
                };
                let start = (hit.max(0) as usize).min(self.keys.len());
                prov.add_at(pid, &self.keys, start, t, None);
            }
            if self.index.is_some() {
                let slot = &mut self.slots[s as usize];
                slot.clears_seen = Some((slot.indexed == self.epoch).then_some(slot.clears_now));
            }
        }
        Ok(id)
    }
}

/// `rng.choice(seq)`'s index for a sequence of `n`, drawing as `random.Random._randbelow` does
/// (`getrandbits` of n's bit length until below n): the same draws, so a seeded router ties the
/// same way as one that calls `choice` itself.
fn rand_below(rng: &Bound<'_, PyAny>, n: usize) -> PyResult<usize> {
    let bits = usize::BITS - n.leading_zeros();
    let draw = rng.getattr(pyo3::intern!(rng.py(), "getrandbits"))?;
    loop {
        let r: usize = draw.call1((bits,))?.extract()?;
        if r < n {
            return Ok(r);
        }
    }
}

/// A LoadReport's (running, kv_cache_usage), or None for None.
fn read_report(report: &Bound<'_, PyAny>) -> PyResult<Option<(i64, f64)>> {
    if report.is_none() {
        return Ok(None);
    }
    Ok(Some((
        report.getattr("running")?.extract()?,
        report.getattr("kv_cache_usage")?.extract()?,
    )))
}
