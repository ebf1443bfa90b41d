//! A native decode of vLLM 0.33's msgpack `KVEventBatch` into kvbridge's own msgspec Structs
//! (`kvbridge.wire.events`), for consumers that read every batch (`update.batch`).
//!
//! msgspec builds a fresh Python int for every token id (16 per block): that allocation is most
//! of its decode time on vLLM's batches. Token ids are small and repeat, so this decoder hands
//! out one shared int object per token id value (below `TOKEN_CACHE`), kept for the decoder's
//! life; an int is immutable, so a list of shared ints equals, and behaves as, a list of fresh
//! ones. Everything else is built as msgspec builds it: the same Struct classes (called with the
//! fields in declaration order, the defaults passed explicitly), lists, ints, bytes and strs.
//!
//! The contract with the Python side (`kvbridge.wire.events.decode_batch`): when this returns a
//! batch, it is equal to what msgspec decodes from the same bytes. It reads only vLLM 0.33's
//! shape, written as msgspec and vLLM write it (the tag first, known fields, no duplicates,
//! valid UTF-8, no ext types, no trailing bytes) and without the fields whose values are
//! arbitrary (`extra_keys`, `lookahead_token_ids`, `metadata`: nil only); anything else answers
//! `None`, and the caller decodes with msgspec as before -- so what a payload decodes to, and
//! which payloads are refused, is msgspec's answer either way.

use std::sync::Mutex;

use pyo3::exceptions::PyTypeError;
use pyo3::ffi;
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyString};

use crate::cpython::{fresh_list_slots, layout, Layout};
use crate::reader::{Hash, Reader};

/// Token id values with a shared int: every vocabulary in use fits (Gemma's, the largest, is
/// 262,144). Filled as values are seen, so a deployment pays for the ids its traffic holds
/// (~40 bytes each).
const TOKEN_CACHE: u64 = 1 << 18;
/// Distinct short strs kept (mediums, spec kinds, LoRA names): beyond that, a fresh str each.
const STR_CACHE: usize = 64;
const STR_CACHE_LEN: usize = 64;

const STORED_FIELDS: &[&[u8]] = &[
    b"block_hashes",
    b"parent_block_hash",
    b"token_ids",
    b"block_size",
    b"lora_id",
    b"medium",
    b"lora_name",
    b"extra_keys",
    b"group_idx",
    b"kv_cache_spec_kind",
    b"kv_cache_spec_sliding_window",
    b"locality",
    b"ownership",
    b"session_id",
    b"lookahead_token_ids",
    b"metadata",
];
/// `BlockStored`'s fields without a default.
const STORED_REQUIRED: usize = 7;
const REMOVED_FIELDS: &[&[u8]] = &[
    b"block_hashes",
    b"medium",
    b"group_idx",
    b"locality",
    b"ownership",
];
const REMOVED_REQUIRED: usize = 2;

/// `Ok(None)` from the decoder: not a shape it reads (msgspec decodes it instead).
macro_rules! or_none {
    ($e:expr) => {
        match $e {
            Some(v) => v,
            None => return Ok(None),
        }
    };
}

/// Decodes msgpack batches into the Structs it was made with (module doc). Shared by threads:
/// building objects can run a garbage collection, whose finalizers can let another thread in.
#[pyclass(module = "kvbridge._native", frozen)]
pub struct BatchDecoder {
    batch: Py<PyAny>,
    classes: Classes,
    /// Taken with try_lock: a decode that finds it taken (another thread's, mid-decode) answers
    /// None, and the caller decodes with msgspec.
    cache: Mutex<Cache>,
}

struct Classes {
    stored: Py<PyAny>,
    removed: Py<PyAny>,
    cleared: Py<PyAny>,
}

#[derive(Default)]
struct Cache {
    /// Index: token id value.
    tokens: Vec<Option<Py<PyAny>>>,
    strs: Vec<(Box<[u8]>, Py<PyString>)>,
}

#[pymethods]
impl BatchDecoder {
    /// The classes to build: kvbridge.wire.events' ``KVEventBatch``, ``BlockStored``,
    /// ``BlockRemoved`` and ``AllBlocksCleared`` (whose fields this decoder knows by position).
    #[new]
    fn new(batch: Py<PyAny>, stored: Py<PyAny>, removed: Py<PyAny>, cleared: Py<PyAny>) -> Self {
        BatchDecoder {
            batch,
            classes: Classes {
                stored,
                removed,
                cleared,
            },
            cache: Mutex::default(),
        }
    }

