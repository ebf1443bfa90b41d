//! Token ids from Python: list/tuple of int (no per-element Python calls; a list's ints are read
//! from CPython's own layout where `crate::cpython` vouches for it, else through the C API),
//! any 1-D buffer of 32- or 64-bit ints (array.array, numpy, memoryview; no numpy import),
//! or any other iterable of ints. Every id must be in 0..2**32-1.

use std::cell::Cell;
use std::ptr::addr_of_mut;

use pyo3::exceptions::{PyTypeError, PyValueError};
use pyo3::ffi;
use pyo3::prelude::*;

use crate::cpython::{self, Layout};

use super::buffer::Buffer;
use super::scratch::Recycled;

thread_local! {
    static POOL: Cell<Vec<u32>> = const { Cell::new(Vec::new()) };
}

/// Token ids, either copied out or viewed in place in a Python buffer.
pub enum Tokens {
    Owned(Recycled<u32>),
    /// A native-endian, aligned, contiguous u32-compatible buffer; the export stays held (and
    /// the memory valid) until this is dropped, which needs the GIL, hence !Send.
    Shared(Buffer),
}

impl Tokens {
    pub fn as_slice(&self) -> &[u32] {
        match self {
            Tokens::Owned(v) => v.as_slice(),
            Tokens::Shared(b) => {
                // SAFETY: `read` only builds Shared for aligned, contiguous 4-byte items.
                unsafe { std::slice::from_raw_parts(b.ptr() as *const u32, b.len()) }
            }
        }
    }

    /// Whether the slice lives in memory other Python threads may write while we hash.
    pub fn is_shared(&self) -> bool {
        matches!(self, Tokens::Shared(_))
    }
}

/// A private copy of tokens, from this thread's pool.
pub fn copied(tokens: &[u32]) -> Recycled<u32> {
    let mut out = Recycled::take(&POOL);
    out.extend_from_slice(tokens);
    out
}

pub fn read(obj: &Bound<'_, PyAny>) -> PyResult<Tokens> {
    let ptr = obj.as_ptr();
    // SAFETY: ptr is a live object.
    unsafe {
        if ffi::PyList_Check(ptr) != 0 || ffi::PyTuple_Check(ptr) != 0 {
            return convert_items(obj).map(Tokens::Owned);
        }
        if ffi::PyUnicode_Check(ptr) != 0 {
            return Err(PyTypeError::new_err(
                "tokens must be a sequence of int, not str",
            ));
        }
        if ffi::PyObject_CheckBuffer(ptr) != 0 {
            return from_buffer(obj);
        }
    }
    let iter = obj.try_iter().map_err(|_| {
        PyTypeError::new_err(format!(
            "tokens must be a list/tuple of int, an int buffer (array.array, numpy) or an iterable of int, not {}",
            obj.get_type().name().map(|n| n.to_string()).unwrap_or_else(|_| "?".into())
        ))
    })?;
    let mut out = Recycled::take(&POOL);
    for (i, item) in iter.enumerate() {
        let item = item?;
        // SAFETY: item is an owned, live reference.
        out.push(unsafe { token(obj.py(), item.as_ptr(), i) }?);
    }
    Ok(Tokens::Owned(out))
}

/// Converts a list or tuple. Lists of exact ints are read straight from CPython's layout where
/// encode's self-tested reader vouches for it; everything else fetches item by item through the
/// API, by index, because a non-int's __index__ may mutate the list under us.
fn convert_items(seq: &Bound<'_, PyAny>) -> PyResult<Recycled<u32>> {
    let (py, ptr) = (seq.py(), seq.as_ptr());
    let mut out = Recycled::take(&POOL);
    // SAFETY: ptr is a live list or tuple. Item pointers (from the item array or GetItem, which
    // bounds-checks) are only used until the next call that can run Python code.
    unsafe {
        let is_list = ffi::PyList_Check(ptr) != 0;
        let n = if is_list {
            ffi::PyList_Size(ptr)
        } else {
            ffi::PyTuple_Size(ptr)
        } as usize;
        out.reserve(n);
        let layout = if is_list {
            cpython::layout(py)
        } else {
            Layout::Api
        };
        if let Some(items) = cpython::list_items(layout, ptr) {
            cpython::read_u32_prefix(layout, items, &mut out);
        }
        for i in out.len()..n {
            let p = if is_list {
                ffi::PyList_GetItem(ptr, i as isize)
            } else {
                ffi::PyTuple_GetItem(ptr, i as isize)
            };
            if p.is_null() {
                // The list shrank under a user __index__.
                return Err(PyErr::fetch(py));
            }
            out.push(token(py, p, i)?);
        }
    }
    Ok(out)
}

