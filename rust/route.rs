//! `kvbridge._native.RouterCore` and `ProvisionalResidency`: a routing decision in one native
//! call. `kvbridge.routing.router.Router` is the Python face (its module doc states the cost,
//! and what each argument means); this is its state and its hot path: the prompt's keys, the
//! index's overlap per worker and storage tier (read in place, under the index's lock),
//! provisional residency, each worker's requests in flight and queued work, the cost per
//! candidate, the pick and its bookkeeping. A decision at 64 workers cost ~200 us as Python
//! loops per candidate; here it is a few microseconds beside the index's own query.
//!
//! The rules are Python's, evaluated in the same order with the same floating-point
//! operations, so a replay's decisions do not change with the implementation (the tests in
//! tests/test_router_native.py replay traces through both orders of the same arithmetic).
//! `provisional` and `work` hold the pyo3-free parts.

mod provisional;
mod work;

use std::collections::HashMap;
use std::sync::Arc;

use pyo3::exceptions::{PyTypeError, PyValueError};
use pyo3::prelude::*;
use pyo3::types::{PyDict, PyFloat, PyInt, PyList, PyMapping, PyString, PyTuple};

use self::provisional::Provisional;
use self::work::{time_costs, Candidate, Cost, Engine, Flight, Work};
use crate::index::Index;

pub fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<ProvisionalResidency>()?;
    m.add_class::<RouterCore>()
}

// --- provisional residency ---------------------------------------------------------------------

/// What a router has just sent each worker, before the worker says it holds it
/// (kvbridge.routing.provisional's module doc). Worker names are interned: ids are never reused.
#[pyclass(module = "kvbridge._native")]
pub struct ProvisionalResidency {
    core: Provisional,
    names: Vec<Py<PyString>>,
    ids: HashMap<String, u32>,
    /// The time in seconds (a callable; default `time.monotonic`).
    #[pyo3(get, set)]
    clock: Py<PyAny>,
}

#[pymethods]
impl ProvisionalResidency {
    #[new]
    #[pyo3(signature = (ttl_s = None, *, max_entries = None, clock = None))]
    fn new(
        py: Python<'_>,
        ttl_s: Option<&Bound<'_, PyAny>>,
        max_entries: Option<&Bound<'_, PyAny>>,
        clock: Option<Py<PyAny>>,
    ) -> PyResult<Self> {
        let ttl = match ttl_s {
            None => 2.0,
            Some(v) => {
                let ok = (v.is_instance_of::<PyInt>() || v.is_instance_of::<PyFloat>())
                    && !v.is_instance_of::<pyo3::types::PyBool>();
                match ok.then(|| v.extract::<f64>()).transpose()? {
                    Some(t) if t >= 0.0 => t,
                    _ => {
                        return Err(PyValueError::new_err(format!(
                            "provisional_ttl_s must be a number of seconds >= 0, got {}",
                            v.repr()?
                        )))
                    }
                }
            }
        };
        let max = match max_entries {
            None => 100_000,
            Some(v) => {
                let ok = v.is_instance_of::<PyInt>() && !v.is_instance_of::<pyo3::types::PyBool>();
                match ok.then(|| v.extract::<i64>().ok()).flatten() {
                    Some(n) if n >= 1 => n as usize,
                    _ => {
                        return Err(PyValueError::new_err(format!(
                            "max_provisional must be an int >= 1, got {}",
                            v.repr()?
                        )))
                    }
                }
            }
        };
        let clock = match clock {
            Some(c) => c,
            None => py.import("time")?.getattr("monotonic")?.unbind(),
        };
        Ok(ProvisionalResidency {
            core: Provisional::new(ttl, max),
            names: Vec::new(),
            ids: HashMap::new(),
            clock,
        })
    }

    #[getter]
    fn ttl_s(&self) -> f64 {
        self.core.ttl_s
    }

    #[getter]
    fn max_entries(&self) -> usize {
        self.core.max_entries
    }

    #[getter]
    fn enabled(&self) -> bool {
        self.core.enabled()
    }

    /// (key, worker) entries held.
    fn __len__(&self) -> usize {
        self.core.len()
    }

