//! `kvbridge.Index`: which leading blocks of a prompt each worker holds, from KV event payloads.
//!
//! The rules live in `core` and `groups` (pyo3-free), payload decoding in `parse` (the events it
//! makes in `events`, JSON in `json`), holder sets in `holders`, the block table in `table`.
//! The Python face is this file (the class, the lock, the GIL), with `args` (what callers pass),
//! `query_keys` (a query's keys from Python) and `answer` (answers as Python objects).
//!
//! Locking: one `RwLock` around the state. Queries take it shared, `apply` exclusive. Nothing
//! touches Python while holding it, and a call that would wait for it (or is long) waits with
//! the GIL released, so a query thread and an applying thread never block each other on the
//! GIL and the lock at once.

mod answer;
mod args;
pub(crate) mod core;
mod events;
mod groups;
mod holders;
pub(crate) mod json;
pub(crate) mod keys;
pub(crate) mod parse;
pub(crate) mod pipeline;
mod query_keys;
pub(crate) mod table;

use std::cell::Cell;
use std::sync::{Arc, Mutex, RwLock, RwLockWriteGuard, TryLockError};

use pyo3::exceptions::{PyTypeError, PyValueError};
use pyo3::prelude::*;
use pyo3::types::{PyDict, PyString, PyTuple};

use self::answer::{inline_layout, keep_top, lists_answer, name_obj, NameCache};
use self::args::{format_arg, opt_str, payload_bytes, type_error, unpack_query_ints};
use self::core::{Core, Mode};
use self::keys::TokenKeys;
use self::parse::detect;
use self::pipeline::{apply_many, apply_one};
use self::query_keys::{keys_from_py, read_block_hashes, Keys, Query};
use crate::decode::incref;
use crate::hash::algo::{index_keys, salted, xxh3_chain};
use crate::hash::scratch::Recycled;
use crate::hash::tokens;

thread_local! {
    static KEYS: Cell<Vec<u64>> = const { Cell::new(Vec::new()) };
    static FOUND: Cell<Vec<(u32, u32)>> = const { Cell::new(Vec::new()) };
}

/// Payloads and queries at least this long are handled with the GIL released.
const DETACH_MIN_BYTES: usize = 64 << 10;
const DETACH_MIN_TOKENS: usize = 1 << 16;

pub fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<Index>()?;
    m.add_function(wrap_pyfunction!(unpack_query_ints, m)?)
}

/// A global KV-cache index: per worker, medium and KV-cache group, which blocks it holds; per
/// query, how many leading blocks of a prompt each worker would hit.
/// `Index(block_size=16, key="tokens")`; see kvbridge's README ("Index") and the type stub for
/// the rules.
#[pyclass(module = "kvbridge._native", frozen)]
pub struct Index {
    core: RwLock<Core>,
    block_size: usize,
    mode: Mode,
    /// Python str objects for worker names, by worker id, reused across queries (the Arc
    /// tells whether the id still names the same worker).
    names: Mutex<Vec<Option<NameCache>>>,
}

#[pymethods]
impl Index {
    #[new]
    #[pyo3(signature = (block_size = 16, key = "tokens"))]
    fn new(block_size: i64, key: &str) -> PyResult<Self> {
        if !(1..=1 << 32).contains(&block_size) {
            return Err(PyValueError::new_err(format!(
                "block_size must be between 1 and 2**32, got {block_size}"
            )));
        }
        let bs = block_size;
        let mode = match key {
            "tokens" => Mode::Tokens,
            "engine" => Mode::Engine,
            other => {
                return Err(PyValueError::new_err(format!(
                    "key must be 'tokens' or 'engine', got '{other}'"
                )))
            }
        };
        Ok(Index {
            core: RwLock::new(Core::new(bs as usize, mode)),
            block_size: bs as usize,
            mode,
            names: Mutex::new(Vec::new()),
        })
    }