    /// The batch in ``payload``, or ``None`` when it is not a shape this decoder reads.
    fn decode<'py>(
        &self,
        py: Python<'py>,
        payload: &Bound<'py, PyBytes>,
    ) -> PyResult<Option<Bound<'py, PyAny>>> {
        let Ok(mut cache) = self.cache.try_lock() else {
            return Ok(None);
        };
        let cache = &mut *cache;
        let b = payload.as_bytes();
        let mut r = Reader { b, p: 0 };
        let (len, ts) = or_none!(r.batch_head());
        let n = or_none!(r.bounded_array_len());
        let events = new_list(py, n)?;
        for i in 0..n {
            let ev = or_none!(cache.event(py, &self.classes, &mut r)?);
            // SAFETY: `events` is a fresh list of `n` slots, `i < n`, and `ev` a new reference
            // that PyList_SetItem takes over.
            unsafe { ffi::PyList_SetItem(events.as_ptr(), i as isize, ev.into_ptr()) };
        }
        let rank = or_none!(r.batch_tail(len));
        let rank = match rank {
            Some(h) => or_none!(int_obj(py, h)?),
            None => py.None().into_bound(py),
        };
        let ts = ts.into_pyobject(py)?;
        Ok(Some(call(
            py,
            &self.batch,
            &[ts.as_ptr(), events.as_ptr(), rank.as_ptr()],
        )?))
    }
}