    /// Counters: added, expired, dropped (past max_entries) in entries; confirmed and reset in
    /// calls that took something away.
    #[getter]
    fn stats<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let out = PyDict::new(py);
        for (k, v) in self.core.stats.pairs() {
            out.set_item(k, v)?;
        }
        Ok(out)
    }

    /// `worker` is about to hold blocks `keys` (a prompt's chain, first block first). `ttl_s`:
    /// the time left of a peer's decision (default the full TTL).
    #[pyo3(signature = (worker, keys, *, ttl_s = None))]
    fn add(
        &mut self,
        py: Python<'_>,
        worker: &Bound<'_, PyAny>,
        keys: &Bound<'_, PyAny>,
        ttl_s: Option<f64>,
    ) -> PyResult<()> {
        let worker = worker_name("worker", worker)?;
        let keys = read_keys(keys)?;
        if !self.core.enabled() || keys.is_empty() {
            return Ok(());
        }
        let now = self.now(py)?;
        let id = self.id(py, &worker);
        self.add_at(id, &keys, 0, now, ttl_s);
        Ok(())
    }

    /// Per worker, how many leading blocks of `keys` it is expected to hold.
    fn scores<'py>(
        &mut self,
        py: Python<'py>,
        keys: &Bound<'py, PyAny>,
    ) -> PyResult<Bound<'py, PyDict>> {
        let keys = read_keys(keys)?;
        let out = PyDict::new(py);
        if self.core.len() == 0 || keys.is_empty() {
            return Ok(out);
        }
        let now = self.now(py)?;
        let mut found = Vec::new();
        self.core.leading(&keys, now, &mut found);
        for (id, n) in found {
            out.set_item(self.names[id as usize].bind(py), n)?;
        }
        Ok(out)
    }

    /// The worker's own events now show it holding `keys`: its entries for them end.
    fn confirm(&mut self, worker: &Bound<'_, PyAny>, keys: &Bound<'_, PyAny>) -> PyResult<()> {
        let worker = worker_name("worker", worker)?;
        let keys = read_keys(keys)?;
        if let Some(&id) = self.ids.get(worker.to_str()?) {
            self.core.confirm(id, &keys);
        }
        Ok(())
    }

    /// The worker's cache was reset, cleared or it is gone: nothing it was sent stays.
    fn reset(&mut self, worker: &Bound<'_, PyAny>) -> PyResult<()> {
        let worker = worker_name("worker", worker)?;
        if let Some(&id) = self.ids.get(worker.to_str()?) {
            self.core.reset(id);
        }
        Ok(())
    }
}

impl ProvisionalResidency {
    fn now(&self, py: Python<'_>) -> PyResult<f64> {
        self.clock.bind(py).call0()?.extract()
    }

    fn id(&mut self, py: Python<'_>, name: &Bound<'_, PyString>) -> u32 {
        let s = name.to_str().expect("a str read before");
        if let Some(&id) = self.ids.get(s) {
            return id;
        }
        let id = self.names.len() as u32;
        self.names.push(name.clone().unbind());
        self.ids.insert(s.to_string(), id);
        let _ = py;
        id
    }

    /// `keys[start..]` of a prompt's chain to worker `id` for the TTL (or `ttl_s`, if shorter).
    fn add_at(&mut self, id: u32, keys: &[u64], start: usize, now: f64, ttl_s: Option<f64>) {
        let ttl = ttl_s.map_or(self.core.ttl_s, |t| t.min(self.core.ttl_s));
        let expiry = now + ttl;
        if expiry > now {
            self.core.add(id, keys, start, expiry, now);
        }
    }
}

fn worker_name<'py>(arg: &str, obj: &Bound<'py, PyAny>) -> PyResult<Bound<'py, PyString>> {
    match obj.cast::<PyString>() {
        Ok(s) if !s.to_str()?.is_empty() => Ok(s.clone()),
        _ => Err(PyTypeError::new_err(format!(
            "{arg}: a worker is a non-empty str, got {}",
            obj.repr()?
        ))),
    }
}

/// Block keys as a router passes them: ints of 64 bits (a list, a tuple or any iterable).
fn read_keys(obj: &Bound<'_, PyAny>) -> PyResult<Vec<u64>> {
    let mut out = Vec::with_capacity(obj.len().unwrap_or(0));
    for (i, item) in obj
        .try_iter()
        .map_err(|_| PyTypeError::new_err("keys must be a sequence of int"))?
        .enumerate()
    {
        let item = item?;
        out.push(item.extract::<u64>().map_err(|_| {
            PyValueError::new_err(format!(
                "keys[{i}] must be an int in 0..2**64, got {}",
                item.repr().map(|r| r.to_string()).unwrap_or_default()
            ))
        })?);
    }
    Ok(out)
}

