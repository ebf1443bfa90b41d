//! Compact event records turned into `kvbridge.wire.events` objects, only when drained.
//!
//! Building lists of ints dominates: a token id becomes a Python int per token per event. Token
//! ids repeat (a vocabulary is at most a few hundred thousand ids), so each manager keeps the int
//! objects it made, indexed by id, and an event's token list is increfs of those — a fresh
//! PyLong per token cost more than all the bookkeeping of a block.

use pyo3::ffi;
use pyo3::prelude::*;
use pyo3::types::{PyList, PyTuple};

use super::core::{Event, Record};

/// Ids from here on get a fresh int each time (bounds the cache at 8 MiB of pointers).
const INT_CACHE_MAX: usize = 1 << 20;

pub struct Classes {
    pub stored: Py<PyAny>,
    pub removed: Py<PyAny>,
    pub cleared: Py<PyAny>,
}

impl Classes {
    pub fn import(py: Python<'_>) -> PyResult<Classes> {
        let events = py.import("kvbridge.wire.events")?;
        Ok(Classes {
            stored: events.getattr("BlockStored")?.unbind(),
            removed: events.getattr("BlockRemoved")?.unbind(),
            cleared: events.getattr("AllBlocksCleared")?.unbind(),
        })
    }
}

/// What a `lora` index in a record stands for.
pub struct Lora {
    /// str or None.
    pub name: Py<PyAny>,
    /// int or None.
    pub id: Py<PyAny>,
    /// `(lora_name,)` when the algorithm mixed it into the hash as vLLM does (and the name is
    /// not empty: vLLM 0.33 publishes no extra keys then); None otherwise.
    pub extra: Option<Py<PyTuple>>,
}

impl Lora {
    pub fn clone_ref(&self, py: Python<'_>) -> Lora {
        Lora {
            name: self.name.clone_ref(py),
            id: self.id.clone_ref(py),
            extra: self.extra.as_ref().map(|e| e.clone_ref(py)),
        }
    }
}

#[derive(Default)]
pub struct Ints {
    cache: Vec<Option<Py<PyAny>>>,
}

impl Ints {
    /// A new reference to the int `t`.
    #[inline]
    fn get(&mut self, py: Python<'_>, t: u32) -> *mut ffi::PyObject {
        let i = t as usize;
        if i >= INT_CACHE_MAX {
            // SAFETY: returns a new reference (or NULL with an error set, which PyList_SetItem
            // callers turn into an error via the list check below).
            return unsafe { ffi::PyLong_FromUnsignedLong(t as _) };
        }
        if i >= self.cache.len() {
            self.cache
                .resize_with((i + 1).max(self.cache.len() * 2).min(INT_CACHE_MAX), || {
                    None
                });
        }
        let slot = &mut self.cache[i];
        let obj = slot.get_or_insert_with(|| t.into_pyobject(py).expect("int").into_any().unbind());
        obj.clone_ref(py).into_ptr()
    }
}

/// A list of `n` new references made by `item`.
fn list<'py>(
    py: Python<'py>,
    n: usize,
    mut item: impl FnMut(usize) -> *mut ffi::PyObject,
) -> PyResult<Bound<'py, PyList>> {
    // SAFETY: PyList_New gives an owned list of n NULL slots; PyList_SetItem steals each item
    // (a NULL item leaves the slot NULL, and the pending error is returned before the list is
    // seen by anyone).
    unsafe {
        let list = Bound::from_owned_ptr_or_err(py, ffi::PyList_New(n as ffi::Py_ssize_t))?;
        for i in 0..n {
            let obj = item(i);
            if obj.is_null() {
                return Err(PyErr::fetch(py));
            }
            ffi::PyList_SetItem(list.as_ptr(), i as ffi::Py_ssize_t, obj);
        }
        Ok(list.cast_into_unchecked())
    }
}

fn hash_list<'py>(py: Python<'py>, hashes: &[u64]) -> PyResult<Bound<'py, PyList>> {
    // SAFETY: PyLong_FromUnsignedLongLong returns a new reference or NULL.
    list(py, hashes.len(), |i| unsafe {
        ffi::PyLong_FromUnsignedLongLong(hashes[i])
    })
}

pub struct Context<'a> {
    pub classes: &'a Classes,
    pub medium: &'a Py<PyAny>,
    pub block_size: usize,
    /// Index 0 is "no LoRA" and never read.
    pub loras: &'a [Lora],
    /// A hybrid pool's (kind, window) per group, put in its events; None: single group, whose
    /// events carry no group fields.
    pub groups: Option<&'a [(Py<PyAny>, Py<PyAny>)]>,
}

/// The record's events as `BlockStored` / `BlockRemoved` / `AllBlocksCleared` objects, with the
/// arguments in field order exactly as the Python pool passes them.
pub fn build<'py>(
    py: Python<'py>,
    rec: &Record,
    cx: &Context<'_>,
    ints: &mut Ints,
) -> PyResult<Bound<'py, PyList>> {
    let out = PyList::empty(py);
    for ev in &rec.events {
        let obj = match ev {
            Event::Stored {
                parent,
                hashes,
                tokens,
                lora,
                group,
            } => {
                let hashes = hash_list(py, &rec.hashes[hashes.clone()])?;
                let toks = &rec.tokens[tokens.clone()];
                let tokens = list(py, toks.len(), |i| ints.get(py, toks[i]))?;
                let parent = parent.into_pyobject(py)?;
                let (bs, medium) = (cx.block_size, cx.medium.bind(py));
                let l = &cx.loras[*lora as usize];
                let extra = |n: usize| match &l.extra {
                    Some(t) => list(py, n, |_| t.clone_ref(py).into_ptr()).map(|l| l.into_any()),
                    None => Ok(py.None().into_bound(py)),
                };
                match cx.groups {
                    None if *lora == 0 => {
                        let args = (hashes, parent, tokens, bs, py.None(), medium, py.None());
                        cx.classes.stored.bind(py).call1(args)?
                    }
                    None => {
                        let extra = extra(hashes.len())?;
                        let (id, name) = (l.id.bind(py), l.name.bind(py));
                        let args = (hashes, parent, tokens, bs, id, medium, name, extra);
                        cx.classes.stored.bind(py).call1(args)?
                    }
                    Some(groups) => {
                        let extra = extra(hashes.len())?;
                        let (kind, window) = &groups[*group as usize];
                        let (id, name) = (l.id.bind(py), l.name.bind(py));
                        let args = (
                            hashes,
                            parent,
                            tokens,
                            bs,
                            id,
                            medium,
                            name,
                            extra,
                            *group,
                            kind.bind(py),
                            window.bind(py),
                        );
                        cx.classes.stored.bind(py).call1(args)?
                    }
                }
            }
            Event::Removed { hashes, group } => {
                let hashes = hash_list(py, &rec.hashes[hashes.clone()])?;
                let removed = cx.classes.removed.bind(py);
                match cx.groups {
                    None => removed.call1((hashes, cx.medium.bind(py)))?,
                    Some(_) => removed.call1((hashes, cx.medium.bind(py), *group))?,
                }
            }
            Event::Cleared => cx.classes.cleared.bind(py).call0()?,
        };
        out.append(obj)?;
    }
    Ok(out)
}
