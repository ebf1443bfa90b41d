//! Direct reads of CPython's int digits and list item array, for every hot path that walks lists
//! of ints: the encoder (`crate::encode`), token ids for hashing (`crate::hash::tokens`) and the
//! pool (`crate::pool`). Per token id these are the two lookups, and the stable API's out-of-line
//! calls cost more than the work done with the value.
//!
//! This is the layout msgspec reads too, but an abi3 module may load into a CPython it was not
//! built against, so the fast path is only taken on the versions whose layout is known (3.11:
//! signed digit count in `ob_size`; 3.12-3.14: sign and count packed in `lv_tag`) and after a
//! self-test against the API on this very interpreter. Anything else uses the API.

use std::ptr::addr_of_mut;

use pyo3::ffi;
use pyo3::prelude::*;
use pyo3::sync::PyOnceLock;
use pyo3::types::PyList;

#[derive(Clone, Copy, PartialEq, Eq)]
pub enum Layout {
    /// Stable API only.
    Api,
    /// 3.11: `ob_size` = +/- digit count.
    SignedSize,
    /// 3.12+: `lv_tag` = digit count << 3 | sign (0 positive, 1 zero, 2 negative).
    TaggedValue,
}

const DIGIT_BITS: u32 = 30;
/// Header, then the word at offset 16 (`ob_size` / `lv_tag` / a list's size), then at 24
/// the digits or the list's item pointer.
const WORD: usize = 16;
const PAYLOAD: usize = 24;

/// `(negative, magnitude)` when the int's magnitude fits in 64 bits; None means "ask the API"
/// (which also produces the overflow error).
///
/// # Safety
/// `obj` is a live exact int and the GIL is held; a layout other than `Api` is only passed on
/// the CPython versions `detect` picks it for, where an int's size word is at `WORD` and its
/// digits start at `PAYLOAD`.
#[inline(always)]
pub unsafe fn int_parts(layout: Layout, obj: *mut ffi::PyObject) -> Option<(bool, u64)> {
    // SAFETY: on those versions the word at WORD is the last of every int's header, and the
    // caller passes a live int.
    let word = unsafe { *((obj as *const u8).add(WORD) as *const isize) };
    let (negative, ndigits) = match layout {
        Layout::SignedSize => (word < 0, word.unsigned_abs()),
        Layout::TaggedValue => ((word & 3) == 2, (word as usize) >> 3),
        Layout::Api => return None,
    };
    // SAFETY: PAYLOAD is at most one past the header, inside or at the end of the object.
    let digits = unsafe { (obj as *const u8).add(PAYLOAD) } as *const u32;
    // One digit (below 2**30: token ids, small fields) is the hot case; keeping the rest out of
    // line stops LLVM from turning the digit count into a jump table that mispredicts whenever
    // token ids and 64-bit hashes alternate.
    let magnitude = if ndigits == 1 {
        // SAFETY: the int has one digit, at PAYLOAD.
        unsafe { *digits as u64 }
    } else {
        // SAFETY: the int has `ndigits` digits from `digits` on.
        unsafe { wide_magnitude(ndigits, digits) }?
    };
    Some((negative, magnitude))
}

/// Whether `obj` (an exact int, or a zeroed stand-in of its size) is in 0..2**30 -- zero or one digit, not negative -- and its
/// value if so, without a branch: token ids are read in runs of these, eight at a time.
///
/// # Safety
/// `obj` is a live exact int (or a zeroed stand-in at least `PAYLOAD` bytes long) and the GIL
/// is held; a layout other than `Api` only as for `int_parts`.
#[inline(always)]
pub unsafe fn small_int(layout: Layout, obj: *mut ffi::PyObject) -> (bool, u32) {
    static ZERO: u32 = 0;
    // SAFETY: the word at WORD ends an int's header (see `int_parts`) and is inside the
    // stand-in.
    let word = unsafe { *((obj as *const u8).add(WORD) as *const isize) };
    let (small, has_digit) = match layout {
        Layout::SignedSize => ((word as usize) <= 1, word != 0),
        // Digit count <= 1, sign not negative; bit 2 (3.14's immortal small ints) is ignored.
        Layout::TaggedValue => (
            (word as usize) < 16 && (word & 3) != 2,
            (word as usize) >> 3 != 0,
        ),
        Layout::Api => (false, false),
    };
    // Zero may have no digit allocated: read a static zero instead.
    let digit = if has_digit {
        // SAFETY: a nonzero digit count means the int has a digit at PAYLOAD.
        unsafe { (obj as *const u8).add(PAYLOAD) as *const u32 }
    } else {
        &ZERO as *const u32
    };
    // SAFETY: `digit` points at the int's first digit or at ZERO.
    (small, unsafe { *digit })
}

