//! A query's keys from Python: block hashes (ints, bytes, or a buffer read in place), token ids
//! (hashed by the walk as it goes, or here when they come with extra keys), and extra keys in
//! the canonical form payloads decode to.

use pyo3::exceptions::{PyTypeError, PyValueError};
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyInt, PyList, PyString, PyTuple};

use super::args::type_error;
use super::keys::TokenKeys;
use super::parse::reduce_bytes;
use crate::hash::buffer::Buffer;
use crate::hash::scratch::Recycled;
use crate::hash::tokens;
use crate::hash::value::Value;

const KEY_NESTING_LIMIT: usize = 64;

/// Block hashes as a router passes them: ints (-2**63..2**64-1, negatives as two's complement,
/// as a signed 64-bit engine writes them) or bytes (reduced like vLLM: the last 8 bytes), in a
/// list or any iterable; or a buffer, read without a Python object per hash: 64-bit ints
/// (array('Q'), numpy), or bytes-like (bytes, bytearray, memoryview of bytes) of packed
/// native-endian 64-bit ints.
pub(super) fn read_block_hashes<'a>(obj: &'a Bound<'_, PyAny>) -> PyResult<Keys<'a>> {
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
pub(super) enum Keys<'a> {
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
pub(super) enum Query<'k> {
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
    pub(super) fn blocks(&self, block_size: usize) -> usize {
        match self {
            Keys::Tokens { tokens, .. } => tokens.as_slice().len() / block_size,
            keys => keys.as_slice().len(),
        }
    }

    /// The walk's view of these keys (`made`: room for keys made from token ids, which
    /// `Keys::Tokens` needs).
    pub(super) fn query<'k>(
        &'k self,
        block_size: usize,
        made: Option<&'k mut Vec<u64>>,
    ) -> Query<'k> {
        match self {
            Keys::Tokens { tokens, seed } => {
                let made = made.expect("room for the keys made from token ids");
                Query::Tokens(TokenKeys::new(tokens.as_slice(), block_size, *seed, made))
            }
            keys => Query::Given(keys.as_slice()),
        }
    }

    /// Keys that may be read with the GIL released: a copy of an exported buffer's.
    pub(super) fn shared(&self) -> std::borrow::Cow<'_, [u64]> {
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
pub(super) fn keys_from_py(
    obj: &Bound<'_, PyAny>,
    n_blocks: usize,
) -> PyResult<Vec<Option<Value>>> {
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
