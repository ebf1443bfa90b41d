//! msgpack encoding of KV event batches, byte-identical to `msgspec.msgpack.Encoder().encode`.
//!
//! The bytes are vLLM's wire format, so every msgspec choice that shows in them is copied:
//! the smallest int form (negative fixint down to -32, unsigned forms for anything >= 0),
//! float64 for every float, str8 from 32 bytes, bin8 even for short bytes, headers sized by
//! count, and for a map-encoded struct a header sized for *all* its fields plus the tag, then
//! patched down to the number written when `omit_defaults` skipped some. That last rule is
//! why BlockStored (15 fields + tag) always starts with a map16 header `de 00 nn`.
//!
//! Speed comes from reading what msgspec reads, the way msgspec does, from an abi3 module:
//! struct fields straight from the instance slots at the offsets the type records for them
//! (`plan.rs`, checked against `getattr` once per type), ints and list items straight from
//! CPython's layout where a self-test vouches for it (`crate::cpython`), keys pre-encoded once per
//! type, int widths by table lookup (`msgpack.rs`), and one output buffer reused across calls.
//! Anything outside the supported value set raises TypeError before a single wrong byte could
//! be returned, so callers can fall back to msgspec.
//!
//! The walk borrows what it reads (a list's item array, a dict's entries, a slot's value), so it
//! must run no Python code: any could resize a list or free an object under it. Planning a type
//! runs Python code (`getattr`), so no plan is built during a walk. Each thread plans the four
//! wire types (`WIRE_TYPES`) before its first walk; a walk that meets any other Struct type
//! without a plan stops, keeping a reference to that instance, and once the walk has let go of
//! everything it borrowed, the plan is built from the instance and the walk starts over from
//! the top, on the containers as they are then.

use std::cell::RefCell;
use std::os::raw::c_int;
use std::ptr::addr_of_mut;

use pyo3::exceptions::{PyAttributeError, PyOverflowError, PyTypeError};
use pyo3::ffi;
use pyo3::prelude::*;
use pyo3::sync::PyOnceLock;
use pyo3::types::{PyBool, PyBytes, PyDict, PyNone};

use crate::cpython;
use crate::prefetch::prefetch;

pub(crate) mod msgpack;
mod plan;

use msgpack::{
    patch_map_header, put_array_header, put_bin, put_float, put_int, put_map_header, put_str,
    put_uint,
};
use plan::{build_plan, Plan};

/// msgspec recurses up to Python's recursion limit; past this depth we hand over to it.
const MAX_DEPTH: u32 = 256;
/// Distinct Struct types remembered per thread; beyond it the types are almost certainly
/// generated on the fly, and msgspec is the better tool.
const MAX_PLANS: usize = 64;
/// A one-off huge batch should not pin its buffer for the life of the thread.
const KEEP_BUFFER_BYTES: usize = 8 << 20;

/// The Struct types vLLM's wire format is made of, in `kvbridge.wire.events`: planned by every
/// thread before its first walk, so that a batch never makes a walk start over.
const WIRE_MODULE: &str = "kvbridge.wire.events";
const WIRE_TYPES: [&str; 4] = [
    "KVEventBatch",
    "BlockStored",
    "BlockRemoved",
    "AllBlocksCleared",
];

/// List items are read this many ahead of the walk (see `prefetch`).
const PREFETCH_AHEAD: usize = 16;

/// Encode `batch` (normally a `KVEventBatch`) to the exact bytes msgspec's msgpack encoder writes.
#[pyfunction]
pub fn encode_batch_msgpack<'py>(
    py: Python<'py>,
    batch: &Bound<'py, PyAny>,
) -> PyResult<Bound<'py, PyBytes>> {
    let setup = setup(py)?;
    STATE.with(|cell| match cell.try_borrow_mut() {
        Ok(mut state) => state.encode(py, setup, batch),
        // Only reachable if Python code run while planning a type (between walks) re-enters
        // the encoder.
        Err(_) => State::default().encode(py, setup, batch),
    })
}

/// Which int/list reader this interpreter got ("api" when the fast path is off), for tests.
#[pyfunction]
fn _encode_layout(py: Python<'_>) -> PyResult<&'static str> {
    Ok(match setup(py)?.layout {
        cpython::Layout::Api => "api",
        cpython::Layout::SignedSize => "signed-size",
        cpython::Layout::TaggedValue => "tagged-value",
    })
}

pub fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_function(wrap_pyfunction!(encode_batch_msgpack, m)?)?;
    m.add_function(wrap_pyfunction!(_encode_layout, m)?)
}

