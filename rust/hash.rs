//! The Python face of chained block hashing: `hash_blocks` and `BlockHasher`.
//! Arguments are checked in `args`, algorithms live in `algo`, results go out through `output`.

pub(crate) mod algo;
pub(crate) mod args;
pub(crate) mod buffer;
mod cbor;
mod output;
mod pickle;
pub(crate) mod scratch;
mod sha256;
mod tokenbytes;
pub(crate) mod tokens;
pub(crate) mod value;

#[cfg(test)]
pub(crate) mod testing {
    /// Bytes from a hex string: expected serialisations captured from the reference libraries.
    pub fn hex(s: &str) -> Vec<u8> {
        (0..s.len())
            .step_by(2)
            .map(|i| u8::from_str_radix(&s[i..i + 2], 16).unwrap())
            .collect()
    }
}

use std::cell::Cell;

use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyList, PyTuple};

use algo::{Chain, Digest, ALGORITHMS};
use args::{new_chain, parse_extras, set_parent};
use output::Output;
use scratch::Recycled;
use value::{Id, Value};

/// Below this many tokens a call is over before releasing the GIL would pay off.
const DETACH_MIN_TOKENS: usize = 1 << 16;

thread_local! {
    static DIGESTS: Cell<Vec<Digest>> = const { Cell::new(Vec::new()) };
}

pub fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_function(wrap_pyfunction!(hash_blocks, m)?)?;
    m.add_class::<BlockHasher>()?;
    m.add(
        "ALGORITHMS",
        PyTuple::new(m.py(), ALGORITHMS.iter().map(|(name, _)| *name))?,
    )?;
    Ok(())
}

/// One chained hash per full block of `tokens`; see kvbridge.wire.hashing for the algorithms.
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
    let n_blocks = tokens.as_slice().len() / chain.block_size;
    let extras = parse_extras(chain.algo, extra_keys, n_blocks)?;
    let mut output = Output::new(py, n_blocks, as_bytes, out)?;
    let full = &tokens.as_slice()[..n_blocks * chain.block_size];
    output.push(&run(
        py,
        &mut chain,
        full,
        tokens.is_shared(),
        extras.as_deref(),
        parent_id,
    ))?;
    output.finish(py)
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
        Ok(BlockHasher {
            chain,
            pending: Vec::new(),
            num_blocks: 0,
        })
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
    ) -> PyResult<Bound<'py, PyAny>> {
        let tokens = tokens::read(tokens)?;
        let bs = self.chain.block_size;
        let n_blocks = (self.pending.len() + tokens.as_slice().len()) / bs;
        let extras = parse_extras(self.chain.algo, extra_keys, n_blocks)?;
        if n_blocks == 0 {
            // Most decode steps only add to the partial block.
            self.pending.extend_from_slice(tokens.as_slice());
            return Ok(PyList::empty(py).into_any());
        }
        let digests = if self.pending.is_empty() {
            let new = tokens.as_slice();
            let full = n_blocks * bs;
            let digests = run(
                py,
                &mut self.chain,
                &new[..full],
                tokens.is_shared(),
                extras.as_deref(),
                0,
            );
            self.pending.extend_from_slice(&new[full..]);
            digests
        } else {
            self.pending.extend_from_slice(tokens.as_slice());
            let full = n_blocks * bs;
            let digests = run(
                py,
                &mut self.chain,
                &self.pending[..full],
                false,
                extras.as_deref(),
                0,
            );
            self.pending.drain(..full);
            digests
        };
        self.num_blocks += digests.len();
        let mut output = Output::new(py, digests.len(), as_bytes, None)?;
        output.push(&digests)?;
        output.finish(py)
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
            "BlockHasher(block_size={}, algo='{}', num_blocks={}, num_pending={})",
            self.chain.block_size,
            self.chain.algo.name(),
            self.num_blocks,
            self.pending.len()
        )
    }
}

/// Hashes full blocks, without the GIL when the input is long. Tokens still inside a Python
/// buffer are copied first, since other threads may write the buffer once the GIL is released.
fn run(
    py: Python<'_>,
    chain: &mut Chain,
    tokens: &[u32],
    shared: bool,
    extras: Option<&[Option<Value>]>,
    parent_id: Id,
) -> Recycled<Digest> {
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
