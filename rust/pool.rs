//! `KVCacheManager` in native code: the request level of the prefix-caching block pool, with
//! every public method one call that holds the GIL throughout, so a request's hashing and all
//! of its block bookkeeping cost one Python->native transition.
//!
//! The semantics are those of `PyKVCacheManager` in python/kvbridge/engine/_reference_pool.py, the executable
//! spec (its docstring states the rules; tests/test_pool.py runs both side by side, step by
//! step). Hashing reuses the chains in `crate::hash`; token lists are read with the encoder's
//! verified CPython fast path (`crate::cpython`), anything else with the hashing's
//! reader, so the errors are the hashing's own.
//!
//! Threading: one mutex serialises the public methods, like the spec's lock. It is taken with
//! the GIL held and released only around a contended wait (`lock_py_attached`), so it cannot
//! deadlock with the GIL; Python code that may run inside a method (a request id's `__hash__`,
//! a garbage collection while events are built) can switch threads, which is why this is a real
//! lock rather than reliance on the GIL. Events and snapshots are copied out under the lock
//! and turned into Python objects after it is released.

pub(crate) mod core;
mod events;
mod wire;

use std::collections::HashMap;
use std::sync::{Mutex, MutexGuard};

use pyo3::exceptions::{PyKeyError, PyRuntimeError, PyTypeError, PyValueError};
use pyo3::prelude::*;
use pyo3::sync::MutexExt;
use pyo3::types::{PyBytes, PyDict, PyInt, PyList, PyString, PyTuple};

use crate::cpython::{self, Layout};
use crate::encode::msgpack::{put_array_header, put_float, put_int};
use crate::hash::algo::{Algo, Chain, Digest};
use crate::hash::args::new_chain;
use crate::hash::tokens;
use crate::hash::value::Value;

use self::core::{Core, Record};
use self::events::{Classes, Context, Ints, Lora};

/// From this many tokens on, hashing runs with the GIL released (as `hash_blocks` does).
const DETACH_MIN_TOKENS: usize = 1 << 16;

/// The spec's MAIN_KINDS / WINDOW_KINDS / MAX_GROUPS (python/kvbridge/engine/_reference_pool.py).
const MAIN_KINDS: [&str; 3] = ["full_attention", "mla_attention", "sink_full_attention"];
const WINDOW_KINDS: [&str; 2] = ["sliding_window", "sliding_window_mla"];
const MAX_GROUPS: usize = 64;
/// A window group's table entry for a block it released (vLLM's null block).
const NULL_BLOCK: u32 = u32::MAX;

pub fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<Manager>()?;
    m.add_class::<EventRecord>()?;
    m.add_function(wrap_pyfunction!(encode_records, m)?)
}

/// `encode_records` keeps its buffer between calls up to this size.
const KEEP_BUFFER_BYTES: usize = 8 << 20;

thread_local! {
    static OUT: std::cell::RefCell<Vec<u8>> = const { std::cell::RefCell::new(Vec::new()) };
}

/// A manager's drained events kept as its record (`KVCacheManager.take_record`): no Python
/// object per event, hash or token id until `events()` asks for them, and written as msgpack
/// from the record itself by `encode_records`.
#[pyclass(module = "kvbridge._native", name = "EventRecord", frozen)]
pub struct EventRecord {
    rec: Record,
    manager: Py<Manager>,
    /// The medium as its events carry it; None for a pool whose events `wire` leaves to
    /// msgspec (a hybrid pool's carry group fields).
    wire: Option<Option<Vec<u8>>>,
    block_size: usize,
    #[pyo3(get)]
    n_blocks: usize,
}

#[pymethods]
impl EventRecord {
    fn __len__(&self) -> usize {
        self.rec.events.len()
    }

    /// The events as `take_events()` would have returned them (new objects on each call).
    fn events(&self, py: Python<'_>) -> PyResult<Py<PyList>> {
        self.manager.get().build(py, &self.rec)
    }
}

/// The msgpack bytes of ``KVEventBatch(ts, [events of each record, in order], rank)``, exactly
/// what `encode_batch` writes for the records' `events()`; None when they hold an event the
/// native writer leaves to msgspec (a LoRA's, a hybrid pool's): the caller then encodes the
/// events.
#[pyfunction]
#[pyo3(signature = (records, ts, data_parallel_rank))]
fn encode_records<'py>(
    py: Python<'py>,
    records: &Bound<'py, PyList>,
    ts: f64,
    data_parallel_rank: Option<i64>,
) -> PyResult<Option<Bound<'py, PyBytes>>> {
    let mut recs = Vec::with_capacity(records.len());
    for item in records.iter() {
        recs.push(item.cast_into::<EventRecord>()?);
    }
    let (mut n_events, mut size) = (0, 0);
    for r in &recs {
        let r = r.get();
        if r.wire.is_none() {
            return Ok(None);
        }
        n_events += r.rec.events.len();
        // About what the bytes will take: 3 bytes a token id, 9 a hash, ~100 per event.
        size += 3 * r.rec.tokens.len() + 9 * r.rec.hashes.len() + 100 * r.rec.events.len();
    }
    // Written into this thread's buffer, which stays warm between calls (a fresh one would be
    // new pages for every batch), then copied once into the bytes.
    OUT.with_borrow_mut(|out| {
        out.clear();
        out.reserve(size + 16);
        out.push(0x93);
        put_float(out, ts);
        put_array_header(out, n_events)?;
        for r in &recs {
            let r = r.get();
            let medium = r.wire.as_ref().and_then(|m| m.as_deref());
            if !wire::put_events(out, &r.rec, r.block_size, medium) {
                return Ok(None);
            }
        }
        match data_parallel_rank {
            Some(rank) => put_int(out, rank),
            None => out.push(0xc0),
        }
        let bytes = PyBytes::new(py, out);
        if out.capacity() > KEEP_BUFFER_BYTES {
            *out = Vec::new();
        }
        Ok(Some(bytes))
    })
}