/// One token from a Python object; exact ints take the fast path.
///
/// # Safety
/// `item` is a live object. It may be borrowed (from a list): before running any Python code
/// (its `__index__`, which may mutate that list), this takes a reference of its own.
#[inline(always)]
unsafe fn token(py: Python<'_>, item: *mut ffi::PyObject, index: usize) -> PyResult<u32> {
    // SAFETY: `item` is live; converting an exact int runs no Python code.
    if unsafe { ffi::Py_TYPE(item) } == addr_of_mut!(ffi::PyLong_Type) {
        let mut overflow = 0;
        // SAFETY: as above.
        let v = unsafe { ffi::PyLong_AsLongLongAndOverflow(item, &mut overflow) };
        if overflow == 0 && (0..=u32::MAX as i64).contains(&v) {
            return Ok(v as u32);
        }
        // SAFETY: as above.
        return Err(unsafe { out_of_range(py, item, index) });
    }
    // SAFETY: this function's contract is the callee's.
    unsafe { slow_token(py, item, index) }
}

/// A token that is not an exact int: through `__index__`, bools refused.
///
/// # Safety
/// As for `token`.
#[cold]
unsafe fn slow_token(py: Python<'_>, item: *mut ffi::PyObject, index: usize) -> PyResult<u32> {
    // SAFETY: `item` is live; from here on `obj` keeps it so through any Python code below.
    let obj = unsafe { Bound::from_borrowed_ptr(py, item) };
    // bool is an int subclass, but a True token id is a bug, not token 1.
    // SAFETY: `item` is live (held by `obj`); PyNumber_Index returns a new reference or NULL.
    let index_value = unsafe {
        if ffi::PyBool_Check(item) != 0 {
            std::ptr::null_mut()
        } else {
            ffi::PyNumber_Index(item)
        }
    };
    // SAFETY: a new reference or NULL, as PyNumber_Index returns.
    let Some(value) = (unsafe { Bound::from_owned_ptr_or_opt(py, index_value) }) else {
        PyErr::take(py);
        return Err(PyTypeError::new_err(format!(
            "token at index {index} is {}, not int",
            obj.get_type().name()?
        )));
    };
    let mut overflow = 0;
    // SAFETY: `value` is a live int (PyNumber_Index returns only ints).
    let v = unsafe { ffi::PyLong_AsLongLongAndOverflow(value.as_ptr(), &mut overflow) };
    if overflow != 0 || !(0..=u32::MAX as i64).contains(&v) {
        // SAFETY: `value` is live.
        return Err(unsafe { out_of_range(py, value.as_ptr(), index) });
    }
    Ok(v as u32)
}

/// The error for a token out of range, showing it.
///
/// # Safety
/// `item` is a live object.
#[cold]
unsafe fn out_of_range(py: Python<'_>, item: *mut ffi::PyObject, index: usize) -> PyErr {
    // SAFETY: `item` is live; the Bound holds it through `str()`.
    let shown = unsafe { Bound::from_borrowed_ptr(py, item) }
        .str()
        .map_or_else(|_| "?".to_string(), |s| s.to_string());
    range_error(index, &shown)
}

