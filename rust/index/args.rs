//! What a Python caller passes the index besides a query's keys: payloads (bytes, buffers, a
//! decoded `KVEventBatch`), `format=`, optional strs, and the index service's msgpack query
//! fields (`unpack_query_ints`); the `TypeError`s they raise.

use pyo3::exceptions::{PyTypeError, PyValueError};
use pyo3::prelude::*;
use pyo3::sync::PyOnceLock;
use pyo3::types::{PyByteArray, PyBytes, PyMemoryView, PyString};

use super::parse::Format;
use crate::hash::buffer::Buffer;
use crate::reader::{Hash, Reader};

/// A query field's msgpack array of ints, as the index service receives it (a `msgspec.Raw`),
/// as a memoryview of packed native ints ('I' for `tokens`, 'Q' otherwise), which
/// `Index.find_matches` reads without a Python int per item; None for an absent field or nil.
/// ValueError in msgspec's words (the service's error replies read the same either way).
#[pyfunction]
pub(super) fn unpack_query_ints<'py>(
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

/// `format=`: "msgpack", "json" or None (detected per payload).
pub(super) fn format_arg(format: Option<&Bound<'_, PyAny>>) -> PyResult<Option<Format>> {
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
pub(super) fn payload_bytes<'py>(
    py: Python<'py>,
    data: &Bound<'py, PyAny>,
) -> PyResult<Bound<'py, PyBytes>> {
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

pub(super) fn type_error(arg: &str, want: &str, got: &Bound<'_, PyAny>) -> PyErr {
    let kind = got
        .get_type()
        .name()
        .map_or_else(|_| "?".to_string(), |n| n.to_string());
    PyTypeError::new_err(format!("{arg} must be {want}, not {kind}"))
}

pub(super) fn opt_str<'a>(arg: &str, v: Option<&'a Bound<'_, PyAny>>) -> PyResult<Option<&'a str>> {
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