// --- the router's core -----------------------------------------------------------------------

/// A storage tier as the router weighs it.
struct Medium {
    name: Option<String>,
    weight: f64,
    /// Named "GPU" (what provisional residency counts in; the medium None is a different key
    /// of a score, though it weighs the same).
    gpu: bool,
}

/// A worker's score in this decision.
#[derive(Clone, Copy, PartialEq)]
enum Score {
    None,
    /// Leading blocks (a score given as an int, or provisional residency alone).
    Plain(i64),
    /// Per medium: `entries[start..end]`, and the "GPU" medium raised to at least `gpu` by
    /// provisional residency (0: not raised).
    Media {
        start: u32,
        end: u32,
        gpu: i64,
    },
}

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
    resyncing: u64,
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

/// What a decision reads of the index under its lock (kept for the allocations).
#[derive(Default)]
struct IndexRead {
    /// (worker id, medium id, leading blocks) per hit.
    rows: Vec<(u32, u8, u32)>,
    one: Vec<(u32, u32)>,
    /// (worker id, cache clears) per live worker.
    workers: Vec<(u32, u64)>,
    /// Workers not yet known under their id: (id, name).
    misses: Vec<(u32, Arc<str>)>,
    /// The media the hits are in: (medium id, name).
    media: Vec<(u8, Option<String>)>,
}

impl IndexRead {
    /// The index's live workers and their clears; `cache` (index id -> the router's slot, with
    /// the name it had) says which names are new: a name is copied only then (Arcs compared,
    /// not strings).
    fn workers_of(&mut self, core: &crate::index::core::Core, cache: &[Option<(Arc<str>, u32)>]) {
        self.workers.clear();
        self.misses.clear();
        for (w, name, clears) in core.workers_with_clears() {
            self.workers.push((w, clears));
            let known = cache
                .get(w as usize)
                .and_then(Option::as_ref)
                .is_some_and(|c| Arc::ptr_eq(&c.0, name));
            if !known {
                self.misses.push((w, name.clone()));
            }
        }
    }
}

