//! The Python face of chained block hashing: `hash_blocks` and `BlockHasher`.
//! Arguments are checked and copied into Rust data here; the algorithms live in `algo`.

pub(crate) mod algo;
mod buffer;
mod cbor;
mod pickle;
mod scratch;
mod tokenbytes;
pub(crate) mod tokens;
pub(crate) mod value;

use pyo3::exceptions::{PyTypeError, PyValueError};
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyInt, PyList, PyString, PyTuple};
use xxhash_rust::xxh3::xxh3_64;

use std::cell::Cell;

use pyo3::ffi;

use algo::{Algo, Chain, Digest, ALGORITHMS};
use buffer::Buffer;
use scratch::Recycled;
use value::{Id, Value};

/// Below this many tokens a call is over before releasing the GIL would pay off.
const DETACH_MIN_TOKENS: usize = 1 << 16;

/// vLLM's DEFAULT_NONE_HASH_SEED, used when neither `seed` nor PYTHONHASHSEED is given.
const VLLM_DEFAULT_SEED: &str = "vllm-none-hash";

thread_local! {
    static DIGESTS: Cell<Vec<Digest>> = const { Cell::new(Vec::new()) };
}

pub fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_function(wrap_pyfunction!(hash_blocks, m)?)?;
    m.add_class::<BlockHasher>()?;
    m.add("ALGORITHMS", PyTuple::new(m.py(), ALGORITHMS.iter().map(|(name, _)| *name))?)?;
    Ok(())
}

/// One chained hash per full block of `tokens`; see kvbridge.hashing for the algorithms.
/// With `out`, the 64-bit hashes go into that uint64 buffer and the block count is returned.
#[pyfunction]
#[pyo3(signature = (tokens, block_size, *, algo = "xxh3", seed = None, parent = None,
    extra_keys = None, as_bytes = false, lora_name = None, cache_namespace = None, out = None))]
#[allow(clippy::too_many_arguments)]
fn hash_blocks<'py>(
    py: Python<'py>,
    tokens: &Bound<'py, PyAny>,
    block_size: i64,
    algo: &str,
    seed: Option<&Bound<'py, PyAny>>,
    parent: Option<&Bound<'py, PyAny>>,
    extra_keys: Option<&Bound<'py, PyAny>>,
    as_bytes: bool,
    lora_name: Option<&str>,
    cache_namespace: Option<&str>,
    out: Option<&Bound<'py, PyAny>>,
) -> PyResult<Bound<'py, PyAny>> {
    let mut chain = new_chain(algo, block_size, seed, lora_name, cache_namespace)?;
    let parent_id = set_parent(&mut chain, parent)?;
    let tokens = tokens::read(tokens)?;
    let all = tokens.as_slice();
    let n_blocks = all.len() / chain.block_size;
    let extras = parse_extras(chain.algo, extra_keys, n_blocks)?;
    let out = out.map(|o| out_buffer(o, n_blocks, as_bytes)).transpose()?;
    let full = &all[..n_blocks * chain.block_size];
    let digests = run(py, &mut chain, full, tokens.is_shared(), extras.as_deref(), parent_id);
    match out {
        Some(buffer) => {
            // SAFETY: out_buffer checked a writable, aligned, contiguous u64 buffer of at least
            // n_blocks items, and its export is held.
            let dst = unsafe { std::slice::from_raw_parts_mut(buffer.ptr() as *mut u64, n_blocks) };
            for (d, digest) in dst.iter_mut().zip(digests.iter()) {
                *d = digest.event_hash();
            }
            Ok(n_blocks.into_pyobject(py)?.into_any())
        }
        None => Ok(to_list(py, &digests, as_bytes)?.into_any()),
    }
}