struct Request {
    blocks: Vec<u32>,
    num_tokens: usize,
    /// Tokens of the partial last block.
    tail: Vec<u32>,
    chain: Chain,
    /// The last full block's hash: the next event's parent.
    last_hash: Option<u64>,
    lora: u32,
    /// `(lora_name,)` per block when LoRA salts the hash through extra keys; grown on demand.
    extras: Option<(Value, Vec<Option<Value>>)>,
    /// A hybrid pool's tables of groups 1.. (`blocks` is group 0's, a main group's).
    others: Vec<Table>,
    /// Token positions whose window tails sparse retention keeps (the spec's `boundaries`).
    boundaries: Vec<usize>,
}

/// What a new sequence would take from the cache (`Manager::lookup`): group 0's hit blocks,
/// the further groups' tables, every group's hit blocks together (hybrid), the hit's length.
struct Lookup {
    blocks: Vec<u32>,
    others: Vec<Table>,
    hits: Vec<u32>,
    num_hit: usize,
}

struct Table {
    blocks: Vec<u32>,
    /// Leading entries released by the window (`NULL_BLOCK`).
    skipped: usize,
}

/// The spec's `check_retention`, with its messages.
fn check_retention(
    interval: Option<&Bound<'_, PyAny>>,
    block_size: usize,
    has_groups: bool,
) -> PyResult<Option<usize>> {
    let Some(interval) = interval.filter(|i| !i.is_none()) else {
        return Ok(None);
    };
    if !has_groups {
        return Err(PyValueError::new_err(
            "retention_interval applies to window groups: it needs groups",
        ));
    }
    match interval.extract::<usize>() {
        Ok(v) if interval.is_exact_instance_of::<PyInt>() && v % block_size == 0 => Ok(Some(v)),
        _ => Err(PyValueError::new_err(format!(
            "retention_interval must be None or an int >= 0 that is a multiple of block_size \
             ({block_size}), got {}",
            interval.repr()?
        ))),
    }
}

/// The spec's `check_groups`, with its messages: (kind, window object, window) per group.
#[allow(clippy::type_complexity)]
fn check_groups(
    groups: &Bound<'_, PyAny>,
) -> PyResult<Vec<(&'static str, Py<PyAny>, Option<usize>)>> {
    let bad = |msg: String| Err(PyValueError::new_err(msg));
    if !(groups.is_instance_of::<PyList>() || groups.is_instance_of::<PyTuple>()) {
        return bad(format!(
            "groups must be a list of (kind, window) pairs or None, got {}",
            groups.repr()?
        ));
    }
    let len = groups.len()?;
    if len == 0 || len > MAX_GROUPS {
        return bad(format!(
            "groups must hold 1 to {MAX_GROUPS} groups, got {len}"
        ));
    }
    let all_kinds = [&MAIN_KINDS[..], &WINDOW_KINDS[..]].concat().join(", ");
    let mut out = Vec::with_capacity(len);
    for i in 0..len {
        let group = groups.get_item(i)?;
        let pair = group.is_instance_of::<PyList>() || group.is_instance_of::<PyTuple>();
        if !pair || group.len()? != 2 {
            return bad(format!(
                "groups[{i}] must be a (kind, window) pair, got {}",
                group.repr()?
            ));
        }
        let (kind, window) = (group.get_item(0)?, group.get_item(1)?);
        let name = kind.extract::<String>().ok();
        let main = MAIN_KINDS.iter().find(|k| name.as_deref() == Some(**k));
        let win = WINDOW_KINDS.iter().find(|k| name.as_deref() == Some(**k));
        let (kind_str, size) = match (main, win) {
            (Some(k), _) if window.is_none() => (*k, None),
            (Some(k), _) => {
                return bad(format!(
                    "groups[{i}]: {k} takes no window (None), got {}",
                    window.repr()?
                ))
            }
            (_, Some(k)) => {
                if !window.is_exact_instance_of::<PyInt>() || window.lt(1)? {
                    return bad(format!(
                        "groups[{i}]: {k} needs a window, an int >= 1 (tokens), got {}",
                        window.repr()?
                    ));
                }
                // Beyond usize no prompt reaches the window's end: the same as usize::MAX.
                (*k, Some(window.extract::<usize>().unwrap_or(usize::MAX)))
            }
            _ => {
                return bad(format!(
                    "groups[{i}]: kind must be one of {all_kinds}, got {}",
                    kind.repr()?
                ))
            }
        };
        if i == 0 && size.is_some() {
            return bad(format!(
                "groups[0] must be a main-attention kind ({}), got {}",
                MAIN_KINDS.join(", "),
                kind.repr()?
            ));
        }
        out.push((kind_str, window.unbind(), size));
    }
    Ok(out)
}

