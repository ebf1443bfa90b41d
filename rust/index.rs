//! `kvbridge.Index`: which leading blocks of a prompt each worker holds, from KV event payloads.
//!
//! The rules live in `core` (pyo3-free), payload decoding in `parse`, holder sets in `holders`;
//! this file is the Python face: argument checks, the lock, the GIL.
//!
//! Locking: one `RwLock` around the state. Queries take it shared, `apply` exclusive. Nothing
//! touches Python while holding it, and a call that would wait for it (or is long) waits with
//! the GIL released, so a query thread and an applying thread never block each other on the
//! GIL and the lock at once.

pub(crate) mod core;
mod events;
mod groups;
mod holders;
pub(crate) mod json;
pub(crate) mod keys;
pub(crate) mod parse;
pub(crate) mod pipeline;
pub(crate) mod table;

use std::cell::Cell;
use std::sync::{Arc, Mutex, RwLock, RwLockWriteGuard, TryLockError};

use pyo3::exceptions::{PyTypeError, PyValueError};
use pyo3::ffi;
use pyo3::prelude::*;
use pyo3::sync::PyOnceLock;
use pyo3::types::{PyByteArray, PyBytes, PyDict, PyInt, PyList, PyMemoryView, PyString, PyTuple};

use self::core::{Core, Mode};
use self::keys::TokenKeys;
use self::parse::{detect, reduce_bytes, Format};
use self::pipeline::{apply_many, apply_one};
use crate::cpython;
use crate::decode::{incref, new_list, set_item};
use crate::hash::algo::{index_keys, salted, xxh3_chain};
use crate::hash::buffer::Buffer;
use crate::hash::scratch::Recycled;
use crate::hash::tokens;
use crate::hash::value::Value;
use crate::reader::{Hash, Reader};

thread_local! {
    static KEYS: Cell<Vec<u64>> = const { Cell::new(Vec::new()) };
    static FOUND: Cell<Vec<(u32, u32)>> = const { Cell::new(Vec::new()) };
}

/// Payloads and queries at least this long are handled with the GIL released.
const DETACH_MIN_BYTES: usize = 64 << 10;
const DETACH_MIN_TOKENS: usize = 1 << 16;
const KEY_NESTING_LIMIT: usize = 64;

pub fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<Index>()?;
    m.add_function(wrap_pyfunction!(unpack_query_ints, m)?)
}

/// A query field's msgpack array of ints, as the index service receives it (a `msgspec.Raw`),
/// as a memoryview of packed native ints ('I' for `tokens`, 'Q' otherwise), which
/// `Index.find_matches` reads without a Python int per item; None for an absent field or nil.
/// ValueError in msgspec's words (the service's error replies read the same either way).
#[pyfunction]
fn unpack_query_ints<'py>(
    raw: &Bound<'py, PyAny>,
    field: &str,
) -> PyResult<Option<Bound<'py, PyAny>>> {
    let py = raw.py();
    let buffer = Buffer::get(raw, pyo3::ffi::PyBUF_ND)?;
    let b: &[u8] = if buffer.len() == 0 {
        &[]
    } else {
        // SAFETY: a contiguous (PyBUF_ND) export of len() bytes (Raw is bytes-like).
        unsafe { std::slice::from_raw_parts(buffer.ptr(), buffer.len() * buffer.itemsize()) }
    };
    let mut r = Reader { b, p: 0 };
    if b.is_empty() || r.nil() {
        return Ok(None);
    }
    let tokens = field == "tokens";
    let bad = |at: String, what: String| {
        PyValueError::new_err(format!("Expected {what} - at `$.{field}{at}`"))
    };
    let Some(n) = r.array_len() else {
        return Err(bad(
            String::new(),
            format!("`array | null`, got `{}`", msgpack_type(b[0])),
        ));
    };
    let mut out: Vec<u8> = Vec::with_capacity(n * if tokens { 4 } else { 8 });
    for i in 0..n {
        let marker = r.peek().unwrap_or(0xc1);
        let v = match r.int() {
            Some(Hash::U(v)) => v,
            Some(Hash::I(v)) if v >= 0 => v as u64,
            Some(_) => return Err(bad(format!("[{i}]"), "`int` >= 0".into())),
            None => {
                return Err(bad(
                    format!("[{i}]"),
                    format!("`int`, got `{}`", msgpack_type(marker)),
                ))
            }
        };
        if tokens {
            let t = u32::try_from(v)
                .map_err(|_| bad(format!("[{i}]"), "`int` <= 4294967295".into()))?;
            out.extend_from_slice(&t.to_ne_bytes());
        } else {
            out.extend_from_slice(&v.to_ne_bytes());
        }
    }
    let view = PyMemoryView::from(PyBytes::new(py, &out).as_any())?;
    Ok(Some(
        view.call_method1("cast", (if tokens { "I" } else { "Q" },))?,
    ))
}