impl Cache {
    /// One event, or `None` when it is not one this decoder reads.
    fn event<'py>(
        &mut self,
        py: Python<'py>,
        classes: &Classes,
        r: &mut Reader<'_>,
    ) -> PyResult<Option<Bound<'py, PyAny>>> {
        let n = or_none!(r.map_len());
        if n == 0 || or_none!(r.raw_str()) != b"type" {
            return Ok(None);
        }
        let (cls, fields, required) = match or_none!(r.raw_str()) {
            b"BlockStored" => (&classes.stored, STORED_FIELDS, STORED_REQUIRED),
            b"BlockRemoved" => (&classes.removed, REMOVED_FIELDS, REMOVED_REQUIRED),
            b"AllBlocksCleared" if n == 1 => return Ok(Some(classes.cleared.bind(py).call0()?)),
            _ => return Ok(None),
        };
        let stored = fields.len() == STORED_FIELDS.len();
        let mut values: [Option<Bound<'py, PyAny>>; STORED_FIELDS.len()] = Default::default();
        let mut next = 0;
        for _ in 1..n {
            let key = or_none!(r.raw_str());
            // Writers emit fields in declaration order: try the next one before searching.
            let i = if fields.get(next).is_some_and(|f| *f == key) {
                next
            } else {
                or_none!(fields.iter().position(|f| *f == key))
            };
            next = i + 1;
            if values[i].is_some() {
                return Ok(None);
            }
            let v = match (stored, i) {
                (_, 0) => self.hashes(py, r)?,
                (true, 1) => self.opt(py, r, |_, py, r| hash_obj(py, r))?,
                (true, 2) => self.token_ids(py, r)?,
                (true, 3) => match r.int() {
                    Some(h) => int_obj(py, h)?,
                    None => None,
                },
                (true, 7 | 14 | 15) => r.nil().then(|| py.None().into_bound(py)),
                (true, 4 | 8 | 10) | (false, 2) => self.opt(py, r, |_, py, r| match r.int() {
                    Some(h) => int_obj(py, h),
                    None => Ok(None),
                })?,
                _ => self.opt(py, r, |d, py, r| d.str(py, r))?,
            };
            values[i] = Some(or_none!(v));
        }
        if values[..required].iter().any(Option::is_none) {
            return Ok(None);
        }
        let none = py.None();
        let args: [*mut ffi::PyObject; STORED_FIELDS.len()] =
            std::array::from_fn(|i| values[i].as_ref().map_or(none.as_ptr(), |v| v.as_ptr()));
        Ok(Some(call(py, cls, &args[..fields.len()])?))
    }

    /// nil as None, else `read`'s value.
    fn opt<'py>(
        &mut self,
        py: Python<'py>,
        r: &mut Reader<'_>,
        read: impl FnOnce(
            &mut Self,
            Python<'py>,
            &mut Reader<'_>,
        ) -> PyResult<Option<Bound<'py, PyAny>>>,
    ) -> PyResult<Option<Bound<'py, PyAny>>> {
        if r.nil() {
            return Ok(Some(py.None().into_bound(py)));
        }
        read(self, py, r)
    }

    fn hashes<'py>(
        &mut self,
        py: Python<'py>,
        r: &mut Reader<'_>,
    ) -> PyResult<Option<Bound<'py, PyAny>>> {
        let n = or_none!(r.bounded_array_len());
        let list = new_list(py, n)?;
        for i in 0..n {
            let h = or_none!(hash_obj(py, r)?);
            // SAFETY: a fresh list of `n` slots, `i < n`; `h` is a new reference, taken over.
            unsafe { ffi::PyList_SetItem(list.as_ptr(), i as isize, h.into_ptr()) };
        }
        Ok(Some(list))
    }

    /// A list of ints, each below `TOKEN_CACHE` the decoder's shared int for its value.
    fn token_ids<'py>(
        &mut self,
        py: Python<'py>,
        r: &mut Reader<'_>,
    ) -> PyResult<Option<Bound<'py, PyAny>>> {
        let n = or_none!(r.bounded_array_len());
        let list = new_list(py, n)?;
        // The inline reference counts below read a 32-bit half as the low one.
        let layout = if cfg!(target_endian = "little") {
            layout(py)
        } else {
            Layout::Api
        };
        // SAFETY: `list` is a fresh list; no Python code runs while `items` is in use (creating
        // an int runs none).
        let mut items = unsafe { fresh_list_slots(layout, list.as_ptr()) };
        for i in 0..n {
            // The common case inline: a cached value (one load, one count, one store).
            if let Some(v) = token(r.b, &mut r.p) {
                if let Some(Some(o)) = self.tokens.get(v as usize) {
                    let p = o.as_ptr();
                    // SAFETY: `p` is a live int the cache holds a reference to; the GIL is held.
                    unsafe { incref(layout, p) };
                    set_item(&list, items.as_deref_mut(), i, p);
                    continue;
                }
                let obj = self.token_obj(py, v)?;
                set_item(&list, items.as_deref_mut(), i, obj);
                continue;
            }
            // Wider, negative or not an int: the general path (None ends the decode).
            let obj = or_none!(int_obj(py, or_none!(r.int()))?);
            set_item(&list, items.as_deref_mut(), i, obj.into_ptr());
        }
        Ok(Some(list))
    }

    /// A new reference to an int of value `v`, cached when below `TOKEN_CACHE` (a value the
    /// cache has not seen yet).
    #[inline(never)]
    fn token_obj(&mut self, py: Python<'_>, v: u64) -> PyResult<*mut ffi::PyObject> {
        let o = v.into_pyobject(py)?.into_any();
        if v < TOKEN_CACHE {
            let v = v as usize;
            if v >= self.tokens.len() {
                self.tokens.resize_with(v + 1, || None);
            }
            self.tokens[v] = Some(o.clone().unbind());
        }
        Ok(o.into_ptr())
    }

    /// A str (UTF-8 checked, as msgspec does), short ones shared.
    fn str<'py>(
        &mut self,
        py: Python<'py>,
        r: &mut Reader<'_>,
    ) -> PyResult<Option<Bound<'py, PyAny>>> {
        let s = or_none!(r.str());
        if let Some((_, o)) = self.strs.iter().find(|(k, _)| **k == *s) {
            return Ok(Some(o.clone_ref(py).into_bound(py).into_any()));
        }
        // Reader::str checked the bytes.
        let text = or_none!(std::str::from_utf8(s).ok());
        let o = PyString::new(py, text);
        if self.strs.len() < STR_CACHE && s.len() <= STR_CACHE_LEN {
            self.strs.push((s.into(), o.clone().unbind()));
        }
        Ok(Some(o.into_any()))
    }
}

/// An unsigned msgpack int at `*p` (what token ids are), advancing past it; None, not moving,
/// for any other marker (or too few bytes), which the caller reads the general way.
#[inline(always)]
fn token(b: &[u8], p: &mut usize) -> Option<u64> {
    let at = *p;
    let (v, width) = match *b.get(at)? {
        m @ 0x00..=0x7f => (m as u64, 1),
        0xcc => (*b.get(at + 1)? as u64, 2),
        0xcd => (
            u16::from_be_bytes(b.get(at + 1..at + 3)?.try_into().ok()?) as u64,
            3,
        ),
        0xce => (
            u32::from_be_bytes(b.get(at + 1..at + 5)?.try_into().ok()?) as u64,
            5,
        ),
        _ => return None,
    };
    *p = at + width;
    Some(v)
}