fn range_error(index: usize, value: &dyn std::fmt::Display) -> PyErr {
    PyValueError::new_err(format!(
        "token at index {index} is {value}, outside 0..4294967295"
    ))
}

fn from_buffer(obj: &Bound<'_, PyAny>) -> PyResult<Tokens> {
    let buffer = Buffer::get(obj, ffi::PyBUF_RECORDS_RO)?;
    let Some(layout) = buffer.int_layout() else {
        return Err(PyTypeError::new_err(format!(
            "token buffer format '{}' (itemsize {}) unsupported: need 32- or 64-bit ints (i, I, l, L, q, Q)",
            buffer.format(),
            buffer.itemsize()
        )));
    };
    let (n, stride, base) = (buffer.len(), buffer.stride(), buffer.ptr() as *const u8);
    if n == 0 {
        // An empty export may come with a null data pointer, which no slice may hold.
        return Ok(Tokens::Owned(Recycled::take(&POOL)));
    }
    let contiguous = stride == layout.size as isize && (base as usize).is_multiple_of(layout.size);
    if contiguous && layout.size == 4 && !layout.swap {
        // SAFETY: aligned, contiguous, n items of 4 bytes.
        let items = unsafe { std::slice::from_raw_parts(base as *const i32, n) };
        if let Some(i) = layout
            .signed
            .then(|| items.iter().position(|&x| x < 0))
            .flatten()
        {
            return Err(range_error(i, &items[i]));
        }
        return Ok(Tokens::Shared(buffer));
    }
    // SAFETY: n items at `stride` bytes apart, each `layout.size` bytes, inside the export.
    let out = unsafe {
        match (layout.size, layout.signed) {
            (4, false) => convert::<u32>(base, n, stride, layout.swap, contiguous),
            (4, true) => convert::<i32>(base, n, stride, layout.swap, contiguous),
            (8, false) => convert::<u64>(base, n, stride, layout.swap, contiguous),
            _ => convert::<i64>(base, n, stride, layout.swap, contiguous),
        }
    };
    out.map(Tokens::Owned).map_err(|(i, v)| range_error(i, &v))
}

trait Item: Copy {
    fn swapped(self) -> Self;
    fn wide(self) -> i128;
}

macro_rules! item {
    ($($t:ty),*) => {$(
        impl Item for $t {
            #[inline(always)]
            fn swapped(self) -> Self { self.swap_bytes() }
            #[inline(always)]
            fn wide(self) -> i128 { self as i128 }
        }
    )*};
}
item!(u32, i32, u64, i64);

/// Converts to u32 with a range check; contiguous aligned native data takes a vectorisable path.
///
/// # Safety
/// `base` points at `n` items of `T`, `stride` bytes apart, all readable for the call (a held
/// buffer export); `contiguous` only if `stride` is `T`'s size and `base` is aligned for `T`.
unsafe fn convert<T: Item>(
    base: *const u8,
    n: usize,
    stride: isize,
    swap: bool,
    contiguous: bool,
) -> Result<Recycled<u32>, (usize, i128)> {
    let ok = |x: i128| (0..=u32::MAX as i128).contains(&x);
    let mut out = Recycled::take(&POOL);
    if contiguous && !swap {
        // SAFETY: n aligned items of T, contiguous (this function's contract).
        let items = unsafe { std::slice::from_raw_parts(base as *const T, n) };
        if let Some(i) = items.iter().position(|x| !ok(x.wide())) {
            return Err((i, items[i].wide()));
        }
        out.extend(items.iter().map(|x| x.wide() as u32));
        return Ok(out);
    }
    out.reserve(n);
    for i in 0..n {
        // SAFETY: item i < n is readable at `stride` * i bytes from `base`.
        let mut x =
            unsafe { std::ptr::read_unaligned(base.offset(i as isize * stride) as *const T) };
        if swap {
            x = x.swapped();
        }
        if !ok(x.wide()) {
            return Err((i, x.wide()));
        }
        out.push(x.wide() as u32);
    }
    Ok(out)
}