    /// Applies one message payload (msgpack or JSON bytes, as on the wire) or a decoded
    /// KVEventBatch from `worker`. Returns the number of events in it; 0 for a payload that is
    /// not a batch (counted as malformed_payloads, nothing applied). Never raises for what the
    /// payload says, only for arguments of the wrong type.
    #[pyo3(signature = (worker, data, format = None))]
    fn apply(
        &self,
        py: Python<'_>,
        worker: &Bound<'_, PyAny>,
        data: &Bound<'_, PyAny>,
        format: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<usize> {
        let worker = worker
            .cast::<PyString>()
            .map_err(|_| type_error("worker", "str", worker))?
            .to_str()?;
        let format = format_arg(format)?;
        let owned = payload_bytes(py, data)?;
        let bytes = owned.as_bytes();
        let format = format.unwrap_or_else(|| detect(bytes));
        let long = bytes.len() >= DETACH_MIN_BYTES;
        Ok(self.write(py, long, |core| {
            apply_one(core, worker, bytes, format, &mut Vec::new())
        }))
    }

    /// `apply` of each `(worker, data)` of `messages` in order (a router draining a backlog,
    /// the index service's batch of received messages): the same index, counters and return
    /// values as one call each, from 64 KiB of payloads read on a second thread while this one
    /// applies those before. Returns each payload's number of events. The index is locked for
    /// the whole call (queries wait; the GIL is released).
    #[pyo3(signature = (messages, format = None))]
    fn apply_many(
        &self,
        py: Python<'_>,
        messages: &Bound<'_, PyAny>,
        format: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<Vec<usize>> {
        let format = format_arg(format)?;
        let mut held = Vec::new();
        for m in messages.try_iter()? {
            let m = m?;
            let pair = m
                .cast::<PyTuple>()
                .ok()
                .filter(|t| t.len() == 2)
                .ok_or_else(|| type_error("messages' items", "(worker, data) tuples", &m))?;
            let worker = pair.get_item(0)?;
            let worker = match worker.cast::<PyString>() {
                Ok(w) => w.clone(),
                Err(_) => return Err(type_error("worker", "str", &worker)),
            };
            held.push((worker, payload_bytes(py, &pair.get_item(1)?)?));
        }
        let mut items = Vec::with_capacity(held.len());
        let mut bytes = 0;
        for (worker, data) in &held {
            items.push((worker.to_str()?, data.as_bytes()));
            bytes += data.as_bytes().len();
        }
        let mut counts = Vec::with_capacity(items.len());
        self.write(py, bytes >= DETACH_MIN_BYTES, |core| {
            apply_many(core, &items, format, &mut counts)
        });
        Ok(counts)
    }

    /// `{worker: leading blocks held}` for every worker holding at least the first block of
    /// `tokens` (hashed here, in full blocks) or of `block_hashes` (the index's own keys:
    /// `hash_blocks(tokens, block_size, algo="xxh3", lora_name=..., extra_keys=...)` for
    /// key="tokens", the engines' hashes for key="engine"). `extra_keys`: one entry per full
    /// block (None or a tuple of the block's multimodal / cache-salt keys, without the LoRA
    /// name). `medium`: count only blocks held in that medium. `remote`: credit copies whose
    /// events said locality="REMOTE". `by_medium`: `{worker: {medium: count}}`, each medium
    /// scored on its own residency. `lists`: the answer as two parallel lists `(workers,
    /// counts)` in worker id order, for a router's hot path (no dict to build); `top_k`: only
    /// the k workers with the longest hits, longest first (ties in id order). `block_hashes` as
    /// a buffer (array('Q'), numpy, bytes of packed native-endian 64-bit ints) and `tokens` as
    /// one (array('I'), numpy) are read without a Python int per item (bytes and aligned
    /// contiguous buffers in place).
    #[allow(clippy::too_many_arguments)]
    #[pyo3(signature = (tokens = None, *, block_hashes = None, lora_name = None, extra_keys = None, medium = None, by_medium = false, remote = false, lists = false, top_k = None))]
    fn find_matches<'py>(
        &self,
        py: Python<'py>,
        tokens: Option<&Bound<'py, PyAny>>,
        block_hashes: Option<&Bound<'py, PyAny>>,
        lora_name: Option<&Bound<'py, PyAny>>,
        extra_keys: Option<&Bound<'py, PyAny>>,
        medium: Option<&Bound<'py, PyAny>>,
        by_medium: bool,
        remote: bool,
        lists: bool,
        top_k: Option<i64>,
    ) -> PyResult<Bound<'py, PyAny>> {
        let medium = opt_str("medium", medium)?;
        let top_k = match top_k {
            Some(k) if k < 0 => {
                return Err(PyValueError::new_err(format!(
                    "top_k must be an int >= 0, got {k}"
                )))
            }
            Some(k) => Some(k as usize),
            None => None,
        };
        if by_medium && (lists || top_k.is_some()) {
            return Err(PyValueError::new_err(
                "by_medium answers per medium: not with lists or top_k",
            ));
        }
        let keys = self.query_keys(
            py,
            QueryArgs {
                tokens,
                block_hashes,
                lora_name,
                extra_keys,
            },
        )?;
        let long = keys.blocks(self.block_size) >= DETACH_MIN_TOKENS / 16;
        if by_medium {
            // Every medium walks the keys: made all at once.
            let keys = match keys {
                Keys::Tokens { tokens, seed } => {
                    Keys::Pooled(self.made_keys(py, tokens.as_slice(), seed))
                }
                keys => keys,
            };
            let keys = keys.shared();
            let out = PyDict::new(py);
            type Row = (u32, Arc<str>, Option<String>, u32);
            let rows: Vec<Row> = self.read(py, long, |core| {
                core.find_matches_by_medium(&keys, medium, remote)
                    .into_iter()
                    .map(|(w, m, n)| {
                        (
                            w,
                            core.name(w).clone(),
                            core.medium_name(m).map(str::to_string),
                            n,
                        )
                    })
                    .collect()
            });
            let mut cache = self.names.lock().unwrap_or_else(|e| e.into_inner());
            for (w, name, m, n) in rows {
                let key = name_obj(py, &mut cache, w, name);
                let inner = match out.get_item(&key)? {
                    Some(d) => d.cast_into::<PyDict>()?,
                    None => {
                        let d = PyDict::new(py);
                        out.set_item(&key, &d)?;
                        d
                    }
                };
                inner.set_item(m, n)?;
            }
            return Ok(out.into_any());
        }
        let (found, names) = self.named(py, long, &keys, |core, keys, found| {
            // One walk per kind of keys, each compiled for its own: given keys are read as
            // before, not through a branch per key.
            match keys {
                Query::Given(k) => core.find_matches(k, medium.map(Some), remote, found),
                Query::Tokens(t) => core.find_matches_of(t, medium.map(Some), remote, found),
            }
            if let Some(k) = top_k {
                keep_top(found, k);
            }
        });
        if lists {
            return lists_answer(py, &found, names);
        }
        let out = PyDict::new(py);
        for (name, &(_, n)) in names.into_iter().zip(found.iter()) {
            out.set_item(name, n)?;
        }
        Ok(out.into_any())
    }