/// msgspec's name for the type of the msgpack value starting with `marker`.
fn msgpack_type(marker: u8) -> &'static str {
    match marker {
        0xa0..=0xbf | 0xd9..=0xdb => "str",
        0xca | 0xcb => "float",
        0xc2 | 0xc3 => "bool",
        0xc0 => "null",
        0x90..=0x9f | 0xdc | 0xdd => "array",
        0x80..=0x8f | 0xde | 0xdf => "object",
        0xc4..=0xc6 => "bytes",
        0xc7..=0xc9 | 0xd4..=0xd8 => "ext",
        _ => "int",
    }
}

type NameCache = (Arc<str>, Py<PyString>);

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
        top_k: Option<usize>,
    ) -> PyResult<Bound<'py, PyAny>> {
        let medium = opt_str("medium", medium)?;
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

/// The largest `top_k` that `keep_top` keeps by insertion.
const KEEP_BY_INSERTION: usize = 16;

/// Keeps the `k` pairs with the longest hits, longest first, ties in worker id order: one pass
/// that inserts into the kept prefix only what beats its last (a router's k is small, and most
/// workers do not), where a sort of every pair cost as much as the query's lookups.
fn keep_top(found: &mut Vec<(u32, u32)>, k: usize) {
    if k > KEEP_BY_INSERTION {
        // Inserting costs up to k moves a pair: a large k sorts (ids are unique, so an
        // unstable sort gives the same order).
        found.sort_unstable_by_key(|&(w, n)| (std::cmp::Reverse(n), w));
        found.truncate(k);
        return;
    }
    let before = |a: (u32, u32), b: (u32, u32)| a.1 > b.1 || (a.1 == b.1 && a.0 < b.0);
    let mut kept = 0;
    for i in 0..found.len() {
        let x = found[i];
        if kept == k {
            if k == 0 || !before(x, found[k - 1]) {
                continue;
            }
            kept -= 1;
        }
        // Slots kept..=i hold pairs already passed over (or x itself), free to overwrite.
        let mut j = kept;
        while j > 0 && before(x, found[j - 1]) {
            found[j] = found[j - 1];
            j -= 1;
        }
        found[j] = x;
        kept += 1;
    }
    found.truncate(kept);
}

/// Counts below this come from one table of int objects (CPython's own small ints up to 256),
/// so a count costs a reference, not a call; longer hits are made as ints.
const COUNT_INTS: usize = 1024;

fn count_ints(py: Python<'_>) -> &[Py<PyAny>] {
    static INTS: PyOnceLock<Vec<Py<PyAny>>> = PyOnceLock::new();
    INTS.get_or_init(py, || {
        (0..COUNT_INTS)
            .map(|n| n.into_pyobject(py).expect("an int").into_any().unbind())
            .collect()
    })
}

/// The layout for inline reference counts (`decode::incref`), which read a 32-bit half as the
/// low one.
fn inline_layout(py: Python<'_>) -> cpython::Layout {
    if cfg!(target_endian = "little") {
        cpython::layout(py)
    } else {
        cpython::Layout::Api
    }
}