struct State {
    core: Core,
    /// request id -> index in `slots`: a dict, so ids hash and compare as in Python.
    requests: Py<PyDict>,
    slots: Vec<Option<Request>>,
    free_slots: Vec<usize>,
    root: Chain,
    /// dynamo_seq salts its seed with the LoRA name: one root chain per name.
    salted_roots: HashMap<String, Chain>,
    /// Auto-numbered LoRA ids, by name (the spec's `_lora_ids`).
    lora_ids: HashMap<String, i64>,
    /// (name, id) -> index in `Manager::loras`.
    lora_index: HashMap<(Option<String>, Option<i64>), u32>,
    // Per-call scratch, kept to spare allocations.
    tokens: Vec<u32>,
    digests: Vec<Digest>,
    hashes: Vec<u64>,
}

/// The request level of a prefix-caching KV block pool with vLLM v1's semantics, recording
/// KV events. Wrapped by `kvbridge.engine.pool.KVCacheManager`, which documents it.
#[pyclass(module = "kvbridge._native", name = "KVCacheManager", subclass, frozen)]
pub struct Manager {
    state: Mutex<State>,
    /// Append-only; index 0 is "no LoRA". Separate from `state` so events can be built
    /// without holding the pool.
    loras: Mutex<Vec<Lora>>,
    ints: Mutex<Ints>,
    classes: Classes,
    layout: Layout,
    algo: Algo,
    lora_in_extra_keys: bool,
    /// A hybrid pool's (kind, window) per group, for its events; empty: a single group.
    group_fields: Vec<(Py<PyAny>, Py<PyAny>)>,
    /// The groups as the spec's `check_groups` returns them (a tuple of pairs) or None.
    #[pyo3(get)]
    groups: Py<PyAny>,
    /// vLLM's prefix_cache_retention_interval for window groups (None: every block).
    retention: Option<usize>,
    /// Per group: its window (None: a main group); empty for a single group.
    windows: Vec<Option<usize>>,
    #[pyo3(get)]
    num_blocks: usize,
    #[pyo3(get)]
    block_size: usize,
    #[pyo3(get)]
    seed: Py<PyAny>,
    #[pyo3(get)]
    medium: Py<PyAny>,
}

fn positive(name: &str, value: &Bound<'_, PyAny>) -> PyResult<usize> {
    // The spec's `type(value) is not int or value <= 0`.
    let ok = value.is_exact_instance_of::<pyo3::types::PyInt>();
    match value.extract::<i64>() {
        Ok(v) if ok && v > 0 => Ok(v as usize),
        _ => Err(PyValueError::new_err(format!(
            "{name} must be a positive int, got {}",
            value.repr()?
        ))),
    }
}

fn lock<'a, T>(m: &'a Mutex<T>, py: Python<'_>) -> PyResult<MutexGuard<'a, T>> {
    m.lock_py_attached(py).map_err(|_| {
        PyRuntimeError::new_err("the block pool is unusable after a panic in a previous call")
    })
}

/// The spec's `_as_token_list`: lists as they are, iterables listed; arrays (an int buffer with
/// `tolist()`: array.array, numpy) are read in place by `read_tokens`, the same ids without an
/// int object per token (`tolist()` of a 12k-token prompt costs ~0.4 ms).
fn as_token_list<'py>(obj: &Bound<'py, PyAny>) -> PyResult<Bound<'py, PyAny>> {
    if obj.is_exact_instance_of::<PyList>() {
        return Ok(obj.clone());
    }
    // SAFETY: obj is a live object.
    if unsafe { pyo3::ffi::PyObject_CheckBuffer(obj.as_ptr()) } != 0 && tokens::read(obj).is_ok() {
        return Ok(obj.clone());
    }
    match obj.getattr_opt("tolist")? {
        Some(tolist) => tolist.call0(),
        None => {
            let iter = obj.try_iter().map_err(|_| {
                let name = obj.get_type().name().map(|n| n.to_string());
                PyTypeError::new_err(format!(
                    "token ids must be a list of int, an int array or an iterable of int, not {}",
                    name.unwrap_or_else(|_| "?".into())
                ))
            })?;
            Ok(PyList::new(obj.py(), iter.collect::<PyResult<Vec<_>>>()?)?.into_any())
        }
    }
}

/// Token ids into `out`: exact ints in an exact list straight from CPython's layout, anything
/// else (and any bad token, so the error is the hashing's) through `hash::tokens::read`.
fn read_tokens(obj: &Bound<'_, PyAny>, layout: Layout, out: &mut Vec<u32>) -> PyResult<()> {
    out.clear();
    if layout != Layout::Api && obj.is_exact_instance_of::<PyList>() {
        // SAFETY: an exact list, read under the GIL without running Python code; the items
        // are only read while the slice is alive.
        let items = unsafe { cpython::list_items(layout, obj.as_ptr()) }.unwrap_or(&[]);
        out.reserve(items.len());
        // SAFETY: the items are live objects owned by the list.
        if unsafe { cpython::read_u32_prefix(layout, items, out) } == items.len() {
            return Ok(());
        }
        out.clear();
    }
    out.extend_from_slice(tokens::read(obj)?.as_slice());
    Ok(())
}