    /// Forgets `worker` and every block it holds (a no-op for an unknown worker).
    fn remove_worker(&self, py: Python<'_>, worker: &Bound<'_, PyAny>) -> PyResult<()> {
        let worker = worker
            .cast::<PyString>()
            .map_err(|_| type_error("worker", "str", worker))?
            .to_str()?;
        self.write(py, true, |core| core.remove_worker(worker));
        Ok(())
    }

    /// How many times `worker`'s cache was cleared (`AllBlocksCleared`) since the index first
    /// heard of it; None for a worker it does not know (never heard, or removed). A router
    /// compares it with the value at its decision: anything it guessed the worker holds is gone.
    fn clears(&self, py: Python<'_>, worker: &Bound<'_, PyAny>) -> PyResult<Option<u64>> {
        let worker = worker
            .cast::<PyString>()
            .map_err(|_| type_error("worker", "str", worker))?
            .to_str()?;
        Ok(self.read(py, false, |core| core.clears(worker)))
    }

    /// Forgets every block and worker; the stats keep counting.
    fn clear(&self, py: Python<'_>) {
        self.write(py, true, |core| core.clear());
    }

    /// The workers heard from (any well-formed payload, even an empty one), sorted.
    #[getter]
    fn workers(&self, py: Python<'_>) -> Vec<String> {
        let mut names: Vec<String> = self.read(py, false, |core| {
            core.worker_names().iter().map(|n| n.to_string()).collect()
        });
        names.sort();
        names
    }