/// The magnitude of an int of `ndigits` 30-bit digits, if it fits in 64 bits.
///
/// # Safety
/// `digits` points at `ndigits` readable digits (an int's, read under the GIL).
#[inline(never)]
unsafe fn wide_magnitude(ndigits: usize, digits: *const u32) -> Option<u64> {
    // SAFETY: each arm reads only digits below `ndigits`.
    unsafe {
        match ndigits {
            0 => Some(0),
            2 => Some(*digits as u64 | (*digits.add(1) as u64) << DIGIT_BITS),
            3 if *digits.add(2) < 16 => Some(
                *digits as u64
                    | (*digits.add(1) as u64) << DIGIT_BITS
                    | (*digits.add(2) as u64) << (2 * DIGIT_BITS),
            ),
            _ => None,
        }
    }
}

/// A list's size and item array pointer, read off its object.
///
/// # Safety
/// `obj` is a live list (exact or subclass), the GIL is held, and the layout is not `Api` (a
/// list's size is at `WORD`, its item array pointer at `PAYLOAD`).
#[inline(always)]
unsafe fn list_raw(obj: *mut ffi::PyObject) -> (usize, *mut *mut ffi::PyObject) {
    // SAFETY: a live list object, laid out as the caller guarantees.
    unsafe {
        (
            *((obj as *const u8).add(WORD) as *const isize) as usize,
            *((obj as *const u8).add(PAYLOAD) as *const *mut *mut ffi::PyObject),
        )
    }
}

/// A list's items without a call per item.
///
/// # Safety
/// `obj` is a live list (exact or subclass) and the GIL is held; a layout other than `Api` only
/// as for `int_parts` (a list's size is at `WORD`, its item array pointer at `PAYLOAD`). The
/// slice borrows the list's item array: it is valid only until the next Python code runs (which
/// may resize or clear the list, or free its items), and the caller runs none while using it.
#[inline(always)]
pub unsafe fn list_items<'a>(
    layout: Layout,
    obj: *mut ffi::PyObject,
) -> Option<&'a [*mut ffi::PyObject]> {
    if layout == Layout::Api {
        return None;
    }
    // SAFETY: the caller's guarantees.
    let (len, items) = unsafe { list_raw(obj) };
    Some(if len == 0 {
        &[]
    } else {
        // SAFETY: a non-empty list's item array holds `len` initialised item pointers.
        unsafe { std::slice::from_raw_parts(items, len) }
    })
}

/// A fresh list's item slots (`PyList_New(n)`: `n` NULLs), for a decoder to fill without a
/// call per item; `None` on `Api` (use `PyList_SetItem`) or for an empty list.
///
/// # Safety
/// As for `list_items`, and `obj` is fresh: no one else holds it, so each slot is set once,
/// with a new reference the list takes over.
#[inline(always)]
pub unsafe fn fresh_list_slots<'a>(
    layout: Layout,
    obj: *mut ffi::PyObject,
) -> Option<&'a mut [*mut ffi::PyObject]> {
    if layout == Layout::Api {
        return None;
    }
    // SAFETY: the caller's guarantees.
    let (len, items) = unsafe { list_raw(obj) };
    if len == 0 {
        return None;
    }
    // SAFETY: a fresh list of `len` slots owns an item array of `len` pointers (all NULL).
    Some(unsafe { std::slice::from_raw_parts_mut(items, len) })
}

/// Appends the leading items of `items` that are exact ints in 0..=u32::MAX (token ids) to
/// `out` and returns how many; stops at the first other item, which the caller converts (and
/// reports) through the API.
///
/// # Safety
/// `items` are live objects (a list's item array read under the GIL, no Python code run since);
/// a layout other than `Api` only as for `int_parts`.
#[inline(always)]
pub unsafe fn read_u32_prefix(
    layout: Layout,
    items: &[*mut ffi::PyObject],
    out: &mut Vec<u32>,
) -> usize {
    // SAFETY: the caller's guarantees are the callee's.
    let done = unsafe { read_small_ints(layout, items, out) };
    let long = addr_of_mut!(ffi::PyLong_Type);
    for (i, &p) in items[done..].iter().enumerate() {
        // SAFETY: `p` is a live object.
        if unsafe { ffi::Py_TYPE(p) } != long {
            return done + i;
        }
        // SAFETY: `p` is a live exact int.
        match unsafe { int_parts(layout, p) } {
            Some((false, v)) if v <= u32::MAX as u64 => out.push(v as u32),
            _ => return done + i,
        }
    }
    items.len()
}