/// `(workers, counts)` as two lists filled slot by slot (no call per item where
/// `crate::cpython` knows the list layout).
fn lists_answer<'py>(
    py: Python<'py>,
    found: &[(u32, u32)],
    names: Vec<Bound<'py, PyString>>,
) -> PyResult<Bound<'py, PyAny>> {
    let layout = inline_layout(py);
    let ints = count_ints(py);
    let workers = new_list(py, found.len())?;
    let counts = new_list(py, found.len())?;
    let count = |n: u32| -> PyResult<*mut ffi::PyObject> {
        Ok(match ints.get(n as usize) {
            Some(int) => {
                // SAFETY: a live int the table holds a reference to; the GIL is held.
                unsafe { incref(layout, int.as_ptr()) };
                int.as_ptr()
            }
            None => n.into_pyobject(py)?.into_ptr(),
        })
    };
    // SAFETY: both lists are fresh, with found.len() slots each; no Python code runs while the
    // slots are in use (making an int runs none).
    let slots = unsafe {
        (
            cpython::fresh_list_slots(layout, workers.as_ptr()),
            cpython::fresh_list_slots(layout, counts.as_ptr()),
        )
    };
    if let (Some(worker_slots), Some(count_slots)) = slots {
        // One loop over the three arrays, no per-item test of which way to set a slot.
        let items = names.into_iter().zip(found);
        for ((w, c), (name, &(_, n))) in worker_slots.iter_mut().zip(count_slots).zip(items) {
            *w = name.into_ptr();
            *c = count(n)?;
        }
    } else {
        for (i, (name, &(_, n))) in names.into_iter().zip(found).enumerate() {
            set_item(&workers, None, i, name.into_ptr());
            set_item(&counts, None, i, count(n)?);
        }
    }
    Ok(PyTuple::new(py, [workers, counts])?.into_any())
}

/// The Python str for worker `w`'s name, made once per worker (the Arc tells whether the id
/// still names the same worker).
fn name_obj<'py>(
    py: Python<'py>,
    cache: &mut Vec<Option<NameCache>>,
    w: u32,
    name: Arc<str>,
) -> Bound<'py, PyString> {
    let w = w as usize;
    if cache.len() <= w {
        cache.resize_with(w + 1, || None);
    }
    match &cache[w] {
        Some((known, s)) if Arc::ptr_eq(known, &name) => s.bind(py).clone(),
        _ => {
            let s = PyString::new(py, &name);
            cache[w] = Some((name, s.clone().unbind()));
            s
        }
    }
}

/// `format=`: "msgpack", "json" or None (detected per payload).
fn format_arg(format: Option<&Bound<'_, PyAny>>) -> PyResult<Option<Format>> {
    let Some(f) = format.filter(|f| !f.is_none()) else {
        return Ok(None);
    };
    match f
        .cast::<PyString>()
        .map_err(|_| type_error("format", "str", f))?
        .to_str()?
    {
        "msgpack" => Ok(Some(Format::Msgpack)),
        "json" => Ok(Some(Format::Json)),
        other => Err(PyValueError::new_err(format!(
            "format must be 'msgpack', 'json' or None, got '{other}'"
        ))),
    }
}

/// A payload's bytes: bytes as they are, a copy of a bytearray or memoryview (another thread
/// may change a mutable buffer while the GIL is released), a KVEventBatch's exact msgpack.
fn payload_bytes<'py>(py: Python<'py>, data: &Bound<'py, PyAny>) -> PyResult<Bound<'py, PyBytes>> {
    if let Ok(b) = data.cast::<PyBytes>() {
        Ok(b.clone())
    } else if data.is_instance_of::<PyByteArray>() || data.is_instance_of::<PyMemoryView>() {
        py.get_type::<PyBytes>()
            .call1((data,))?
            .cast_into::<PyBytes>()
            .map_err(Into::into)
    } else if data.is_instance(kv_event_batch(py)?)? {
        // Already decoded: its exact msgpack bytes take the same path as a payload.
        encode_batch(py)?
            .call1((data,))?
            .cast_into::<PyBytes>()
            .map_err(Into::into)
    } else {
        Err(type_error(
            "data",
            "bytes, bytearray, memoryview or a KVEventBatch",
            data,
        ))
    }
}

fn type_error(arg: &str, want: &str, got: &Bound<'_, PyAny>) -> PyErr {
    let kind = got
        .get_type()
        .name()
        .map_or_else(|_| "?".to_string(), |n| n.to_string());
    PyTypeError::new_err(format!("{arg} must be {want}, not {kind}"))
}

