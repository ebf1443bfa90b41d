//! `ProvisionalResidency`'s Python face: worker names interned to the ids of the pyo3-free table
//! (`provisional`), its clock, the argument checks. A router's core reaches the table directly.

use std::collections::HashMap;

use pyo3::exceptions::{PyTypeError, PyValueError};
use pyo3::prelude::*;
use pyo3::types::{PyDict, PyFloat, PyInt, PyString};

use super::provisional::Provisional;
/// What a router has just sent each worker, before the worker says it holds it
/// (kvbridge.routing.provisional's module doc). Worker names are interned: ids are never reused.
#[pyclass(module = "kvbridge._native")]
pub struct ProvisionalResidency {
    pub(super) core: Provisional,
    pub(super) names: Vec<Py<PyString>>,
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
                            "ttl_s (Router: provisional_ttl_s) must be a number of seconds >= 0, got {}",
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
                            "max_entries (Router: max_provisional) must be an int >= 1, got {}",
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
    pub(super) fn now(&self, py: Python<'_>) -> PyResult<f64> {
        self.clock.bind(py).call0()?.extract()
    }

    pub(super) fn id(&mut self, py: Python<'_>, name: &Bound<'_, PyString>) -> u32 {
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
    pub(super) fn add_at(
        &mut self,
        id: u32,
        keys: &[u64],
        start: usize,
        now: f64,
        ttl_s: Option<f64>,
    ) {
        let ttl = ttl_s.map_or(self.core.ttl_s, |t| t.min(self.core.ttl_s));
        let expiry = now + ttl;
        if expiry > now {
            self.core.add(id, keys, start, expiry, now);
        }
    }
}

pub(super) fn worker_name<'py>(
    arg: &str,
    obj: &Bound<'py, PyAny>,
) -> PyResult<Bound<'py, PyString>> {
    match obj.cast::<PyString>() {
        Ok(s) if !s.to_str()?.is_empty() => Ok(s.clone()),
        _ => Err(PyTypeError::new_err(format!(
            "{arg}: a worker is a non-empty str, got {}",
            obj.repr()?
        ))),
    }
}

/// Block keys as a router passes them: ints of 64 bits (a list, a tuple or any iterable).
pub(super) fn read_keys(obj: &Bound<'_, PyAny>) -> PyResult<Vec<u64>> {
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