    /// Bytes held by the index's tables (an estimate including allocator bookkeeping).
    #[getter]
    fn memory_bytes(&self, py: Python<'_>) -> usize {
        self.read(py, false, |core| core.memory_bytes())
    }

    #[getter]
    fn block_size(&self) -> usize {
        self.block_size
    }

    #[getter]
    fn key(&self) -> &'static str {
        match self.mode {
            Mode::Tokens => "tokens",
            Mode::Engine => "engine",
        }
    }

    /// Counters: payloads, events, blocks_stored, blocks_removed, cleared, unknown_parents,
    /// block_size_mismatches, events_without_tokens, malformed_payloads, unknown_removes,
    /// bad_extra_keys, bad_token_ids, too_many_media (more than 256 (medium, group, locality)
    /// classes), too_many_workers, bad_groups, bad_windows, unknown_kinds,
    /// unscored_group_events, unresolved_placeholders, unresolved_hashes; and the gauges
    /// blocks, workers.
    #[getter]
    fn stats<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let (pairs, blocks, workers) = self.read(py, false, |core| {
            (core.stats.pairs(), core.len(), core.worker_names().len())
        });
        let out = PyDict::new(py);
        for (k, v) in pairs {
            out.set_item(k, v)?;
        }
        out.set_item("blocks", blocks)?;
        out.set_item("workers", workers)?;
        Ok(out)
    }

    fn __len__(&self, py: Python<'_>) -> usize {
        self.read(py, false, |core| core.len())
    }

    fn __repr__(&self, py: Python<'_>) -> String {
        let (blocks, workers) =
            self.read(py, false, |core| (core.len(), core.worker_names().len()));
        format!(
            "Index(block_size={}, key='{}', blocks={blocks}, workers={workers})",
            self.block_size,
            self.key()
        )
    }
}

/// What a query asks about, as the caller passed it.
struct QueryArgs<'a, 'py> {
    tokens: Option<&'a Bound<'py, PyAny>>,
    block_hashes: Option<&'a Bound<'py, PyAny>>,
    lora_name: Option<&'a Bound<'py, PyAny>>,
    extra_keys: Option<&'a Bound<'py, PyAny>>,
}

impl Index {
    /// A router's read of a prompt (`crate::route`): its full blocks' keys into `keys`, then
    /// `f` on the state with them, under one read lock. The errors are `find_matches`'.
    pub(crate) fn route_query<R: Send>(
        &self,
        py: Python<'_>,
        tokens: &Bound<'_, PyAny>,
        lora_name: Option<&Bound<'_, PyAny>>,
        extra_keys: Option<&Bound<'_, PyAny>>,
        keys: &mut Vec<u64>,
        f: impl FnOnce(&Core, &[u64]) -> R + Send,
    ) -> PyResult<R> {
        let query = self.query_keys(
            py,
            QueryArgs {
                tokens: Some(tokens),
                block_hashes: None,
                lora_name,
                extra_keys,
            },
        )?;
        keys.clear();
        match query {
            Keys::Tokens { tokens, seed } => {
                keys.extend_from_slice(&self.made_keys(py, tokens.as_slice(), seed))
            }
            query => keys.extend_from_slice(&query.shared()),
        }
        let long = keys.len() >= DETACH_MIN_TOKENS / 16;
        let keys = &keys[..];
        Ok(self.read(py, long, |core| f(core, keys)))
    }

    /// `f` on the state under the read lock (a router's look at the live workers).
    pub(crate) fn route_workers<R: Send>(
        &self,
        py: Python<'_>,
        f: impl FnOnce(&Core) -> R + Send,
    ) -> R {
        self.read(py, false, f)
    }