/// Hashes whole blocks, continuing `chain`, appending event hashes to `hashes`.
fn hash_into(
    py: Python<'_>,
    chain: &mut Chain,
    tokens: &[u32],
    extras: Option<&[Option<Value>]>,
    digests: &mut Vec<Digest>,
    hashes: &mut Vec<u64>,
) {
    digests.clear();
    hashes.clear();
    if tokens.len() < DETACH_MIN_TOKENS {
        chain.run(tokens, extras, 0, digests);
    } else {
        py.detach(|| chain.run(tokens, extras, 0, digests));
    }
    hashes.extend(digests.iter().map(Digest::event_hash));
}

impl Manager {
    fn slot(&self, st: &State, request_id: &Bound<'_, PyAny>) -> PyResult<usize> {
        match st.requests.bind(request_id.py()).get_item(request_id)? {
            Some(slot) => slot.extract(),
            None => Err(PyKeyError::new_err(format!(
                "unknown request id {}",
                request_id.repr()?
            ))),
        }
    }

    /// The index of (name, id) in the LoRA table, adding it on first use.
    fn lora(
        &self,
        st: &mut State,
        py: Python<'_>,
        name: Option<&Bound<'_, PyString>>,
        id: Option<i64>,
    ) -> PyResult<u32> {
        let key = (name.map(|n| n.to_string()), id);
        if let Some(&i) = st.lora_index.get(&key) {
            return Ok(i);
        }
        let mut loras = lock(&self.loras, py)?;
        let extra = match name {
            Some(n) if self.lora_in_extra_keys && !n.to_str()?.is_empty() => {
                Some(PyTuple::new(py, [n])?.unbind())
            }
            _ => None,
        };
        loras.push(Lora {
            name: name.map_or_else(|| py.None(), |n| n.clone().into_any().unbind()),
            id: id.into_pyobject(py)?.unbind(),
            extra,
        });
        let i = loras.len() as u32 - 1;
        st.lora_index.insert(key, i);
        Ok(i)
    }

    fn build(&self, py: Python<'_>, rec: &Record) -> PyResult<Py<PyList>> {
        if rec.is_empty() {
            return Ok(PyList::empty(py).unbind());
        }
        let loras: Vec<Lora> = lock(&self.loras, py)?
            .iter()
            .map(|l| l.clone_ref(py))
            .collect();
        let cx = Context {
            classes: &self.classes,
            medium: &self.medium,
            block_size: self.block_size,
            loras: &loras,
            groups: (!self.group_fields.is_empty()).then_some(&self.group_fields[..]),
        };
        let mut ints = lock(&self.ints, py)?;
        Ok(events::build(py, rec, &cx, &mut ints)?.unbind())
    }
}