/// The `out` argument: a writable, contiguous, native uint64 buffer with room for every block.
fn out_buffer(out: &Bound<'_, PyAny>, n_blocks: usize, as_bytes: bool) -> PyResult<Buffer> {
    if as_bytes {
        return Err(PyValueError::new_err("out receives 64-bit hashes; it cannot be combined with as_bytes=True"));
    }
    let buffer = Buffer::get(out, ffi::PyBUF_WRITABLE | ffi::PyBUF_C_CONTIGUOUS)?;
    let native_u64 = buffer.int_layout().is_some_and(|l| l.size == 8 && !l.signed && !l.swap);
    if !native_u64 || !(buffer.ptr() as usize).is_multiple_of(8) {
        return Err(PyTypeError::new_err(format!(
            "out must be an aligned native uint64 buffer (numpy uint64, array('Q')), not format '{}'",
            buffer.format()
        )));
    }
    if buffer.len() < n_blocks {
        return Err(PyValueError::new_err(format!(
            "out has room for {} hashes but the tokens make {n_blocks} full blocks",
            buffer.len()
        )));
    }
    Ok(buffer)
}

/// Incremental hashing of one growing sequence: feed tokens as they arrive, get the hashes of
/// the blocks they complete. Holds the parent digest and the partial block, so no block is
/// hashed twice and a decode step costs one call.
#[pyclass(module = "kvbridge._native")]
#[derive(Clone)]
struct BlockHasher {
    chain: Chain,
    pending: Vec<u32>,
    num_blocks: usize,
}

#[pymethods]
impl BlockHasher {
    #[new]
    #[pyo3(signature = (block_size, *, algo = "xxh3", seed = None, parent = None,
        lora_name = None, cache_namespace = None))]
    fn new(
        block_size: i64,
        algo: &str,
        seed: Option<&Bound<'_, PyAny>>,
        parent: Option<&Bound<'_, PyAny>>,
        lora_name: Option<&str>,
        cache_namespace: Option<&str>,
    ) -> PyResult<Self> {
        let mut chain = new_chain(algo, block_size, seed, lora_name, cache_namespace)?;
        set_parent(&mut chain, parent)?;
        Ok(BlockHasher { chain, pending: Vec::new(), num_blocks: 0 })
    }

    /// Appends tokens; returns the hashes of the blocks completed by them. `extra_keys` has one
    /// entry per completed block.
    #[pyo3(signature = (tokens, extra_keys = None, *, as_bytes = false))]
    fn update<'py>(
        &mut self,
        py: Python<'py>,
        tokens: &Bound<'py, PyAny>,
        extra_keys: Option<&Bound<'py, PyAny>>,
        as_bytes: bool,
    ) -> PyResult<Bound<'py, PyList>> {
        let tokens = tokens::read(tokens)?;
        let bs = self.chain.block_size;
        let n_blocks = (self.pending.len() + tokens.as_slice().len()) / bs;
        let extras = parse_extras(self.chain.algo, extra_keys, n_blocks)?;
        let digests = if self.pending.is_empty() {
            let new = tokens.as_slice();
            let full = n_blocks * bs;
            let digests = run(py, &mut self.chain, &new[..full], tokens.is_shared(), extras.as_deref(), 0);
            self.pending.extend_from_slice(&new[full..]);
            digests
        } else {
            self.pending.extend_from_slice(tokens.as_slice());
            let full = n_blocks * bs;
            let digests = run(py, &mut self.chain, &self.pending[..full], false, extras.as_deref(), 0);
            self.pending.drain(..full);
            digests
        };
        self.num_blocks += digests.len();
        to_list(py, &digests, as_bytes)
    }

    /// A fork of this chain (e.g. for sequences that share this prefix).
    fn copy(&self) -> Self {
        self.clone()
    }

    fn __copy__(&self) -> Self {
        self.clone()
    }

    #[getter]
    fn algo(&self) -> &'static str {
        self.chain.algo.name()
    }

    #[getter]
    fn block_size(&self) -> usize {
        self.chain.block_size
    }

    /// Full blocks hashed so far.
    #[getter]
    fn num_blocks(&self) -> usize {
        self.num_blocks
    }

    /// Tokens waiting for their block to fill.
    #[getter]
    fn num_pending(&self) -> usize {
        self.pending.len()
    }

    /// The digest the next block chains on (as `as_bytes=True` returns it), or None.
    #[getter]
    fn parent<'py>(&self, py: Python<'py>) -> Option<Bound<'py, PyBytes>> {
        self.chain.parent.map(|d| PyBytes::new(py, d.as_bytes()))
    }

    /// The 64-bit hash of the last block (the `parent` as an event hash), or None.
    #[getter]
    fn last_hash(&self) -> Option<u64> {
        self.chain.parent.map(|d| d.event_hash())
    }

    fn __repr__(&self) -> String {
        format!(
            "BlockHasher(block_size={}, algo={:?}, num_blocks={}, num_pending={})",
            self.chain.block_size,
            self.chain.algo.name(),
            self.num_blocks,
            self.pending.len()
        )
    }
}

