//! A query's answer as Python objects: worker names made once per worker and reused, counts
//! from a table of ints, the two lists of `lists=True`, and `top_k`'s selection.

use std::sync::Arc;

use pyo3::ffi;
use pyo3::prelude::*;
use pyo3::sync::PyOnceLock;
use pyo3::types::{PyString, PyTuple};

use crate::cpython;
use crate::decode::{incref, new_list, set_item};

pub(super) type NameCache = (Arc<str>, Py<PyString>);

/// The largest `top_k` that `keep_top` keeps by insertion.
const KEEP_BY_INSERTION: usize = 16;

/// Keeps the `k` pairs with the longest hits, longest first, ties in worker id order: one pass
/// that inserts into the kept prefix only what beats its last (a router's k is small, and most
/// workers do not), where a sort of every pair cost as much as the query's lookups.
pub(super) fn keep_top(found: &mut Vec<(u32, u32)>, k: usize) {
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
pub(super) fn inline_layout(py: Python<'_>) -> cpython::Layout {
    if cfg!(target_endian = "little") {
        cpython::layout(py)
    } else {
        cpython::Layout::Api
    }
}

/// `(workers, counts)` as two lists filled slot by slot (no call per item where
/// `crate::cpython` knows the list layout).
pub(super) fn lists_answer<'py>(
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
pub(super) fn name_obj<'py>(
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