#[pymethods]
impl Manager {
    #[new]
    #[pyo3(
        signature = (num_blocks, block_size, *, algo = "xxh3", seed = None, medium = Some("GPU".to_string()), enable_events = true, groups = None, retention_interval = None),
        // pyo3 cannot render the `Some(..)` default; stubtest compares this with _native.pyi.
        text_signature = "(num_blocks, block_size, *, algo='xxh3', seed=None, medium='GPU', enable_events=True, groups=None, retention_interval=None)"
    )]
    #[allow(clippy::too_many_arguments)]
    fn new(
        py: Python<'_>,
        num_blocks: &Bound<'_, PyAny>,
        block_size: &Bound<'_, PyAny>,
        algo: &str,
        seed: Option<&Bound<'_, PyAny>>,
        medium: Option<String>,
        enable_events: bool,
        groups: Option<&Bound<'_, PyAny>>,
        retention_interval: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<Self> {
        // The spec checks the groups first too.
        let groups = groups
            .filter(|g| !g.is_none())
            .map(check_groups)
            .transpose()?;
        let num_blocks = positive("num_blocks", num_blocks)?;
        let block_size = positive("block_size", block_size)?;
        if algo == "dynamo" {
            return Err(PyValueError::new_err(
                "algo 'dynamo' hashes blocks without their prefix; use 'dynamo_seq'",
            ));
        }
        if num_blocks >= u32::MAX as usize - 2 {
            return Err(PyValueError::new_err(format!(
                "num_blocks must be below {}",
                u32::MAX - 2
            )));
        }
        let root = new_chain(algo, block_size as i64, seed, None, None)?;
        let algo = root.algo;
        let retention = check_retention(retention_interval, block_size, groups.is_some())?;
        let groups = groups.unwrap_or_default();
        let windows: Vec<Option<usize>> = groups.iter().map(|g| g.2).collect();
        let mut group_fields = Vec::with_capacity(groups.len());
        for (kind, window, _) in &groups {
            let kind = PyString::new(py, kind).into_any().unbind();
            group_fields.push((kind, window.clone_ref(py)));
        }
        let groups_obj = match group_fields.is_empty() {
            true => py.None(),
            false => {
                let pairs = group_fields.iter().map(|(k, w)| PyTuple::new(py, [k, w]));
                PyTuple::new(py, pairs.collect::<PyResult<Vec<_>>>()?)?
                    .into_any()
                    .unbind()
            }
        };
        Ok(Manager {
            state: Mutex::new(State {
                core: Core::new(num_blocks, block_size, enable_events, windows.clone()),
                requests: PyDict::new(py).unbind(),
                slots: Vec::new(),
                free_slots: Vec::new(),
                root,
                salted_roots: HashMap::new(),
                lora_ids: HashMap::new(),
                lora_index: HashMap::from([((None, None), 0)]),
                tokens: Vec::new(),
                digests: Vec::new(),
                hashes: Vec::new(),
            }),
            loras: Mutex::new(vec![Lora {
                name: py.None(),
                id: py.None(),
                extra: None,
            }]),
            ints: Mutex::new(Ints::default()),
            classes: Classes::import(py)?,
            layout: cpython::layout(py),
            algo,
            lora_in_extra_keys: algo != Algo::DynamoSeq,
            group_fields,
            groups: groups_obj,
            retention,
            windows,
            num_blocks,
            block_size,
            seed: seed.map_or_else(|| py.None(), |s| s.clone().unbind()),
            medium: medium.into_pyobject(py)?.unbind(),
        })
    }

    #[getter]
    fn retention_interval(&self) -> Option<usize> {
        self.retention
    }

    #[getter]
    fn algo(&self) -> &'static str {
        self.algo.name()
    }

    /// Admit a request with its prompt; returns the cached prompt tokens, or None (nothing
    /// changed) when there are not enough free blocks.
    #[pyo3(signature = (request_id, token_ids, *, lora_name = None, lora_id = None))]
    fn allocate(
        &self,
        py: Python<'_>,
        request_id: &Bound<'_, PyAny>,
        token_ids: &Bound<'_, PyAny>,
        lora_name: Option<&Bound<'_, PyAny>>,
        lora_id: Option<i64>,
    ) -> PyResult<Option<usize>> {
        let token_list = as_token_list(token_ids)?;
        if token_list.len()? == 0 {
            return Err(PyValueError::new_err(
                "token_ids is empty: a request needs at least one token",
            ));
        }
        let lora_name = match lora_name.filter(|n| !n.is_none()) {
            None => None,
            Some(n) => Some(n.cast::<PyString>().map_err(|_| {
                let kind = n
                    .get_type()
                    .name()
                    .map_or_else(|_| "?".to_string(), |s| s.to_string());
                PyTypeError::new_err(format!("lora_name must be a str or None, got {kind}"))
            })?),
        };
        let mut guard = lock(&self.state, py)?;
        let st = &mut *guard;
        if st.requests.bind(py).contains(request_id)? {
            return Err(PyValueError::new_err(format!(
                "request id {} is already allocated",
                request_id.repr()?
            )));
        }
        let mut tokens = std::mem::take(&mut st.tokens);
        let result = self.admit(
            py,
            st,
            request_id,
            &token_list,
            &mut tokens,
            lora_name,
            lora_id,
        );
        st.tokens = tokens;
        result
    }

    /// Decode growth: add tokens to a running request, caching blocks as they fill; False
    /// (nothing changed) when there are not enough free blocks.
    fn append(
        &self,
        py: Python<'_>,
        request_id: &Bound<'_, PyAny>,
        new_token_ids: &Bound<'_, PyAny>,
    ) -> PyResult<bool> {
        let token_list = as_token_list(new_token_ids)?;
        let mut guard = lock(&self.state, py)?;
        let st = &mut *guard;
        let slot = self.slot(st, request_id)?;
        read_tokens(&token_list, self.layout, &mut st.tokens)?;
        let bs = self.block_size;
        let State {
            core,
            slots,
            tokens,
            digests,
            hashes,
            ..
        } = st;
        let req = slots[slot].as_mut().expect("live slot");
        let num_tokens = req.num_tokens + tokens.len();
        let num_new = num_tokens.div_ceil(bs).saturating_sub(req.blocks.len());
        // Hybrid: the window blocks go first, even if the rest then does not fit (as vLLM's
        // allocate_slots); every group takes the same number of new blocks.
        release_window(core, req);
        if num_new * (1 + req.others.len()) > core.num_free() {
            return Ok(false);
        }
        req.tail.extend_from_slice(tokens);
        let full = req.tail.len() / bs;
        hashes.clear();
        if full > 0 {
            let extras = req.extras.as_mut().map(|(key, per_block)| {
                if per_block.len() < full {
                    per_block.resize(full, Some(key.clone()));
                }
                &per_block[..full]
            });
            hash_into(
                py,
                &mut req.chain,
                &req.tail[..full * bs],
                extras,
                digests,
                hashes,
            );
        }
        let full0 = req.num_tokens / bs;
        req.num_tokens = num_tokens;
        core.new_blocks(num_new, &mut req.blocks);
        for t in &mut req.others {
            core.new_blocks(num_new, &mut t.blocks);
        }
        if full > 0 {
            let tokens = &req.tail[..full * bs];
            let (parent, lora, range) = (req.last_hash, req.lora, full0..full0 + full);
            // Group 0 is a main group: it keeps every block.
            core.cache(
                &req.blocks[range.clone()],
                hashes,
                tokens,
                parent,
                lora,
                0,
                None,
            );
            let mut mask = Vec::new();
            for (g, t) in (1..).zip(&req.others) {
                let mask = self.retained(g, &req.boundaries, full0, full0 + full, &mut mask);
                core.cache(
                    &t.blocks[range.clone()],
                    hashes,
                    tokens,
                    parent,
                    lora,
                    g,
                    mask,
                );
            }
            req.last_hash = hashes.last().copied();
            req.tail.drain(..full * bs);
        }
        Ok(true)
    }

    /// Release a request's blocks; its cached blocks stay hittable until evicted.
    fn free(&self, py: Python<'_>, request_id: &Bound<'_, PyAny>) -> PyResult<()> {
        let mut guard = lock(&self.state, py)?;
        let st = &mut *guard;
        let slot = self.slot(st, request_id)?;
        st.requests.bind(py).del_item(request_id)?;
        let req = st.slots[slot].take().expect("live slot");
        st.free_slots.push(slot);
        // Group by group, as KVCacheCoordinator.free; a window group without its null blocks.
        st.core.free_reversed(&req.blocks);
        for t in &req.others {
            st.core.free_reversed(&t.blocks[t.skipped..]);
        }
        Ok(())
    }

    /// Clear the prefix cache (AllBlocksCleared); False while any request holds blocks.
    fn reset(&self, py: Python<'_>) -> PyResult<bool> {
        Ok(lock(&self.state, py)?.core.reset())
    }

    /// Drain the recorded events, in order.
    fn take_events(&self, py: Python<'_>) -> PyResult<Py<PyList>> {
        let rec = lock(&self.state, py)?.core.take_record();
        self.build(py, &rec)
    }

    /// Drain the recorded events, in order, as an `EventRecord` (``events()`` gives what
    /// ``take_events()`` would have).
    fn take_record(slf: &Bound<'_, Self>) -> PyResult<EventRecord> {
        let py = slf.py();
        let this = slf.get();
        let rec = lock(&this.state, py)?.core.take_record();
        let wire = match this.group_fields.is_empty() {
            true => Some(
                this.medium
                    .extract::<Option<String>>(py)?
                    .map(String::into_bytes),
            ),
            false => None,
        };
        Ok(EventRecord {
            n_blocks: wire::n_blocks(&rec),
            rec,
            manager: slf.clone().unbind(),
            wire,
            block_size: this.block_size,
        })
    }

    /// Every cached block as BlockStored events, parents before children.
    fn snapshot(&self, py: Python<'_>) -> PyResult<Py<PyList>> {
        let rec = lock(&self.state, py)?.core.snapshot();
        self.build(py, &rec)
    }

    /// The request's block table.
    fn get_block_ids(&self, py: Python<'_>, request_id: &Bound<'_, PyAny>) -> PyResult<Vec<u32>> {
        let st = lock(&self.state, py)?;
        let slot = self.slot(&st, request_id)?;
        Ok(st.slots[slot].as_ref().expect("live slot").blocks.clone())
    }

    /// The request's block table per group; None where a window group released a block.
    fn get_group_block_ids(
        &self,
        py: Python<'_>,
        request_id: &Bound<'_, PyAny>,
    ) -> PyResult<Vec<Vec<Option<u32>>>> {
        let st = lock(&self.state, py)?;
        let slot = self.slot(&st, request_id)?;
        let req = st.slots[slot].as_ref().expect("live slot");
        let table = |t: &[u32]| t.iter().map(|&b| (b != NULL_BLOCK).then_some(b)).collect();
        let mut out = vec![table(&req.blocks)];
        out.extend(req.others.iter().map(|t| table(&t.blocks)));
        Ok(out)
    }

    /// How many leading blocks `allocate(.., token_ids, lora_name=..)` would hit now; changes
    /// nothing.
    #[pyo3(signature = (token_ids, *, lora_name = None))]
    fn hit_blocks(
        &self,
        py: Python<'_>,
        token_ids: &Bound<'_, PyAny>,
        lora_name: Option<&Bound<'_, PyString>>,
    ) -> PyResult<usize> {
        self.with_hashed(py, token_ids, lora_name, |st, num_tokens| {
            self.hit(st, num_tokens)
        })
    }

    /// Whether `allocate(.., token_ids, lora_name=..)` would succeed now: the pool can hold the
    /// whole sequence, its cached prefix counted (what a scheduler checks before admitting a
    /// request whose blocks it allocates chunk by chunk); changes nothing.
    #[pyo3(signature = (token_ids, *, lora_name = None))]
    fn can_allocate(
        &self,
        py: Python<'_>,
        token_ids: &Bound<'_, PyAny>,
        lora_name: Option<&Bound<'_, PyString>>,
    ) -> PyResult<bool> {
        self.with_hashed(py, token_ids, lora_name, |st, num_tokens| {
            let found = self.lookup(st, num_tokens);
            let num_new = num_tokens.div_ceil(self.block_size) - found.num_hit;
            let hits = if found.others.is_empty() {
                &found.blocks
            } else {
                &found.hits
            };
            st.core.can_take(hits, num_new * (1 + found.others.len()))
        })
    }

    fn num_tokens(&self, py: Python<'_>, request_id: &Bound<'_, PyAny>) -> PyResult<usize> {
        let st = lock(&self.state, py)?;
        let slot = self.slot(&st, request_id)?;
        Ok(st.slots[slot].as_ref().expect("live slot").num_tokens)
    }

    fn __contains__(&self, py: Python<'_>, request_id: &Bound<'_, PyAny>) -> PyResult<bool> {
        lock(&self.state, py)?
            .requests
            .bind(py)
            .contains(request_id)
    }

    fn __len__(&self, py: Python<'_>) -> PyResult<usize> {
        Ok(lock(&self.state, py)?.requests.bind(py).len())
    }

    // --- the pool's queries (kvbridge.engine.pool exposes them as `.pool`) ------------------------

    #[getter]
    fn num_free_blocks(&self, py: Python<'_>) -> PyResult<usize> {
        Ok(lock(&self.state, py)?.core.num_free())
    }

    /// Distinct cached hashes.
    #[getter]
    fn num_cached_blocks(&self, py: Python<'_>) -> PyResult<usize> {
        Ok(lock(&self.state, py)?.core.num_cached())
    }

    /// The cached hashes, parents before children.
    fn cached_block_hashes(&self, py: Python<'_>) -> PyResult<Vec<u64>> {
        Ok(lock(&self.state, py)?.core.cached_hashes())
    }

    /// The free blocks in eviction order, first evicted first.
    fn free_block_ids(&self, py: Python<'_>) -> PyResult<Vec<u32>> {
        Ok(lock(&self.state, py)?.core.free_block_ids())
    }

    /// (ref_cnt, block_hash or None) per block id, for tests and debugging.
    fn block_states(&self, py: Python<'_>) -> PyResult<Vec<(u32, Option<u64>)>> {
        let st = lock(&self.state, py)?;
        Ok((0..self.num_blocks as u32)
            .map(|b| (st.core.ref_cnt(b), st.core.block_hash(b)))
            .collect())
    }
}