pub(crate) fn new_chain(
    algo_name: &str,
    block_size: i64,
    seed: Option<&Bound<'_, PyAny>>,
    lora_name: Option<&str>,
    cache_namespace: Option<&str>,
) -> PyResult<Chain> {
    let Some(algo) = Algo::parse(algo_name) else {
        let valid: Vec<&str> = ALGORITHMS.iter().map(|(n, _)| *n).collect();
        return Err(PyValueError::new_err(format!(
            "unknown algo '{algo_name}'; valid: {}",
            valid.join(", ")
        )));
    };
    if block_size < 1 {
        return Err(PyValueError::new_err(format!("block_size must be >= 1, got {block_size}")));
    }
    let seed = seed.filter(|s| !s.is_none());
    if algo.is_vllm() && (lora_name.is_some() || cache_namespace.is_some()) {
        return Err(PyValueError::new_err(format!(
            "lora_name/cache_namespace are Dynamo-style salts; {algo_name} carries LoRA and cache salt in extra_keys"
        )));
    }
    if algo.is_dynamo() && seed.is_some() {
        return Err(PyValueError::new_err(format!("{algo_name} takes no seed: Dynamo's seed is fixed at 1337")));
    }
    let mut start_seed = 0;
    let mut vllm_seed = None;
    if algo.is_vllm() {
        vllm_seed = Some(match seed {
            Some(s) if s.is_instance_of::<PyString>() || s.is_instance_of::<PyBytes>() || s.is_instance_of::<PyInt>() => {
                Value::from_py(s, algo.cbor_extras())?
            }
            Some(s) => return Err(seed_type_error(s)),
            None => {
                let env = std::env::var_os("PYTHONHASHSEED").map(|v| v.to_string_lossy().into_owned());
                let text = env.unwrap_or_else(|| VLLM_DEFAULT_SEED.to_string());
                Value::Str(text.into_bytes(), 0)
            }
        });
    } else if let Some(s) = seed {
        start_seed = if let Ok(text) = s.cast::<PyString>() {
            xxh3_64(text.to_str()?.as_bytes())
        } else if let Ok(b) = s.cast::<PyBytes>() {
            xxh3_64(b.as_bytes())
        } else if s.is_instance_of::<PyInt>() {
            s.extract::<u64>().map_err(|_| PyValueError::new_err("an int seed must be in 0..2**64-1"))?
        } else {
            return Err(seed_type_error(s));
        };
    }
    Ok(Chain::new(algo, block_size as usize, start_seed, vllm_seed.as_ref(), lora_name, cache_namespace))
}

fn seed_type_error(s: &Bound<'_, PyAny>) -> PyErr {
    let name = s.get_type().name().map_or_else(|_| "?".to_string(), |n| n.to_string());
    PyTypeError::new_err(format!("seed must be str, bytes or int, not {name}"))
}