/// What one decision is asked.
struct Ask<'a, 'py> {
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
        let mut keys_buf = std::mem::take(&mut self.keys);
        keys_buf.clear();
        if let Some(k) = keys {
            keys_buf = read_keys(k)?;
        }
        self.keys = keys_buf;
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
        // are not idle first.
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
            resyncing: 0,
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
        let look = name.unwrap_or("GPU");
        let weight = self
            .weights
            .iter()
            .find(|w| w.0 == look)
            .map_or(self.lowest, |w| w.1);
        self.media.push(Medium {
            name: name.map(str::to_string),
            weight,
            gpu: name == Some("GPU"),
        });
        (self.media.len() - 1) as u32
    }

    /// Scores every worker (index or given scores, resyncing workers left out, provisional
    /// residency merged) and collects the candidates in name order. (num_blocks, num_tokens).
    fn score(&mut self, py: Python<'_>, ask: &Ask<'_, '_>) -> PyResult<(i64, i64)> {
        self.epoch += 1;
        self.prov_now = None;
        let epoch = self.epoch;
        self.entries.clear();
        self.scored.clear();
        let (mut num_blocks, mut num_tokens) = (ask.num_blocks, ask.num_tokens);
        if let Some(tokens) = ask.tokens {
            let index = self
                .index
                .as_ref()
                .expect("tokens need a kvbridge.Index")
                .clone_ref(py);
            let remote = self.remote;
            let mut keys = std::mem::take(&mut self.keys);
            let mut read = std::mem::take(&mut self.read);
            let cache = &self.index_slot;
            let got = index.get().route_query(
                py,
                tokens,
                ask.lora_name,
                ask.extra_keys,
                &mut keys,
                |core, keys| {
                    core.find_matches_by_medium_into(keys, remote, &mut read.one, &mut read.rows);
                    read.workers_of(core, cache);
                    read.media.clear();
                    for &(_, m, _) in &read.rows {
                        if !read.media.iter().any(|x| x.0 == m) {
                            read.media
                                .push((m, core.medium_name(m).map(str::to_string)));
                        }
                    }
                },
            );
            self.keys = keys;
            let outcome = got.map(|()| self.apply_read(py, &read));
            self.read = read;
            outcome?;
            num_tokens = tokens.len()? as i64;
            num_blocks = num_tokens / self.block_size as i64;
        } else {
            if let Some(index) = &self.index {
                let mut read = std::mem::take(&mut self.read);
                let cache = &self.index_slot;
                index.get().route_workers(py, |core| {
                    read.rows.clear();
                    read.workers_of(core, cache);
                });
                self.apply_read(py, &read);
                self.read = read;
            }
            if let Some(scores) = ask.scores {
                for (name, score) in scores.iter() {
                    let name = worker_name("scores", &name)?;
                    let s = self.slot(&name);
                    let score = self.read_score(&name, &score)?;
                    self.set_score(s, score);
                }
            }
        }
        if ask.use_keys {
            if let Some(resync) = ask.resyncing {
                for name in resync.try_iter()? {
                    let name = name?;
                    let name = worker_name("resyncing", &name)?;
                    let s = self.slot(&name);
                    let slot = &mut self.slots[s as usize];
                    slot.resyncing = epoch;
                    if slot.seen == epoch {
                        slot.seen = 0;
                    }
                }
            }
            for i in 0..self.scored.len() {
                let s = self.scored[i];
                if self.slots[s as usize].seen == epoch {
                    let hit = self.leading(s);
                    let slot = &mut self.slots[s as usize];
                    (slot.hit, slot.hit_at) = (hit, epoch);
                }
            }
            if !self.keys.is_empty() {
                self.merge_provisional(py)?;
            }
        }
        self.candidates(py, ask.workers)?;
        Ok((num_blocks, num_tokens))
    }

    fn set_score(&mut self, s: u32, score: Score) {
        let slot = &mut self.slots[s as usize];
        slot.seen = self.epoch;
        slot.score = score;
        self.scored.push(s);
    }

    fn read_score(
        &mut self,
        name: &Bound<'_, PyString>,
        score: &Bound<'_, PyAny>,
    ) -> PyResult<Score> {
        let media = match score.cast::<PyDict>() {
            Ok(d) => Some(d.clone()),
            Err(_) if score.is_instance_of::<PyInt>() => None,
            Err(_) => match score.cast::<PyMapping>() {
                Ok(m) => Some(PyDict::from_sequence(&m.items()?.into_any())?),
                Err(_) => None,
            },
        };
        if let Some(media) = media {
            let start = self.entries.len() as u32;
            for (m, n) in media.iter() {
                let m = if m.is_none() {
                    None
                } else {
                    Some(
                        m.cast::<PyString>()
                            .map_err(|_| {
                                PyTypeError::new_err(format!(
                                    "scores[{}]: a medium is a str or None, got {}",
                                    name.repr().map(|r| r.to_string()).unwrap_or_default(),
                                    m.repr().map(|r| r.to_string()).unwrap_or_default()
                                ))
                            })?
                            .to_str()?
                            .to_string(),
                    )
                };
                let id = self.medium(m.as_deref());
                self.entries.push((id, count(name, &n)?));
            }
            let end = self.entries.len() as u32;
            return Ok(Score::Media { start, end, gpu: 0 });
        }
        Ok(Score::Plain(count(name, score)?))
    }

    /// What the index said, into this decision: its live workers marked (with their clears),
    /// each hit as a per-medium score.
    fn apply_read(&mut self, py: Python<'_>, read: &IndexRead) {
        for (w, name) in &read.misses {
            let s = self.slot(&PyString::new(py, name));
            let i = *w as usize;
            if self.index_slot.len() <= i {
                self.index_slot.resize(i + 1, None);
            }
            self.index_slot[i] = Some((name.clone(), s));
        }
        let epoch = self.epoch;
        for &(w, clears) in &read.workers {
            let s = self.index_slot[w as usize].as_ref().expect("cached").1;
            let slot = &mut self.slots[s as usize];
            slot.indexed = epoch;
            slot.clears_now = clears;
        }
        let mut ids = [u32::MAX; 256];
        for (m, name) in &read.media {
            ids[*m as usize] = self.medium(name.as_deref());
        }
        let rows = &read.rows;
        let mut i = 0;
        while i < rows.len() {
            let w = rows[i].0;
            // Every worker with a hit is live, so marked just now.
            let s = self.index_slot[w as usize]
                .as_ref()
                .expect("a live worker")
                .1;
            let start = self.entries.len() as u32;
            while i < rows.len() && rows[i].0 == w {
                self.entries
                    .push((ids[rows[i].1 as usize], rows[i].2 as i64));
                i += 1;
            }
            let end = self.entries.len() as u32;
            self.set_score(s, Score::Media { start, end, gpu: 0 });
        }
    }

    /// The leading blocks a worker holds in any medium, as scored in this decision.
    fn leading(&self, s: u32) -> i64 {
        let slot = &self.slots[s as usize];
        if slot.seen != self.epoch {
            return 0;
        }
        match slot.score {
            Score::None => 0,
            Score::Plain(n) => n,
            Score::Media { start, end, gpu } => {
                let most = self.entries[start as usize..end as usize]
                    .iter()
                    .map(|e| e.1)
                    .max()
                    .unwrap_or(0);
                // Provisional residency raises a score only past its leading blocks.
                most.max(gpu)
            }
        }
    }

    /// The overlap in blocks, each counted at the best tier holding it (`tiered_overlap`).
    fn overlap(&self, s: u32) -> Option<f64> {
        let slot = &self.slots[s as usize];
        if slot.seen != self.epoch {
            return None;
        }
        Some(match slot.score {
            Score::None => return None,
            Score::Plain(n) => n as f64,
            Score::Media { start, end, gpu } => {
                let entries = &self.entries[start as usize..end as usize];
                if let ([(m, n)], 0) = (entries, gpu) {
                    // one medium (the common case)
                    return Some(*n as f64 * self.media[*m as usize].weight);
                }
                let gpu_weight = || {
                    self.weights
                        .iter()
                        .find(|w| w.0 == "GPU")
                        .map_or(self.lowest, |w| w.1)
                };
                // (n, weight) per medium, the "GPU" one raised by provisional residency.
                let mut tiers: Vec<(i64, f64)> = entries
                    .iter()
                    .map(|&(m, n)| {
                        let m = &self.media[m as usize];
                        (if m.gpu && gpu > n { gpu } else { n }, m.weight)
                    })
                    .collect();
                if gpu > 0 && !entries.iter().any(|e| self.media[e.0 as usize].gpu) {
                    tiers.push((gpu, gpu_weight()));
                }
                if tiers.len() == 1 {
                    return Some(tiers[0].0 as f64 * tiers[0].1);
                }
                tiers.retain(|t| t.0 > 0);
                tiers.sort_by(|a, b| b.partial_cmp(a).expect("finite weights"));
                let (mut total, mut best) = (0.0, 0.0f64);
                for i in 0..tiers.len() {
                    best = best.max(tiers[i].1);
                    let below = tiers.get(i + 1).map_or(0, |t| t.0);
                    total += best * (tiers[i].0 - below) as f64;
                }
                total
            }
        })
    }

    /// Provisional residency extends each worker's hit by what it was just sent past it (or,
    /// without a hit, from the prompt's first block); what its own hit now covers is confirmed
    /// (those entries end), and a worker whose cache the index saw cleared since loses them.
    fn merge_provisional(&mut self, py: Python<'_>) -> PyResult<()> {
        let prov = self.provisional.clone_ref(py);
        let mut prov = prov.bind(py).borrow_mut();
        if !prov.core.enabled() || prov.core.len() == 0 {
            return Ok(());
        }
        let now = prov.now(py)?;
        self.prov_now = Some(now);
        prov.core.prune(now);
        let keys = std::mem::take(&mut self.keys);
        let n = keys.len();
        // Workers with a hit: their run from where it ends. Hits end at a few positions for
        // many workers: each position's holders are looked up once.
        let mut cache: Vec<(usize, Vec<u32>)> = Vec::new();
        let scored = std::mem::take(&mut self.scored);
        for &s in &scored {
            let Some(pid) = self.slots[s as usize].pid else {
                continue;
            };
            let hit = self.leading(s);
            if hit <= 0 || self.slots[s as usize].seen != self.epoch {
                continue;
            }
            let hit = (hit as usize).min(n);
            let mut held_at = |i: usize| {
                let j = match cache.iter().position(|a| a.0 == i) {
                    Some(j) => j,
                    None => {
                        cache.push((i, prov.core.starting(keys[i])));
                        cache.len() - 1
                    }
                };
                cache[j].1.contains(&pid)
            };
            let covered = held_at(hit - 1);
            let run = if hit < n && held_at(hit) {
                1 + prov.core.run(pid, &keys, hit + 1)
            } else {
                0
            };
            if (covered || run > 0) && self.cleared_since(s) {
                prov.core.reset(pid);
                continue;
            }
            if covered {
                prov.core.confirm(pid, &keys[..hit]);
            }
            if run > 0 {
                self.raise(s, (hit + run) as i64);
            }
        }
        self.scored = scored;
        // Workers without one: their run from the first block.
        let starting = prov.core.starting(keys[0]);
        for pid in starting {
            let s = self.prov_to_slot(py, &prov, pid);
            if self.leading(s) > 0 {
                continue;
            }
            let run = prov.core.run(pid, &keys, 0);
            if run == 0 {
                continue;
            }
            if self.cleared_since(s) {
                prov.core.reset(pid);
                continue;
            }
            self.raise(s, run as i64);
        }
        self.keys = keys;
        Ok(())
    }

    /// Raises slot `s`'s score to `sent` leading blocks (counted on the GPU).
    fn raise(&mut self, s: u32, sent: i64) {
        let epoch = self.epoch;
        let slot = &mut self.slots[s as usize];
        let score = if slot.seen == epoch {
            slot.score
        } else {
            Score::None
        };
        slot.score = match score {
            Score::Media { start, end, gpu } => Score::Media {
                start,
                end,
                gpu: gpu.max(sent),
            },
            _ => Score::Plain(sent),
        };
        slot.seen = epoch;
    }

    fn prov_to_slot(&mut self, py: Python<'_>, prov: &ProvisionalResidency, pid: u32) -> u32 {
        if let Some(&s) = self.prov_slot.get(pid as usize).filter(|&&s| s != u32::MAX) {
            return s;
        }
        let s = self.slot(prov.names[pid as usize].bind(py));
        if self.prov_slot.len() <= pid as usize {
            self.prov_slot.resize(pid as usize + 1, u32::MAX);
        }
        self.prov_slot[pid as usize] = s;
        self.slots[s as usize].pid = Some(pid);
        s
    }

    /// Whether the index saw the worker's cache cleared (or forgot the worker) since the
    /// router's last decision for it.
    fn cleared_since(&mut self, s: u32) -> bool {
        let epoch = self.epoch;
        let slot = &mut self.slots[s as usize];
        let Some(seen) = slot.clears_seen else {
            return false;
        };
        let now = (slot.indexed == epoch).then_some(slot.clears_now);
        slot.clears_seen = Some(now);
        // None -> 0 is the worker's first events reaching the index, not a clear; 0 -> None
        // is the worker removed (expired, restarted).
        !(now == seen || (seen.is_none() && now.unwrap_or(0) == 0))
    }

    fn candidates(&mut self, py: Python<'_>, workers: Option<&Bound<'_, PyAny>>) -> PyResult<()> {
        let epoch = self.epoch;
        self.cands.clear();
        if let Some(workers) = workers {
            for w in workers.try_iter()? {
                let w = w?;
                let name = worker_name("workers", &w)?;
                let s = self.slot(&name);
                self.slots[s as usize].asked = epoch;
            }
            let slots = &self.slots;
            self.cands.extend(
                self.order
                    .iter()
                    .filter(|&&s| slots[s as usize].asked == epoch),
            );
            return Ok(());
        }
        let slots = &self.slots;
        self.cands.extend(self.order.iter().filter(|&&s| {
            let slot = &slots[s as usize];
            slot.listed || slot.indexed == epoch || slot.seen == epoch
        }));
        let _ = py;
        Ok(())
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
            |i, rate| slots[order[i] as usize].work.queued(now, rate),
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
        let rate = self.engine.routing_rate();
        let flight = Flight {
            id,
            prompt: num_tokens,
            uncached,
            sent: now,
            first_token: None,
        };
        self.slots[s as usize].work.add(flight, now, rate);
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
                        if self.prov_slot.len() <= p as usize {
                            self.prov_slot.resize(p as usize + 1, u32::MAX);
                        }
                        self.prov_slot[p as usize] = s;
                        self.slots[s as usize].pid = Some(p);
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

fn count(name: &Bound<'_, PyString>, n: &Bound<'_, PyAny>) -> PyResult<i64> {
    n.extract::<i64>().map_err(|_| {
        PyTypeError::new_err(format!(
            "scores[{}]: a block count is an int, got {}",
            name.repr().map(|r| r.to_string()).unwrap_or_default(),
            n.repr().map(|r| r.to_string()).unwrap_or_default()
        ))
    })
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