/// What every call needs from the interpreter, looked up once.
struct Setup {
    struct_meta: Py<PyAny>,
    unset: Py<PyAny>,
    layout: cpython::Layout,
    /// One instance of each of `WIRE_TYPES`, for `build_plan` to check the slots on.
    wire_samples: Vec<Py<PyAny>>,
}

static SETUP: PyOnceLock<Setup> = PyOnceLock::new();

fn setup(py: Python<'_>) -> PyResult<&'static Setup> {
    SETUP.get_or_try_init(py, || {
        let msgspec = py.import("msgspec")?;
        Ok(Setup {
            struct_meta: msgspec.getattr("Struct")?.get_type().into_any().unbind(),
            unset: msgspec.getattr("UNSET")?.unbind(),
            layout: cpython::layout(py),
            wire_samples: wire_samples(py)?,
        })
    })
}

/// An instance of each wire type with None in every field (a Struct's `__init__` checks no
/// types), so its plan can be built before anything is walked.
fn wire_samples(py: Python<'_>) -> PyResult<Vec<Py<PyAny>>> {
    let module = py.import(WIRE_MODULE)?;
    WIRE_TYPES
        .iter()
        .map(|name| {
            let ty = module.getattr(*name)?;
            let fields = PyDict::new(py);
            for field in ty.getattr("__struct_fields__")?.try_iter()? {
                fields.set_item(field?, PyNone::get(py))?;
            }
            Ok(ty.call((), Some(&fields))?.unbind())
        })
        .collect()
}

#[derive(Default)]
struct State {
    buf: Vec<u8>,
    /// Built only between walks, never during one (see the module's doc).
    plans: Vec<Plan>,
    /// Whether `plans` holds the wire types' yet.
    wire_planned: bool,
}

thread_local! {
    static STATE: RefCell<State> = RefCell::new(State::default());
}

impl State {
    fn encode<'py>(
        &mut self,
        py: Python<'py>,
        setup: &Setup,
        obj: &Bound<'py, PyAny>,
    ) -> PyResult<Bound<'py, PyBytes>> {
        if !self.wire_planned {
            for sample in &setup.wire_samples {
                self.plans.push(build_plan(sample.bind(py).clone())?);
            }
            self.wire_planned = true;
        }
        loop {
            self.buf.clear();
            let mut enc = Encoder {
                py,
                out: &mut self.buf,
                plans: &self.plans,
                unplanned: None,
                struct_meta: setup.struct_meta.as_ptr() as *mut ffi::PyTypeObject,
                unset: setup.unset.as_ptr(),
                layout: setup.layout,
                depth: 0,
            };
            // SAFETY: `obj` is a live object (our caller holds it for the call), the GIL is held,
            // and the walk runs no Python code: it builds no plan, it stops instead.
            let walked = unsafe { enc.value(obj.as_ptr()) };
            let Some(instance) = enc.unplanned.take() else {
                walked?;
                break;
            };
            // The walk is over and borrows nothing: planning may run Python code, which may
            // change what the next walk finds.
            self.plans.push(build_plan(instance.into_bound(py))?);
        }
        let bytes = PyBytes::new(py, &self.buf);
        if self.buf.capacity() > KEEP_BUFFER_BYTES {
            self.buf = Vec::new();
        }
        Ok(bytes)
    }
}

/// The walk. Every `unsafe fn` below takes a `*mut PyObject` on the same terms:
///
/// # Safety
/// `obj` is a live object and the GIL is held; no Python code runs from the moment the caller
/// read `obj` (out of a container it borrows) until the call returns, since the containers
/// above it are borrowed, not owned, by the walk.
struct Encoder<'a, 'py> {
    py: Python<'py>,
    out: &'a mut Vec<u8>,
    plans: &'a [Plan],
    /// An instance of a Struct type met without a plan: the walk stopped there.
    unplanned: Option<Py<PyAny>>,
    struct_meta: *mut ffi::PyTypeObject,
    unset: *mut ffi::PyObject,
    layout: cpython::Layout,
    depth: u32,
}