    /// The index keys a query asks about: `tokens` hashed, or `block_hashes` as given.
    fn query_keys<'a>(&self, py: Python<'_>, q: QueryArgs<'a, '_>) -> PyResult<Keys<'a>> {
        let QueryArgs {
            tokens,
            block_hashes,
            lora_name,
            extra_keys,
        } = q;
        let tokens = tokens.filter(|t| !t.is_none());
        let block_hashes = block_hashes.filter(|t| !t.is_none());
        let lora_name = opt_str("lora_name", lora_name)?;
        let extra_keys = extra_keys.filter(|k| !k.is_none());
        Ok(match (tokens, block_hashes) {
            (Some(_), Some(_)) => {
                return Err(PyTypeError::new_err(
                    "pass tokens or block_hashes, not both",
                ))
            }
            (None, None) => {
                return Err(PyTypeError::new_err(
                    "find_matches() needs tokens or block_hashes",
                ))
            }
            (None, Some(h)) => {
                if lora_name.is_some() || extra_keys.is_some() {
                    return Err(PyValueError::new_err(
                        "lora_name and extra_keys go with tokens; block hashes already include them",
                    ));
                }
                read_block_hashes(h)?
            }
            (Some(t), None) => {
                if self.mode == Mode::Engine {
                    return Err(PyValueError::new_err(
                        "an Index(key='engine') is keyed by the engines' block hashes: pass \
                         block_hashes= (e.g. from kvbridge.hash_blocks with the engines' algo and seed)",
                    ));
                }
                match extra_keys {
                    // Hashed as the query's walk reaches them (index::keys).
                    None => Keys::Tokens {
                        tokens: tokens::read(t)?,
                        seed: salted(0, lora_name, None),
                    },
                    Some(_) => Keys::Pooled(self.hash_tokens(py, t, lora_name, extra_keys)?),
                }
            }
        })
    }

    /// Runs `query` (which fills (worker id, count) pairs) under the read lock, and pairs each
    /// count with the worker's name as a Python str (the second Vec, in the same order): the
    /// cached one when the id still names the same worker, made and cached otherwise. When the
    /// state's lock is free at once (a short query), the name cache is locked first and compared
    /// with the workers' names under the state's lock, so no name is cloned per worker;
    /// otherwise (the read may wait with the GIL released, and nothing may then hold the cache)
    /// the names are cloned and compared after.
    fn named<'py>(
        &self,
        py: Python<'py>,
        long: bool,
        keys: &Keys<'_>,
        query: impl FnOnce(&Core, &mut Query<'_>, &mut Vec<(u32, u32)>) + Send,
    ) -> (Recycled<(u32, u32)>, Vec<Bound<'py, PyString>>) {
        /// The pairs, and the names the cache lacks by position in them (usually none, so
        /// nothing is allocated for them).
        type Rows = (Recycled<(u32, u32)>, Vec<(usize, Arc<str>)>);
        fn rows(
            core: &Core,
            query: impl FnOnce(&Core, &mut Vec<(u32, u32)>),
            cached: &[Option<NameCache>],
        ) -> Rows {
            // From this thread's pool (the answer's vector was allocated and freed on every
            // call), with room for a common fleet's answer at once, where growing from empty
            // reallocated five times for ~40 workers.
            let mut found = Recycled::take(&FOUND);
            found.reserve(64);
            query(core, &mut found);
            let misses = found
                .iter()
                .enumerate()
                .filter_map(|(i, &(w, _))| {
                    let name = core.name(w);
                    let known = cached
                        .get(w as usize)
                        .and_then(Option::as_ref)
                        .is_some_and(|c| Arc::ptr_eq(&c.0, name));
                    (!known).then(|| (i, name.clone()))
                })
                .collect();
            (found, misses)
        }
        let lock_names = || self.names.lock().unwrap_or_else(|e| e.into_inner());
        let mut cache = lock_names();
        let free = match self.core.try_read() {
            _ if long => None,
            Ok(g) => Some(g),
            Err(TryLockError::Poisoned(p)) => Some(p.into_inner()),
            Err(TryLockError::WouldBlock) => None,
        };
        let bs = self.block_size;
        let (found, misses) = match free {
            Some(core) => {
                let mut made = matches!(keys, Keys::Tokens { .. }).then(|| Recycled::take(&KEYS));
                let mut q = keys.query(bs, made.as_deref_mut());
                rows(&core, |c, f| query(c, &mut q, f), &cache)
            }
            None => {
                drop(cache);
                // What may be read with the GIL released: token ids in a buffer are copied.
                let shared = match keys {
                    Keys::Tokens { tokens, seed } => Err((tokens.as_slice().to_vec(), *seed)),
                    keys => Ok(keys.shared()),
                };
                let rows = self.read(py, long, |core| {
                    let mut made = Vec::new();
                    let mut q = match &shared {
                        Ok(keys) => Query::Given(keys),
                        Err((tokens, seed)) => {
                            Query::Tokens(TokenKeys::new(tokens, bs, *seed, &mut made))
                        }
                    };
                    rows(core, |c, f| query(c, &mut q, f), &[])
                });
                cache = lock_names();
                rows
            }
        };
        let layout = inline_layout(py);
        let mut misses = misses.into_iter().peekable();
        let names = found
            .iter()
            .enumerate()
            .map(|(i, &(w, _))| match misses.next_if(|m| m.0 == i) {
                Some((_, name)) => name_obj(py, &mut cache, w, name),
                None => {
                    let name = cache[w as usize].as_ref().expect("cached").1.as_ptr();
                    // SAFETY: a live str the cache holds a reference to; the GIL is held. The
                    // new reference is the Bound's.
                    unsafe {
                        incref(layout, name);
                        Bound::from_owned_ptr(py, name).cast_into_unchecked()
                    }
                }
            })
            .collect();
        (found, names)
    }

    /// Runs `f` on the state exclusively: at once if the lock is free and the work short,
    /// otherwise with the GIL released (waiting for the lock included).
    fn write<R: Send>(
        &self,
        py: Python<'_>,
        long: bool,
        f: impl FnOnce(&mut Core) -> R + Send,
    ) -> R {
        if !long {
            match self.core.try_write() {
                Ok(mut g) => return f(&mut g),
                Err(TryLockError::Poisoned(p)) => return f(&mut p.into_inner()),
                Err(TryLockError::WouldBlock) => {}
            }
        }
        py.detach(|| f(&mut self.lock_write()))
    }

    fn lock_write(&self) -> RwLockWriteGuard<'_, Core> {
        self.core.write().unwrap_or_else(|e| e.into_inner())
    }

    fn read<R: Send>(&self, py: Python<'_>, long: bool, f: impl FnOnce(&Core) -> R + Send) -> R {
        if !long {
            match self.core.try_read() {
                Ok(g) => return f(&g),
                Err(TryLockError::Poisoned(p)) => return f(&p.into_inner()),
                Err(TryLockError::WouldBlock) => {}
            }
        }
        py.detach(|| f(&self.core.read().unwrap_or_else(|e| e.into_inner())))
    }

    /// The index keys of a prompt's full blocks: the chained xxh3 hash, salted by the LoRA name
    /// and each block's extra keys in their canonical form.
    fn hash_tokens(
        &self,
        py: Python<'_>,
        tokens: &Bound<'_, PyAny>,
        lora_name: Option<&str>,
        extra_keys: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<Recycled<u64>> {
        let toks = tokens::read(tokens)?;
        let bs = self.block_size;
        let n_blocks = toks.as_slice().len() / bs;
        let extras = extra_keys.map(|k| keys_from_py(k, n_blocks)).transpose()?;
        let full = &toks.as_slice()[..n_blocks * bs];
        Ok(pooled_keys(py, full, |t, keys| {
            index_keys(t, bs, lora_name, None, extras.as_deref(), keys)
        }))
    }

    /// Every index key of `tokens`' full blocks without extra keys, from `seed` (the LoRA
    /// name's salt).
    fn made_keys(&self, py: Python<'_>, tokens: &[u32], seed: u64) -> Recycled<u64> {
        let bs = self.block_size;
        let full = &tokens[..tokens.len() / bs * bs];
        pooled_keys(py, full, |t, keys| xxh3_chain(t, bs, seed, keys))
    }
}

/// `hash(full, keys)` into a vector of this thread's pool (a query's keys were allocated and
/// freed on every call), with the GIL released, on a copy of `full`, for a long prompt.
fn pooled_keys(
    py: Python<'_>,
    full: &[u32],
    hash: impl Fn(&[u32], &mut Vec<u64>) + Sync,
) -> Recycled<u64> {
    let mut keys = Recycled::take(&KEYS);
    if full.len() >= DETACH_MIN_TOKENS {
        let copy = full.to_vec();
        py.detach(|| hash(&copy, &mut keys));
    } else {
        hash(full, &mut keys);
    }
    keys
}
