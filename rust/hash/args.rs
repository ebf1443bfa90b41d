//! Checking and converting hash_blocks/BlockHasher arguments into a ready chain.

use pyo3::exceptions::{PyTypeError, PyValueError};
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyInt, PyList, PyString, PyTuple};
use xxhash_rust::xxh3::xxh3_64;

use super::algo::{Algo, Chain, Digest, ALGORITHMS};
use super::value::{Id, Value};

/// vLLM's DEFAULT_NONE_HASH_SEED, used when neither `seed` nor PYTHONHASHSEED is given.
const VLLM_DEFAULT_SEED: &str = "vllm-none-hash";

pub fn new_chain(
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
        return Err(PyValueError::new_err(format!(
            "block_size must be >= 1, got {block_size}"
        )));
    }
    if algo.is_vllm() && (lora_name.is_some() || cache_namespace.is_some()) {
        return Err(PyValueError::new_err(format!(
            "lora_name/cache_namespace are Dynamo-style salts; {algo_name} carries LoRA and cache salt in extra_keys"
        )));
    }
    let seed = seed.filter(|s| !s.is_none());
    if algo.is_dynamo() && seed.is_some() {
        return Err(PyValueError::new_err(format!(
            "{algo_name} takes no seed: Dynamo's seed is fixed at 1337"
        )));
    }
    let (start_seed, none_hash_seed) = if algo.is_vllm() {
        (0, Some(vllm_seed(seed, algo)?))
    } else {
        (seed.map(xxh3_seed).transpose()?.unwrap_or(0), None)
    };
    let bs = block_size as usize;
    Ok(Chain::new(
        algo,
        bs,
        start_seed,
        none_hash_seed,
        lora_name,
        cache_namespace,
    ))
}

/// What vLLM hashes into NONE_HASH: the seed, else $PYTHONHASHSEED, else "vllm-none-hash".
fn vllm_seed(seed: Option<&Bound<'_, PyAny>>, algo: Algo) -> PyResult<Value> {
    match seed {
        Some(s)
            if s.is_instance_of::<PyString>()
                || s.is_instance_of::<PyBytes>()
                || s.is_instance_of::<PyInt>() =>
        {
            Value::from_py(s, algo.cbor_extras())
        }
        Some(s) => Err(seed_type_error(s)),
        None => {
            let env = std::env::var_os("PYTHONHASHSEED").map(|v| v.to_string_lossy().into_owned());
            Ok(Value::Str(
                env.unwrap_or_else(|| VLLM_DEFAULT_SEED.to_string())
                    .into_bytes(),
                0,
            ))
        }
    }
}

/// xxh3's start seed: a u64, or the XXH3_64 of a str/bytes seed.
fn xxh3_seed(s: &Bound<'_, PyAny>) -> PyResult<u64> {
    if let Ok(text) = s.cast::<PyString>() {
        Ok(xxh3_64(text.to_str()?.as_bytes()))
    } else if let Ok(b) = s.cast::<PyBytes>() {
        Ok(xxh3_64(b.as_bytes()))
    } else if s.is_instance_of::<PyInt>() {
        s.extract::<u64>()
            .map_err(|_| PyValueError::new_err("an int seed must be in 0..2**64-1"))
    } else {
        Err(seed_type_error(s))
    }
}

fn seed_type_error(s: &Bound<'_, PyAny>) -> PyErr {
    let name = s
        .get_type()
        .name()
        .map_or_else(|_| "?".to_string(), |n| n.to_string());
    PyTypeError::new_err(format!("seed must be str, bytes or int, not {name}"))
}

/// Sets the chain's parent from the `parent` argument; returns its identity for pickle's memo.
pub fn set_parent(chain: &mut Chain, parent: Option<&Bound<'_, PyAny>>) -> PyResult<Id> {
    let Some(p) = parent.filter(|p| !p.is_none()) else {
        return Ok(0);
    };
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
        Digest::from_u64(
            p.extract::<u64>()
                .map_err(|_| PyValueError::new_err("an int parent must be in 0..2**64-1"))?,
        )
    } else {
        let kind = p.get_type().name()?;
        return Err(PyTypeError::new_err(format!(
            "parent must be bytes or int, not {kind}"
        )));
    };
    chain.parent = Some(digest);
    Ok(p.as_ptr() as Id)
}

/// `extra_keys`: None, or a list/tuple with one entry (None or a tuple) per full block.
pub fn parse_extras(
    algo: Algo,
    extra_keys: Option<&Bound<'_, PyAny>>,
    n_blocks: usize,
) -> PyResult<Option<Vec<Option<Value>>>> {
    let Some(keys) = extra_keys.filter(|k| !k.is_none()) else {
        return Ok(None);
    };
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
            if e.is_instance_of::<PyTypeError>(key.py()) {
                PyTypeError::new_err(msg)
            } else {
                PyValueError::new_err(msg)
            }
        };
        if !key.is_exact_instance_of::<PyTuple>() {
            let kind = key.get_type().name()?;
            return Err(PyTypeError::new_err(format!(
                "extra_keys[{i}] must be None or a tuple, not {kind}"
            )));
        }
        let v = Value::from_py(&key, algo.cbor_extras()).map_err(context)?;
        if algo.is_dynamo() {
            let Value::Tuple(items, _) = &v else {
                unreachable!()
            };
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