/// Sets the chain's parent from the `parent` argument; returns its identity for pickle's memo.
fn set_parent(chain: &mut Chain, parent: Option<&Bound<'_, PyAny>>) -> PyResult<Id> {
    let Some(p) = parent.filter(|p| !p.is_none()) else { return Ok(0) };
    let algo = chain.algo;
    let name = algo.name();
    if algo == Algo::Dynamo {
        return Err(PyValueError::new_err(
            "dynamo local hashes are not chained, so take no parent; use algo='dynamo_seq'",
        ));
    }
    let digest = if let Ok(b) = p.cast_exact::<PyBytes>() {
        let want = algo.digest_len();
        if b.as_bytes().len() != want {
            return Err(PyValueError::new_err(format!(
                "parent for {name} must be its {want}-byte digest, got {} bytes",
                b.as_bytes().len()
            )));
        }
        Digest::new(b.as_bytes())
    } else if p.is_instance_of::<PyInt>() {
        if algo.is_vllm() {
            return Err(PyTypeError::new_err(format!(
                "parent for {name} must be the full digest (bytes from as_bytes=True): \
                 the 64-bit event hash cannot continue a vLLM chain"
            )));
        }
        Digest::from_u64(p.extract::<u64>().map_err(|_| PyValueError::new_err("an int parent must be in 0..2**64-1"))?)
    } else {
        let kind = p.get_type().name()?;
        return Err(PyTypeError::new_err(format!("parent must be bytes or int, not {kind}")));
    };
    chain.parent = Some(digest);
    Ok(p.as_ptr() as Id)
}

/// `extra_keys`: None, or a list/tuple with one entry (None or a tuple) per full block.
fn parse_extras(algo: Algo, extra_keys: Option<&Bound<'_, PyAny>>, n_blocks: usize) -> PyResult<Option<Vec<Option<Value>>>> {
    let Some(keys) = extra_keys.filter(|k| !k.is_none()) else { return Ok(None) };
    if !(keys.is_instance_of::<PyList>() || keys.is_instance_of::<PyTuple>()) {
        let kind = keys.get_type().name()?;
        return Err(PyTypeError::new_err(format!(
            "extra_keys must be a list with one entry per full block, not {kind}"
        )));
    }
    let len = keys.len()?;
    if len != n_blocks {
        return Err(PyValueError::new_err(format!(
            "extra_keys has {len} entries but the tokens make {n_blocks} full blocks"
        )));
    }
    let mut out = Vec::with_capacity(len);
    for (i, key) in keys.try_iter()?.enumerate() {
        let key = key?;
        if key.is_none() {
            out.push(None);
            continue;
        }
        let context = |e: PyErr| {
            let msg = format!("extra_keys[{i}]: {}", e.value(key.py()));
            if e.is_instance_of::<PyTypeError>(key.py()) { PyTypeError::new_err(msg) } else { PyValueError::new_err(msg) }
        };
        if !key.is_exact_instance_of::<PyTuple>() {
            let kind = key.get_type().name()?;
            return Err(PyTypeError::new_err(format!("extra_keys[{i}] must be None or a tuple, not {kind}")));
        }
        let v = Value::from_py(&key, algo.cbor_extras()).map_err(context)?;
        if algo.is_dynamo() {
            let Value::Tuple(items, _) = &v else { unreachable!() };
            if let Some(bad) = items.iter().position(|x| x.as_u64().is_none()) {
                return Err(PyValueError::new_err(format!(
                    "extra_keys[{i}][{bad}]: {} takes multimodal object hashes, ints in 0..2**64-1",
                    algo.name()
                )));
            }
        }
        out.push(Some(v));
    }
    Ok(Some(out))
}

/// Hashes full blocks, without the GIL when the input is long. Tokens still inside a Python
/// buffer are copied first, since other threads may write the buffer once the GIL is released.
fn run(py: Python<'_>, chain: &mut Chain, tokens: &[u32], shared: bool, extras: Option<&[Option<Value>]>, parent_id: Id) -> Recycled<Digest> {
    let mut out = Recycled::take(&DIGESTS);
    if tokens.len() < DETACH_MIN_TOKENS {
        chain.run(tokens, extras, parent_id, &mut out);
    } else if shared {
        let copy = tokens::copied(tokens);
        py.detach(|| chain.run(&copy, extras, parent_id, &mut out));
    } else {
        py.detach(|| chain.run(tokens, extras, parent_id, &mut out));
    }
    out
}

fn to_list<'py>(py: Python<'py>, digests: &[Digest], as_bytes: bool) -> PyResult<Bound<'py, PyList>> {
    if as_bytes {
        PyList::new(py, digests.iter().map(|d| PyBytes::new(py, d.as_bytes())))
    } else {
        PyList::new(py, digests.iter().map(|d| d.event_hash()))
    }
}
