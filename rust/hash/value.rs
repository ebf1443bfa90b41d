//! Extra keys (and vLLM seeds) copied out of Python into plain Rust data.
//!
//! The copy is taken under the GIL once per call, so every serialiser below runs on Rust data and
//! the chain can be hashed with the GIL released. Strings, bytes and tuples keep the address of
//! the Python object they came from: pickle memoizes by object identity, and the same object seen
//! twice in one pickle becomes a BINGET, so identity is part of the serialised form.

use pyo3::exceptions::{PyTypeError, PyValueError};
use pyo3::prelude::*;
use pyo3::types::{IntoPyDict, PyBool, PyBytes, PyInt, PyString, PyTuple};

/// An object identity as pickle's memo sees it. 0 is never a live object's address, so it marks
/// values that must never be memo hits (our own parent digests and token tuples).
pub type Id = usize;

#[derive(Clone, Debug)]
pub enum Value {
    None,
    Bool(bool),
    Int(i64),
    /// Beyond i64: the minimal little-endian two's-complement bytes, exactly as pickle's
    /// `encode_long` writes them (LONG1/LONG4 payload).
    BigInt(Vec<u8>),
    Str(Vec<u8>, Id),
    Bytes(Vec<u8>, Id),
    Tuple(Vec<Value>, Id),
}

const NESTING_LIMIT: usize = 200;

impl Value {
    /// `cbor` rejects strings with lone surrogates up front, as cbor2 would: pickle writes them
    /// with "surrogatepass", CBOR text must be valid UTF-8.
    pub fn from_py(obj: &Bound<'_, PyAny>, cbor: bool) -> PyResult<Value> {
        Self::convert(obj, cbor, 0)
    }

    fn convert(obj: &Bound<'_, PyAny>, cbor: bool, depth: usize) -> PyResult<Value> {
        if depth > NESTING_LIMIT {
            return Err(PyValueError::new_err("extra key nested too deeply"));
        }
        let id = obj.as_ptr() as Id;
        if obj.is_none() {
            Ok(Value::None)
        } else if let Ok(b) = obj.cast_exact::<PyBool>() {
            Ok(Value::Bool(b.is_true()))
        } else if obj.is_exact_instance_of::<PyInt>() {
            match obj.extract::<i64>() {
                Ok(v) => Ok(Value::Int(v)),
                Err(_) => Ok(Value::BigInt(big_int_bytes(obj)?)),
            }
        } else if let Ok(s) = obj.cast_exact::<PyString>() {
            Ok(Value::Str(utf8(s, cbor)?, id))
        } else if let Ok(b) = obj.cast_exact::<PyBytes>() {
            Ok(Value::Bytes(b.as_bytes().to_vec(), id))
        } else if let Ok(t) = obj.cast_exact::<PyTuple>() {
            let items = t
                .iter()
                .map(|item| Self::convert(&item, cbor, depth + 1))
                .collect::<PyResult<Vec<_>>>()?;
            Ok(Value::Tuple(items, id))
        } else {
            Err(PyTypeError::new_err(format!(
                "unsupported type {} (expected None, bool, int, str, bytes or a tuple of these)",
                obj.get_type().name()?
            )))
        }
    }

    /// The value as an unsigned 64-bit integer, if it is one.
    pub fn as_u64(&self) -> Option<u64> {
        match self {
            Value::Int(v) => u64::try_from(*v).ok(),
            // 2**63..2**64-1 arrive as nine bytes ending in a zero sign byte.
            Value::BigInt(b) if b.len() == 9 && b[8] == 0 => {
                Some(u64::from_le_bytes(b[..8].try_into().unwrap()))
            }
            _ => None,
        }
    }
}

fn utf8(s: &Bound<'_, PyString>, cbor: bool) -> PyResult<Vec<u8>> {
    match s.to_str() {
        Ok(text) => Ok(text.as_bytes().to_vec()),
        Err(_) if cbor => Err(PyValueError::new_err(
            "a str with lone surrogates cannot be encoded as CBOR text",
        )),
        Err(_) => {
            let raw = s.call_method1("encode", ("utf-8", "surrogatepass"))?;
            Ok(raw.cast_into::<PyBytes>()?.as_bytes().to_vec())
        }
    }
}

/// pickle's `encode_long`: (bit_length >> 3) + 1 bytes of two's complement, minus one redundant
/// sign byte for some negatives.
pub fn long_bytes(v: i128) -> Vec<u8> {
    if v == 0 {
        return Vec::new();
    }
    let bits = 128 - v.unsigned_abs().leading_zeros() as usize;
    trim_negative(v.to_le_bytes()[..(bits >> 3) + 1].to_vec(), v < 0)
}

fn trim_negative(mut b: Vec<u8>, negative: bool) -> Vec<u8> {
    let n = b.len();
    if negative && n > 1 && b[n - 1] == 0xff && b[n - 2] & 0x80 != 0 {
        b.pop();
    }
    b
}

fn big_int_bytes(obj: &Bound<'_, PyAny>) -> PyResult<Vec<u8>> {
    let bits: usize = obj.call_method0("bit_length")?.extract()?;
    let negative = obj.lt(0)?;
    let kwargs = [("signed", true)].into_py_dict(obj.py())?;
    let raw = obj.call_method("to_bytes", ((bits >> 3) + 1, "little"), Some(&kwargs))?;
    Ok(trim_negative(
        raw.cast_into::<PyBytes>()?.as_bytes().to_vec(),
        negative,
    ))
}