/// Sets slot `i` of a fresh list (`items` from `cpython::fresh_list_slots`) to `obj`, a new reference taken over.
#[inline(always)]
pub(crate) fn set_item(
    list: &Bound<'_, PyAny>,
    items: Option<&mut [*mut ffi::PyObject]>,
    i: usize,
    obj: *mut ffi::PyObject,
) {
    match items {
        Some(items) => items[i] = obj,
        // SAFETY: a fresh list with more than `i` slots; PyList_SetItem takes `obj` over.
        None => unsafe {
            ffi::PyList_SetItem(list.as_ptr(), i as isize, obj);
        },
    }
}

/// Py_INCREF, inline on the layouts `crate::cpython` has proven: 3.11's plain count; 3.12+'s
/// 32-bit count whose negative values mark immortal objects (small ints), left alone.
///
/// # Safety
/// `obj` is a live object and the GIL is held.
#[inline(always)]
pub(crate) unsafe fn incref(layout: Layout, obj: *mut ffi::PyObject) {
    match layout {
        // SAFETY: ob_refcnt is the object's first word.
        Layout::SignedSize => unsafe { *(obj as *mut isize) += 1 },
        Layout::TaggedValue => {
            // SAFETY: the low half of ob_refcnt (little-endian: the first 4 bytes), as
            // 3.12-3.14's Py_INCREF updates it.
            unsafe {
                let low = obj as *mut u32;
                if (*low as i32) >= 0 {
                    *low += 1;
                }
            }
        }
        // SAFETY: the caller's guarantees.
        Layout::Api => unsafe { ffi::Py_IncRef(obj) },
    }
}

extern "C" {
    // Exported by every CPython this module loads into (3.11's beside its inline form, the
    // limited API's from 3.12), though pyo3 declares it for abi3 builds from 3.12 only.
    fn PyObject_Vectorcall(
        callable: *mut ffi::PyObject,
        args: *const *mut ffi::PyObject,
        nargsf: usize,
        kwnames: *mut ffi::PyObject,
    ) -> *mut ffi::PyObject;
}

/// `cls(*args)` without an argument tuple (msgspec's Structs take vectorcalls): one per event.
fn call<'py>(
    py: Python<'py>,
    cls: &Py<PyAny>,
    args: &[*mut ffi::PyObject],
) -> PyResult<Bound<'py, PyAny>> {
    // SAFETY: `cls` and every item of `args` are live objects (borrowed for the call), the GIL
    // is held; the result is a new reference or NULL with an exception set.
    unsafe {
        Bound::from_owned_ptr_or_err(
            py,
            PyObject_Vectorcall(
                cls.as_ptr(),
                args.as_ptr(),
                args.len(),
                std::ptr::null_mut(),
            ),
        )
    }
}

/// A list of `n` empty slots, each to be set once (a list dropped before then holds NULLs,
/// which its deallocation skips).
pub(crate) fn new_list(py: Python<'_>, n: usize) -> PyResult<Bound<'_, PyAny>> {
    let n = isize::try_from(n).map_err(|_| PyTypeError::new_err("list too long"))?;
    // SAFETY: PyList_New returns a new reference or NULL with an exception set; the GIL is held.
    unsafe { Bound::from_owned_ptr_or_err(py, ffi::PyList_New(n)) }
}

fn int_obj(py: Python<'_>, h: Hash) -> PyResult<Option<Bound<'_, PyAny>>> {
    Ok(Some(match h {
        Hash::U(v) => v.into_pyobject(py)?.into_any(),
        Hash::I(v) => v.into_pyobject(py)?.into_any(),
        Hash::B(..) => return Ok(None),
    }))
}

/// `int | bytes`, as `ExternalBlockHash` decodes.
fn hash_obj<'py>(py: Python<'py>, r: &mut Reader<'_>) -> PyResult<Option<Bound<'py, PyAny>>> {
    Ok(Some(match or_none!(r.hash()) {
        Hash::B(s, e) => PyBytes::new(py, &r.b[s..e]).into_any(),
        h => return int_obj(py, h),
    }))
}

pub fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<BatchDecoder>()
}