fn opt_str<'a>(arg: &str, v: Option<&'a Bound<'_, PyAny>>) -> PyResult<Option<&'a str>> {
    match v.filter(|v| !v.is_none()) {
        None => Ok(None),
        Some(v) => Ok(Some(
            v.cast::<PyString>()
                .map_err(|_| type_error(arg, "str or None", v))?
                .to_str()?,
        )),
    }
}

fn kv_event_batch(py: Python<'_>) -> PyResult<&Bound<'_, PyAny>> {
    static CLS: PyOnceLock<Py<PyAny>> = PyOnceLock::new();
    CLS.import(py, "kvbridge.wire.events", "KVEventBatch")
}

fn encode_batch(py: Python<'_>) -> PyResult<&Bound<'_, PyAny>> {
    static F: PyOnceLock<Py<PyAny>> = PyOnceLock::new();
    F.import(py, "kvbridge.wire.events", "encode_batch")
}

/// Block hashes as a router passes them: ints (-2**63..2**64-1, negatives as two's complement,
/// as a signed 64-bit engine writes them) or bytes (reduced like vLLM: the last 8 bytes), in a
/// list or any iterable; or a buffer, read without a Python object per hash: 64-bit ints
/// (array('Q'), numpy), or bytes-like (bytes, bytearray, memoryview of bytes) of packed
/// native-endian 64-bit ints.
fn read_block_hashes<'a>(obj: &'a Bound<'_, PyAny>) -> PyResult<Keys<'a>> {
    const WANT: &str = "a list of int or bytes, or a buffer of 64-bit ints";
    if obj.is_instance_of::<PyString>() {
        return Err(type_error("block_hashes", WANT, obj));
    }
    // bytes read as they are: no buffer export (an allocation and two calls) for the common case.
    if let Ok(b) = obj.cast::<PyBytes>() {
        let bytes = b.as_bytes();
        if bytes.len() % 8 == 0 {
            return Ok(match words_in_place(bytes.as_ptr(), bytes.len() / 8) {
                // SAFETY: the bytes' words, inside the object the caller's frame holds; bytes
                // never change.
                Some((p, n)) => Keys::Frozen(unsafe { std::slice::from_raw_parts(p, n) }),
                None => Keys::Owned(words_from_ne_bytes(bytes)),
            });
        }
    }
    let is_seq = obj.is_instance_of::<PyList>() || obj.is_instance_of::<PyTuple>();
    // SAFETY: obj is a live object.
    if !is_seq && unsafe { pyo3::ffi::PyObject_CheckBuffer(obj.as_ptr()) } != 0 {
        return hashes_from_buffer(obj, WANT);
    }
    let iter = obj
        .try_iter()
        .map_err(|_| type_error("block_hashes", WANT, obj))?;
    let mut out = Vec::new();
    for (i, item) in iter.enumerate() {
        let item = item?;
        if let Ok(b) = item.cast::<PyBytes>() {
            out.push(reduce_bytes(b.as_bytes()));
        } else if item.is_instance_of::<PyInt>() && !item.is_instance_of::<pyo3::types::PyBool>() {
            let v = match item.extract::<u64>() {
                Ok(v) => v,
                Err(_) => item.extract::<i64>().map_err(|_| {
                    PyValueError::new_err(format!(
                        "block_hashes[{i}] is {item}, outside -2**63..2**64-1"
                    ))
                })? as u64,
            };
            out.push(v);
        } else {
            return Err(type_error(
                &format!("block_hashes[{i}]"),
                "int or bytes",
                &item,
            ));
        }
    }
    Ok(Keys::Owned(out))
}

fn hashes_from_buffer(obj: &Bound<'_, PyAny>, want: &str) -> PyResult<Keys<'static>> {
    let buffer = Buffer::get(obj, pyo3::ffi::PyBUF_RECORDS_RO)?;
    let (n, stride, base) = (buffer.len(), buffer.stride(), buffer.ptr() as *const u8);
    if let Some(layout) = buffer.int_layout().filter(|l| l.size == 8) {
        if stride == 8 && !layout.swap {
            if n == 0 {
                return Ok(Keys::Owned(Vec::new()));
            }
            return Ok(match words_in_place(base, n) {
                Some((words, n)) => Keys::Exported {
                    _held: buffer,
                    words,
                    n,
                },
                // SAFETY: n contiguous 8-byte items (n > 0 means a non-null pointer).
                None => Keys::Owned(words_from_ne_bytes(unsafe {
                    std::slice::from_raw_parts(base, n * 8)
                })),
            });
        }
        return Ok(Keys::Owned(
            (0..n)
                .map(|i| {
                    // SAFETY: item i of n lies `stride` bytes apart inside the export, 8 bytes long.
                    let v = unsafe {
                        base.offset(i as isize * stride)
                            .cast::<u64>()
                            .read_unaligned()
                    };
                    if layout.swap {
                        v.swap_bytes()
                    } else {
                        v
                    }
                })
                .collect(),
        ));
    }
    if buffer.itemsize() == 1 && stride == 1 && n % 8 == 0 {
        let bytes = if n == 0 {
            &[][..]
        } else {
            // SAFETY: n contiguous bytes inside the export (n > 0 means a non-null pointer).
            unsafe { std::slice::from_raw_parts(base, n) }
        };
        return Ok(Keys::Owned(words_from_ne_bytes(bytes)));
    }
    Err(PyTypeError::new_err(format!(
        "block_hashes must be {want}, not a buffer of format '{}' ({} bytes{})",
        buffer.format(),
        n * buffer.itemsize(),
        if buffer.itemsize() == 1 {
            ", not a multiple of 8"
        } else {
            ""
        }
    )))
}

/// A query's keys: read in place from the caller's object where its words are aligned (no
/// copy, no allocation), copied otherwise.
enum Keys<'a> {
    Owned(Vec<u64>),
    /// Hashed here, into a vector of this thread's pool.
    Pooled(Recycled<u64>),
    /// A bytes object's words: it never changes, so they may be read with the GIL released.
    Frozen(&'a [u64]),
    /// A mutable buffer's words, held exported (it cannot be resized meanwhile), but another
    /// thread could write them: read only while the GIL is held and no Python code runs.
    Exported {
        _held: Buffer,
        words: *const u64,
        n: usize,
    },
    /// Token ids of a query without extra keys: hashed as the walk reaches them (`seed`: the
    /// key before the first block's).
    Tokens {
        tokens: tokens::Tokens,
        seed: u64,
    },
}

/// A query's keys as the core walks them: given, or made from token ids on the way.
enum Query<'k> {
    Given(&'k [u64]),
    Tokens(TokenKeys<'k>),
}

impl Keys<'_> {
    /// The keys as given or made (token ids go through `query`, or are made first).
    fn as_slice(&self) -> &[u64] {
        match self {
            Keys::Owned(v) => v,
            Keys::Pooled(v) => v,
            Keys::Frozen(s) => s,
            // SAFETY: n aligned words inside the held export.
            Keys::Exported { words, n, .. } => unsafe { std::slice::from_raw_parts(*words, *n) },
            Keys::Tokens { .. } => unreachable!("token ids are walked through Keys::query"),
        }
    }

    /// How many blocks the query has.
    fn blocks(&self, block_size: usize) -> usize {
        match self {
            Keys::Tokens { tokens, .. } => tokens.as_slice().len() / block_size,
            keys => keys.as_slice().len(),
        }
    }

    /// The walk's view of these keys (`made`: room for keys made from token ids, which
    /// `Keys::Tokens` needs).
    fn query<'k>(&'k self, block_size: usize, made: Option<&'k mut Vec<u64>>) -> Query<'k> {
        match self {
            Keys::Tokens { tokens, seed } => {
                let made = made.expect("room for the keys made from token ids");
                Query::Tokens(TokenKeys::new(tokens.as_slice(), block_size, *seed, made))
            }
            keys => Query::Given(keys.as_slice()),
        }
    }

    /// Keys that may be read with the GIL released: a copy of an exported buffer's.
    fn shared(&self) -> std::borrow::Cow<'_, [u64]> {
        match self {
            Keys::Exported { .. } => std::borrow::Cow::Owned(self.as_slice().to_vec()),
            _ => std::borrow::Cow::Borrowed(self.as_slice()),
        }
    }
}

/// `n` native-endian words at `p` as a `u64` pointer when `p` is aligned for them.
fn words_in_place(p: *const u8, n: usize) -> Option<(*const u64, usize)> {
    let words = p.cast::<u64>();
    (n > 0 && words.is_aligned()).then_some((words, n))
}

/// Packed native-endian 64-bit ints (a multiple of 8 bytes), copied in one go.
fn words_from_ne_bytes(bytes: &[u8]) -> Vec<u64> {
    let n = bytes.len() / 8;
    let mut out = Vec::<u64>::with_capacity(n);
    // SAFETY: the vector has room for n words, which the copy fills (any bit pattern is a u64).
    unsafe {
        std::ptr::copy_nonoverlapping(bytes.as_ptr(), out.as_mut_ptr().cast::<u8>(), n * 8);
        out.set_len(n);
    }
    out
}

/// Query extra keys, one entry per full block, in the canonical form payloads decode to:
/// None, bool, int, str, bytes, and tuples or lists (both arrays) of these.
fn keys_from_py(obj: &Bound<'_, PyAny>, n_blocks: usize) -> PyResult<Vec<Option<Value>>> {
    if !(obj.is_instance_of::<PyList>() || obj.is_instance_of::<PyTuple>()) {
        return Err(type_error(
            "extra_keys",
            "a list with one entry per full block",
            obj,
        ));
    }
    let len = obj.len()?;
    if len != n_blocks {
        return Err(PyValueError::new_err(format!(
            "extra_keys has {len} entries but the tokens make {n_blocks} full blocks"
        )));
    }
    let mut out = Vec::with_capacity(len);
    for (i, entry) in obj.try_iter()?.enumerate() {
        let entry = entry?;
        let path = format!("extra_keys[{i}]");
        if entry.is_none() {
            out.push(None);
            continue;
        }
        if !(entry.is_instance_of::<PyList>() || entry.is_instance_of::<PyTuple>()) {
            return Err(type_error(&path, "None or a tuple", &entry));
        }
        match key_value(&entry, &path, 0)? {
            // An empty tuple salts nothing, like None (and like a LoRA-only entry once the
            // LoRA name is left out).
            Value::Tuple(items, _) if items.is_empty() => out.push(None),
            v => out.push(Some(v)),
        }
    }
    Ok(out)
}

fn key_value(obj: &Bound<'_, PyAny>, path: &str, depth: usize) -> PyResult<Value> {
    if depth > KEY_NESTING_LIMIT {
        return Err(PyValueError::new_err(format!("{path}: nested too deeply")));
    }
    if obj.is_none() {
        Ok(Value::None)
    } else if let Ok(b) = obj.cast::<pyo3::types::PyBool>() {
        Ok(Value::Bool(b.is_true()))
    } else if obj.is_instance_of::<PyInt>() {
        match obj.extract::<i64>() {
            Ok(v) => Ok(Value::Int(v)),
            Err(_) => match obj.extract::<u64>() {
                Ok(v) => {
                    let mut le = v.to_le_bytes().to_vec();
                    le.push(0);
                    Ok(Value::BigInt(le))
                }
                Err(_) => Err(PyValueError::new_err(format!(
                    "{path} is {obj}, outside -2**63..2**64-1"
                ))),
            },
        }
    } else if let Ok(s) = obj.cast::<PyString>() {
        let s = s
            .to_str()
            .map_err(|_| PyValueError::new_err(format!("{path}: a str with lone surrogates")))?;
        Ok(Value::Str(s.as_bytes().to_vec(), 0))
    } else if let Ok(b) = obj.cast::<PyBytes>() {
        Ok(Value::Bytes(b.as_bytes().to_vec(), 0))
    } else if obj.is_instance_of::<PyList>() || obj.is_instance_of::<PyTuple>() {
        let items = obj
            .try_iter()?
            .enumerate()
            .map(|(i, item)| key_value(&item?, &format!("{path}[{i}]"), depth + 1))
            .collect::<PyResult<Vec<_>>>()?;
        Ok(Value::Tuple(items, 0))
    } else {
        Err(type_error(
            path,
            "None, bool, int, str, bytes or a tuple of these",
            obj,
        ))
    }
}