impl Manager {
    #[allow(clippy::too_many_arguments)]
    fn admit(
        &self,
        py: Python<'_>,
        st: &mut State,
        request_id: &Bound<'_, PyAny>,
        token_list: &Bound<'_, PyAny>,
        tokens: &mut Vec<u32>,
        lora_name: Option<&Bound<'_, PyString>>,
        lora_id: Option<i64>,
    ) -> PyResult<Option<usize>> {
        read_tokens(token_list, self.layout, tokens)?;
        let bs = self.block_size;
        let num_full = tokens.len() / bs;
        let (mut chain, mut extras) = self.chain_for(py, st, lora_name, num_full)?;
        let per_block = extras.as_ref().map(|(_, v)| v.as_slice());
        hash_into(
            py,
            &mut chain,
            &tokens[..num_full * bs],
            per_block,
            &mut st.digests,
            &mut st.hashes,
        );
        let Lookup {
            mut blocks,
            mut others,
            hits,
            num_hit,
        } = self.lookup(st, tokens.len());
        let num_new = tokens.len().div_ceil(bs) - num_hit;
        let hashes = &st.hashes;
        let hits = if others.is_empty() {
            &blocks[..]
        } else {
            &hits[..]
        };
        // get_computed_blocks' shared_prefix_boundary: group 0 ran past the hit.
        let mut boundaries = Vec::new();
        if self.retention.is_some() {
            let longest = st.core.held_prefix(0, hashes, (tokens.len() - 1) / bs);
            boundaries.push(tokens.len() - 1);
            if longest > num_hit {
                boundaries.push(longest * bs);
            }
        }
        if !st.core.can_take(hits, num_new * (1 + others.len())) {
            return Ok(None);
        }
        let lora_id = match (lora_name, lora_id) {
            (Some(name), None) => {
                let next = st.lora_ids.len() as i64 + 1;
                Some(
                    *st.lora_ids
                        .entry(name.to_str()?.to_string())
                        .or_insert(next),
                )
            }
            (_, id) => id,
        };
        let lora = self.lora(st, py, lora_name, lora_id)?;
        st.core.touch(hits);
        st.core.new_blocks(num_new, &mut blocks);
        for t in &mut others {
            st.core.new_blocks(num_new, &mut t.blocks);
        }
        let hashes = &st.hashes;
        if num_full > num_hit {
            let parent = num_hit.checked_sub(1).map(|i| hashes[i]);
            let cached_tokens = &tokens[num_hit * bs..num_full * bs];
            let tables = std::iter::once(&blocks).chain(others.iter().map(|t| &t.blocks));
            let mut mask = Vec::new();
            for (g, table) in tables.enumerate() {
                let new = &table[num_hit..num_full];
                let mask = self.retained(g, &boundaries, num_hit, num_full, &mut mask);
                st.core.cache(
                    new,
                    &hashes[num_hit..],
                    cached_tokens,
                    parent,
                    lora,
                    g,
                    mask,
                );
            }
        }
        if let Some((_, per_block)) = extras.as_mut() {
            per_block.clear();
        }
        let req = Request {
            blocks,
            num_tokens: tokens.len(),
            tail: tokens[num_full * bs..].to_vec(),
            chain,
            last_hash: hashes.last().copied(),
            lora,
            extras,
            others,
            boundaries,
        };
        let slot = match st.free_slots.pop() {
            Some(s) => {
                st.slots[s] = Some(req);
                s
            }
            None => {
                st.slots.push(Some(req));
                st.slots.len() - 1
            }
        };
        st.requests.bind(py).set_item(request_id, slot)?;
        Ok(Some(num_hit * bs))
    }