/// Appends exact ints in 0..2**30 (every vocabulary's token ids) from the start of `items`, eight
/// at a time with no branch per item, so the reads of the int objects overlap; stops before the
/// first group of eight holding anything else (the caller takes those item by item). Returns how
/// many items it took.
///
/// # Safety
/// As `read_u32_prefix`.
#[inline(always)]
unsafe fn read_small_ints(
    layout: Layout,
    items: &[*mut ffi::PyObject],
    out: &mut Vec<u32>,
) -> usize {
    const GROUP: usize = 8;
    // Read in place of an item that is not an int (whose memory may end before the fields
    // an int has): an object-sized zero, never a valid token, as `ok` records.
    static NOT_AN_INT: [usize; 4] = [0; 4];
    let long_type = addr_of_mut!(ffi::PyLong_Type);
    let start = out.len();
    out.reserve(items.len());
    // SAFETY: `start` is the vector's length, inside (or one past) its allocation.
    let dst = unsafe { out.as_mut_ptr().add(start) };
    let mut done = 0;
    for group in items.chunks_exact(GROUP) {
        let mut ok = true;
        for (j, &p) in group.iter().enumerate() {
            // SAFETY: `p` is a live object.
            let is_int = unsafe { ffi::Py_TYPE(p) } == long_type;
            let int = if is_int {
                p
            } else {
                NOT_AN_INT.as_ptr() as *mut ffi::PyObject
            };
            // SAFETY: `int` is a live exact int or the zeroed stand-in, 32 bytes long.
            let (small, value) = unsafe { small_int(layout, int) };
            ok &= is_int & small;
            // SAFETY: done + j < items.len(), and `items.len()` more were reserved past `start`.
            unsafe { *dst.add(done + j) = value };
        }
        if !ok {
            break;
        }
        done += GROUP;
    }
    // SAFETY: out[start..start + done] were written above (a partial group's writes are left
    // beyond the length), inside the reservation.
    unsafe { out.set_len(start + done) };
    done
}

/// This interpreter's layout, detected once per process (see `detect`).
pub fn layout(py: Python<'_>) -> Layout {
    static LAYOUT: PyOnceLock<Layout> = PyOnceLock::new();
    *LAYOUT.get_or_init(py, || detect(py))
}

/// The layout to use on this interpreter, proven on sample values before it is trusted.
/// `KVBRIDGE_ENCODE_STABLE_API` forces the API path, so tests can cover both.
fn detect(py: Python<'_>) -> Layout {
    if cfg!(not(target_pointer_width = "64"))
        || std::env::var_os("KVBRIDGE_ENCODE_STABLE_API").is_some()
    {
        return Layout::Api;
    }
    let version = py.version_info();
    let layout = match (version.major, version.minor) {
        (3, 11) => Layout::SignedSize,
        (3, 12..=14) => Layout::TaggedValue,
        _ => return Layout::Api,
    };
    if self_test(py, layout).unwrap_or(false) {
        layout
    } else {
        Layout::Api
    }
}

fn self_test(py: Python<'_>, layout: Layout) -> PyResult<bool> {
    let samples: [i128; 16] = [
        0,
        1,
        7,
        127,
        -1,
        -32,
        (1 << 30) - 1,
        1 << 30,
        (1 << 31) + 7,
        (1 << 60) - 1,
        (1 << 60) + 3,
        i64::MAX as i128,
        1 << 63,
        u64::MAX as i128,
        -(1 << 40) - 5,
        i64::MIN as i128,
    ];
    let list = PyList::empty(py);
    for value in samples {
        let int = value.into_pyobject(py)?;
        // SAFETY: `int` is a live int object; the reader only touches its header and digits.
        let Some((negative, magnitude)) = (unsafe { int_parts(layout, int.as_ptr()) }) else {
            return Ok(false);
        };
        if (negative, magnitude) != (value < 0, value.unsigned_abs() as u64) {
            return Ok(false);
        }
        let small = (0..1 << 30).contains(&value);
        // SAFETY: as above.
        let (is_small, small_value) = unsafe { small_int(layout, int.as_ptr()) };
        if is_small != small || (small && small_value as i128 != value) {
            return Ok(false);
        }
        list.append(int)?;
    }
    // Past 64 bits the reader must decline rather than truncate.
    let wide = (1u128 << 64).into_pyobject(py)?;
    // SAFETY: `wide` is a live int object.
    if unsafe { int_parts(layout, wide.as_ptr()) }.is_some() {
        return Ok(false);
    }
    // SAFETY: `list` is a live list; no Python code runs while `items` is used.
    let items = unsafe { list_items(layout, list.as_ptr()) }.unwrap_or(&[]);
    Ok(items.len() == samples.len()
        && items
            .iter()
            .zip(list.iter())
            .all(|(raw, item)| *raw == item.as_ptr()))
}