impl<'a> Encoder<'a, '_> {
    /// Any value.
    ///
    /// # Safety
    /// As for every walk method (see `Encoder`).
    unsafe fn value(&mut self, obj: *mut ffi::PyObject) -> PyResult<()> {
        // SAFETY: `obj` is live (this function's contract). In every block below it is also of
        // the exact type just compared, and the callee's contract is this function's.
        let ty = unsafe { ffi::Py_TYPE(obj) };
        // Exact types only, like msgspec: an int/str/float subclass is not silently flattened.
        if ty == addr_of_mut!(ffi::PyLong_Type) {
            // SAFETY: see above.
            unsafe { self.int(obj) }
        } else if ty == addr_of_mut!(ffi::PyUnicode_Type) {
            // SAFETY: see above.
            unsafe { self.str(obj) }
        } else if ty == addr_of_mut!(ffi::PyList_Type) {
            // SAFETY: see above.
            unsafe { self.list(obj) }
        } else if obj == PyNone::get(self.py).as_ptr() {
            self.out.push(0xc0);
            Ok(())
        } else if ty == addr_of_mut!(ffi::PyFloat_Type) {
            // SAFETY: see above; an exact float converts without running Python code.
            put_float(self.out, unsafe { ffi::PyFloat_AsDouble(obj) });
            Ok(())
        } else if ty == addr_of_mut!(ffi::PyBool_Type) {
            self.out
                .push(if obj == PyBool::new(self.py, true).as_ptr() {
                    0xc3
                } else {
                    0xc2
                });
            Ok(())
        } else if ty == addr_of_mut!(ffi::PyBytes_Type) {
            // SAFETY: see above; a bytes object's buffer holds `len` bytes for its lifetime,
            // and nothing runs Python code while the slice is read.
            unsafe {
                let data = ffi::PyBytes_AsString(obj) as *const u8;
                let len = ffi::PyBytes_Size(obj) as usize;
                put_bin(self.out, std::slice::from_raw_parts(data, len))
            }
        } else if ty == addr_of_mut!(ffi::PyTuple_Type) {
            // SAFETY: see above.
            unsafe { self.tuple(obj) }
        } else if ty == addr_of_mut!(ffi::PyDict_Type) {
            // SAFETY: see above.
            unsafe { self.dict(obj) }
        } else if ty == addr_of_mut!(ffi::PyByteArray_Type) {
            // SAFETY: see above; the bytearray's buffer holds `len` bytes until it is resized,
            // which takes Python code, and none runs while the slice is read.
            unsafe {
                let data = ffi::PyByteArray_AsString(obj) as *const u8;
                let len = ffi::PyByteArray_Size(obj) as usize;
                put_bin(self.out, std::slice::from_raw_parts(data, len))
            }
        } else {
            // SAFETY: see above; `ty` is `obj`'s type.
            unsafe { self.uncommon(obj, ty) }
        }
    }

    /// A Struct, a container subclass, or a TypeError.
    ///
    /// # Safety
    /// As for every walk method (see `Encoder`), and `ty` is `obj`'s type.
    unsafe fn uncommon(
        &mut self,
        obj: *mut ffi::PyObject,
        ty: *mut ffi::PyTypeObject,
    ) -> PyResult<()> {
        // SAFETY: `obj` is live and `ty` its type (this function's contract, which is also the
        // callee's); the same holds for every block below.
        if let Some(plan) = unsafe { self.plan_for(obj, ty) }? {
            // SAFETY: see above; the plan is `ty`'s.
            return unsafe { self.strukt(obj, plan) };
        }
        // Subclasses msgspec also writes as their base container.
        // SAFETY: see above.
        unsafe {
            if ffi::PyList_Check(obj) != 0 {
                self.list(obj)
            } else if ffi::PyTuple_Check(obj) != 0 {
                self.tuple(obj)
            } else if ffi::PyDict_Check(obj) != 0 {
                self.dict(obj)
            } else {
                // A type's name is read without running Python code.
                let name = Bound::from_borrowed_ptr(self.py, obj).get_type().name()?;
                Err(PyTypeError::new_err(format!(
                    "the native encoder cannot represent a value of type {name}"
                )))
            }
        }
    }

    /// An exact int.
    ///
    /// # Safety
    /// As for every walk method (see `Encoder`), and `obj` is an exact int.
    #[inline(always)]
    unsafe fn int(&mut self, obj: *mut ffi::PyObject) -> PyResult<()> {
        // SAFETY: `obj` is a live exact int under the GIL; `self.layout` came from `layout()`.
        match unsafe { cpython::int_parts(self.layout, obj) } {
            Some((false, magnitude)) => put_uint(self.out, magnitude),
            Some((true, magnitude)) if magnitude <= 1 << 63 => {
                put_int(self.out, magnitude.wrapping_neg() as i64)
            }
            // SAFETY: this function's contract is the callee's.
            _ => return unsafe { self.int_via_api(obj) },
        }
        Ok(())
    }

    /// An exact int through the API (stable-API layout, or past 64 bits).
    ///
    /// # Safety
    /// As for `int`.
    #[inline(never)]
    unsafe fn int_via_api(&mut self, obj: *mut ffi::PyObject) -> PyResult<()> {
        let mut overflow: c_int = 0;
        // SAFETY: `obj` is a live exact int, whose conversions run no Python code, and the GIL
        // is held for the error indicator; the same holds for every block below.
        let v = unsafe { ffi::PyLong_AsLongLongAndOverflow(obj, &mut overflow) };
        if overflow == 0 {
            put_int(self.out, v);
            return Ok(());
        }
        if overflow > 0 {
            // SAFETY: see above.
            let u = unsafe { ffi::PyLong_AsUnsignedLongLong(obj) };
            // SAFETY: see above.
            if u != u64::MAX || unsafe { ffi::PyErr_Occurred() }.is_null() {
                put_uint(self.out, u);
                return Ok(());
            }
            // SAFETY: see above.
            unsafe { ffi::PyErr_Clear() };
        }
        // msgspec's own error for the same value.
        Err(PyOverflowError::new_err(
            "can't serialize ints < -2**63 or > 2**64 - 1",
        ))
    }

    /// A str or str subclass (dict keys), as UTF-8.
    ///
    /// # Safety
    /// As for every walk method (see `Encoder`), and `obj` is a str.
    unsafe fn str(&mut self, obj: *mut ffi::PyObject) -> PyResult<()> {
        let mut len: ffi::Py_ssize_t = 0;
        // SAFETY: `obj` is a live str; its UTF-8 form is cached on it (no Python code runs)
        // and lives as long as it does.
        let data = unsafe { ffi::PyUnicode_AsUTF8AndSize(obj, &mut len) };
        if data.is_null() {
            return Err(PyErr::fetch(self.py)); // lone surrogates: msgspec fails the same way
        }
        // SAFETY: `data` holds `len` bytes (see above).
        put_str(self.out, unsafe {
            std::slice::from_raw_parts(data as *const u8, len as usize)
        })
    }

    fn enter(&mut self) -> PyResult<()> {
        self.depth += 1;
        if self.depth > MAX_DEPTH {
            return Err(PyTypeError::new_err(format!(
                "the native encoder stops at {MAX_DEPTH} levels of nesting"
            )));
        }
        Ok(())
    }

    /// A list or list subclass.
    ///
    /// # Safety
    /// As for every walk method (see `Encoder`), and `obj` is a list.
    unsafe fn list(&mut self, obj: *mut ffi::PyObject) -> PyResult<()> {
        // SAFETY: `obj` is a live list.
        let len = unsafe { ffi::PyList_Size(obj) };
        put_array_header(self.out, len as usize)?;
        self.enter()?;
        // SAFETY: `obj` is a live list, and the walk of its items runs no Python code, so the
        // item array stays as read and its items alive (this function's contract, passed on).
        unsafe {
            match cpython::list_items(self.layout, obj) {
                Some(items) => {
                    for (i, &item) in items.iter().enumerate() {
                        if let Some(&ahead) = items.get(i + PREFETCH_AHEAD) {
                            prefetch(ahead);
                        }
                        self.item(item)?;
                    }
                }
                None => (0..len).try_for_each(|i| self.item(ffi::PyList_GetItem(obj, i)))?,
            }
        }
        self.depth -= 1;
        Ok(())
    }

    /// A list item. Token id lists are most of a batch: their ints skip the general dispatch.
    ///
    /// # Safety
    /// As for every walk method (see `Encoder`).
    #[inline(always)]
    unsafe fn item(&mut self, item: *mut ffi::PyObject) -> PyResult<()> {
        // SAFETY: `item` is live, and an exact int where `int` is called; the callees'
        // contract is this function's.
        unsafe {
            if ffi::Py_TYPE(item) == addr_of_mut!(ffi::PyLong_Type) {
                self.int(item)
            } else {
                self.value(item)
            }
        }
    }

    /// A tuple or tuple subclass.
    ///
    /// # Safety
    /// As for every walk method (see `Encoder`), and `obj` is a tuple.
    unsafe fn tuple(&mut self, obj: *mut ffi::PyObject) -> PyResult<()> {
        // SAFETY: `obj` is a live tuple.
        let len = unsafe { ffi::PyTuple_Size(obj) };
        put_array_header(self.out, len as usize)?;
        self.enter()?;
        for i in 0..len {
            // SAFETY: i < len; the tuple owns its items and is kept alive by the walk's
            // contract, passed on.
            unsafe { self.value(ffi::PyTuple_GetItem(obj, i))? };
        }
        self.depth -= 1;
        Ok(())
    }

    /// A dict or dict subclass, in iteration order.
    ///
    /// # Safety
    /// As for every walk method (see `Encoder`), and `obj` is a dict.
    unsafe fn dict(&mut self, obj: *mut ffi::PyObject) -> PyResult<()> {
        // SAFETY: `obj` is a live dict.
        put_map_header(self.out, unsafe { ffi::PyDict_Size(obj) } as usize)?;
        self.enter()?;
        let (mut pos, mut key, mut val) = (0, std::ptr::null_mut(), std::ptr::null_mut());
        // SAFETY: `obj` is a live dict that no Python code changes during the iteration (the
        // walk's contract, passed on to the keys and values it borrows).
        unsafe {
            while ffi::PyDict_Next(obj, &mut pos, &mut key, &mut val) != 0 {
                // msgspec accepts str subclasses as keys (not as values).
                if ffi::PyUnicode_Check(key) != 0 {
                    self.str(key)?;
                } else {
                    self.value(key)?;
                }
                self.value(val)?;
            }
        }
        self.depth -= 1;
        Ok(())
    }

    /// A Struct instance, field by field from its slots.
    ///
    /// # Safety
    /// As for every walk method (see `Encoder`), and `plan` is the plan for `obj`'s type.
    unsafe fn strukt(&mut self, obj: *mut ffi::PyObject, plan: &Plan) -> PyResult<()> {
        self.enter()?;
        let header_at = self.out.len();
        if plan.array_like {
            put_array_header(self.out, plan.len)?;
        } else {
            put_map_header(self.out, plan.len)?;
        }
        self.out.extend_from_slice(&plan.prefix);
        let mut written = plan.len - plan.fields.len();
        let none = PyNone::get(self.py).as_ptr();
        for (i, field) in plan.fields.iter().enumerate() {
            // SAFETY: `build_plan` proved on an instance of this very type (which it keeps
            // alive, so the address names no other) that the field lives in an object slot
            // at this offset; a slot holds an owned reference or NULL.
            let val =
                unsafe { *((obj as *const u8).offset(field.offset) as *const *mut ffi::PyObject) };
            if val.is_null() {
                return Err(PyAttributeError::new_err(format!(
                    "Struct field {:?} is unset",
                    field.attr
                )));
            }
            if !plan.array_like {
                if val == self.unset || (i >= plan.omit_none_from && val == none) {
                    continue;
                }
                self.out.extend_from_slice(&field.key);
            } else if val == self.unset {
                return Err(PyTypeError::new_err(
                    "the native encoder cannot write UNSET in an array-like Struct",
                ));
            }
            // SAFETY: `val` is owned by `obj`'s slot, which no Python code changes meanwhile.
            unsafe { self.value(val)? };
            written += 1;
        }
        if written != plan.len {
            patch_map_header(self.out, header_at, plan.len, written);
        }
        self.depth -= 1;
        Ok(())
    }

    /// The plan for `ty` if it is a msgspec Struct type. A Struct type without one stops the
    /// walk: `obj` is kept in `unplanned` for `State::encode` to plan once the walk is over.
    ///
    /// # Safety
    /// As for every walk method (see `Encoder`), and `ty` is `obj`'s type.
    unsafe fn plan_for(
        &mut self,
        obj: *mut ffi::PyObject,
        ty: *mut ffi::PyTypeObject,
    ) -> PyResult<Option<&'a Plan>> {
        let plans: &'a [Plan] = self.plans;
        if let Some(plan) = plans.iter().find(|p| p.ty == ty) {
            return Ok(Some(plan));
        }
        // SAFETY: `ty` is a live type object, as is msgspec's metaclass (held by SETUP);
        // the subtype test reads their MROs without running Python code.
        let is_struct = unsafe {
            let meta = ffi::Py_TYPE(ty as *mut ffi::PyObject);
            meta == self.struct_meta || ffi::PyType_IsSubtype(meta, self.struct_meta) != 0
        };
        if !is_struct {
            return Ok(None);
        }
        if self.plans.len() >= MAX_PLANS {
            return Err(PyTypeError::new_err(format!(
                "the native encoder caches at most {MAX_PLANS} Struct types"
            )));
        }
        // SAFETY: `obj` is live; taking a reference to it runs no Python code.
        self.unplanned = Some(unsafe { Py::from_borrowed_ptr(self.py, obj) });
        Err(PyTypeError::new_err("the walk stops to plan a Struct type"))
    }
}