    /// `f(state, number of tokens)` with `token_ids`' full blocks hashed into `st.hashes` (a
    /// new sequence's chain, LoRA-salted): the read-only queries' common start.
    fn with_hashed<R>(
        &self,
        py: Python<'_>,
        token_ids: &Bound<'_, PyAny>,
        lora_name: Option<&Bound<'_, PyString>>,
        f: impl FnOnce(&mut State, usize) -> R,
    ) -> PyResult<R> {
        let token_list = as_token_list(token_ids)?;
        let mut guard = lock(&self.state, py)?;
        let st = &mut *guard;
        let mut tokens = std::mem::take(&mut st.tokens);
        let result = read_tokens(&token_list, self.layout, &mut tokens).and_then(|()| {
            let num_full = tokens.len() / self.block_size;
            let (mut chain, extras) = self.chain_for(py, st, lora_name, num_full)?;
            let per_block = extras.as_ref().map(|(_, v)| v.as_slice());
            let full = &tokens[..num_full * self.block_size];
            hash_into(
                py,
                &mut chain,
                full,
                per_block,
                &mut st.digests,
                &mut st.hashes,
            );
            Ok(tokens.len())
        });
        let result = result.map(|n| f(st, n));
        st.tokens = tokens;
        result
    }

    /// The blocks a `num_tokens`-token sequence (hashed into `st.hashes`) would take from the
    /// cache: group 0's hit, then each further group's (the blocks its window still needs).
    fn lookup(&self, st: &State, num_tokens: usize) -> Lookup {
        let hashes = &st.hashes;
        let mut blocks = Vec::with_capacity(num_tokens.div_ceil(self.block_size));
        let mut others = Vec::new();
        let mut hits = Vec::new(); // every group's hit blocks: what `touch` takes (hybrid)
        let num_hit = if self.group_fields.is_empty() {
            st.core.find_cached_prefix(hashes, &mut blocks);
            blocks.len()
        } else {
            let n = self.hit(st, num_tokens);
            let lookup = |g: usize, i: usize| st.core.lookup(g, hashes[i]).expect("a hit is held");
            blocks.extend((0..n).map(|i| lookup(0, i)));
            hits.extend_from_slice(&blocks);
            for g in 1..self.group_fields.len() {
                let skipped = st.core.skipped_blocks(g, n * self.block_size);
                let mut t = vec![NULL_BLOCK; skipped];
                t.extend((skipped..n).map(|i| lookup(g, i)));
                hits.extend_from_slice(&t[skipped..]);
                others.push(Table { blocks: t, skipped });
            }
            n
        };
        Lookup {
            blocks,
            others,
            hits,
            num_hit,
        }
    }

    /// The spec's `_retained`: which of blocks [start, end) window group `g` keeps under sparse
    /// retention, in `out`; None keeps all.
    #[inline]
    fn retained<'a>(
        &self,
        g: usize,
        boundaries: &[usize],
        start: usize,
        end: usize,
        out: &'a mut Vec<bool>,
    ) -> Option<&'a [bool]> {
        let interval = self.retention?;
        let window = self.windows.get(g).copied().flatten()?;
        let bs = self.block_size;
        let need = (window - 1).div_ceil(bs);
        out.clear();
        out.resize(end - start, false);
        if interval > 0 {
            let per_segment = interval / bs;
            if need >= per_segment {
                return None;
            }
            for i in start..end {
                out[i - start] = i % per_segment >= per_segment - need;
            }
        }
        for &boundary in boundaries {
            let last = boundary / bs;
            for j in start.max(last.saturating_sub(need))..end.min(last) {
                out[j - start] = true;
            }
        }
        Some(out)
    }

    /// Leading blocks of `st.hashes` (a `num_tokens`-token sequence's) a new request hits: the
    /// cached prefix, or in a hybrid pool the coordinator's hit below the last token.
    fn hit(&self, st: &State, num_tokens: usize) -> usize {
        if self.group_fields.is_empty() {
            let mut found = Vec::new();
            st.core.find_cached_prefix(&st.hashes, &mut found);
            return found.len();
        }
        let max_blocks = num_tokens.saturating_sub(1) / self.block_size;
        st.core.longest_hit(&st.hashes, max_blocks)
    }

    /// A new request's chain (LoRA-salted for dynamo_seq) and, when LoRA salts through extra
    /// keys, its per-block `(lora_name,)` for `num_full` blocks.
    #[allow(clippy::type_complexity)]
    fn chain_for(
        &self,
        py: Python<'_>,
        st: &mut State,
        lora_name: Option<&Bound<'_, PyString>>,
        num_full: usize,
    ) -> PyResult<(Chain, Option<(Value, Vec<Option<Value>>)>)> {
        let bs = self.block_size;
        let chain = match lora_name {
            Some(name) if self.algo == Algo::DynamoSeq => {
                let name = name.to_str()?;
                match st.salted_roots.get(name) {
                    Some(root) => root.clone(),
                    None => {
                        let root = new_chain(self.algo.name(), bs as i64, None, Some(name), None)?;
                        st.salted_roots.insert(name.to_string(), root.clone());
                        root
                    }
                }
            }
            _ => st.root.clone(),
        };
        // vLLM salts a LoRA block's hash with extra keys (lora_name,), one per block.
        let extras = match lora_name {
            Some(name) if self.lora_in_extra_keys => {
                let key =
                    Value::from_py(PyTuple::new(py, [name])?.as_any(), self.algo.cbor_extras())?;
                Some((key.clone(), vec![Some(key); num_full]))
            }
            _ => None,
        };
        Ok((chain, extras))
    }
}

/// SingleTypeKVCacheManager.remove_skipped_blocks for each window group of a request: frees
/// what left the window by its tokens so far, last block first, and nulls it in the table.
fn release_window(core: &mut Core, req: &mut Request) {
    for (i, t) in req.others.iter_mut().enumerate() {
        let end = core
            .skipped_blocks(i + 1, req.num_tokens)
            .min(t.blocks.len());
        if end > t.skipped {
            core.free_reversed(&t.blocks[t.skipped..end]);
            t.blocks[t.skipped..end].fill(NULL_BLOCK);
            t.skipped = end;
        }
    }
}
