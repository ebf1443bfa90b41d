//! msgpack encoding of KV event batches, byte-identical to `msgspec.msgpack.Encoder().encode`.
//!
//! The bytes are vLLM's wire format, so every msgspec choice that shows in them is copied:
//! the smallest int form (negative fixint down to -32, unsigned forms for anything >= 0),
//! float64 for every float, str8 from 32 bytes, bin8 even for short bytes, headers sized by
//! count, and for a map-encoded struct a header sized for *all* its fields plus the tag, then
//! patched down to the number written when `omit_defaults` skipped some. That last rule is
//! why BlockStored (15 fields + tag) always starts with a map16 header `de 00 nn`.
//!
//! Speed comes from doing what msgspec does without its private C access: struct fields are
//! read straight from the instance slots at the offsets the type records for them (checked
//! against `getattr` once per type), keys are pre-encoded once per type, and the output
//! buffer is reused across calls. Anything outside the supported value set raises TypeError
//! before a single wrong byte could be returned, so callers can fall back to msgspec.

use std::cell::RefCell;
use std::ffi::CStr;
use std::os::raw::c_int;
use std::ptr::addr_of_mut;
use std::rc::Rc;

use pyo3::exceptions::{PyAttributeError, PyOverflowError, PyTypeError};
use pyo3::ffi;
use pyo3::prelude::*;
use pyo3::sync::PyOnceLock;
use pyo3::types::{PyBytes, PyTuple, PyType};

mod cpython;

/// msgspec recurses up to Python's recursion limit; past this depth we hand over to it.
const MAX_DEPTH: u32 = 256;
/// Distinct Struct types remembered per thread; beyond it the types are almost certainly
/// generated on the fly, and msgspec is the better tool.
const MAX_PLANS: usize = 64;
/// A one-off huge batch should not pin its buffer for the life of the thread.
const KEEP_BUFFER_BYTES: usize = 8 << 20;

/// Encode `batch` (normally a `KVEventBatch`) to the exact bytes msgspec's msgpack encoder writes.
#[pyfunction]
pub fn encode_batch_msgpack<'py>(
    py: Python<'py>,
    batch: &Bound<'py, PyAny>,
) -> PyResult<Bound<'py, PyBytes>> {
    let setup = setup(py)?;
    STATE.with(|cell| match cell.try_borrow_mut() {
        Ok(mut state) => state.encode(py, setup, batch),
        // Only reachable if Python code run while planning a type re-enters the encoder.
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

// --- msgpack writers (the byte rules; no Python here) ---------------------------------------

/// The int marker for a value needing `bits` bits (9..=64 are the ones used). The payload width
/// is in the marker's low two bits: uint8..uint64 are 0xcc..0xcf, int8..int64 0xd0..0xd3.
/// Token ids straddle the uint16/uint32 boundary at random, so a lookup beats a branch there.
const fn size_classes(signed: bool) -> [u8; 65] {
    let mut table = [0u8; 65];
    let mut bits = 0;
    while bits <= 64 {
        let marker = match bits {
            0..=8 => 0xcc,
            9..=16 => 0xcd,
            17..=32 => 0xce,
            _ => 0xcf,
        };
        table[bits] = if signed { marker + 4 } else { marker };
        bits += 1;
    }
    table
}

const UINT_CLASS: [u8; 65] = size_classes(false);
const INT_CLASS: [u8; 65] = size_classes(true);

/// Marker plus the low bytes of `v` the marker calls for, big-endian, with one unconditional
/// 8-byte store.
#[inline(always)]
fn put_sized(out: &mut Vec<u8>, marker: u8, v: u64) {
    let width = 1usize << (marker & 3);
    out.reserve(9);
    // SAFETY: 9 bytes are reserved; only 1 + width of them become part of the vector.
    unsafe {
        let len = out.len();
        let p = out.as_mut_ptr().add(len);
        *p = marker;
        std::ptr::write_unaligned(p.add(1) as *mut [u8; 8], (v << (64 - 8 * width)).to_be_bytes());
        out.set_len(len + 1 + width);
    }
}

#[inline(always)]
fn put_uint(out: &mut Vec<u8>, v: u64) {
    if v < 0x80 {
        out.push(v as u8);
    } else {
        put_sized(out, UINT_CLASS[(64 - v.leading_zeros()) as usize], v);
    }
}

#[inline(always)]
fn put_int(out: &mut Vec<u8>, v: i64) {
    if v >= 0 {
        put_uint(out, v as u64);
    } else if v >= -32 {
        out.push(v as u8);
    } else {
        // A negative v fits a signed width w when !v needs at most w - 1 bits.
        put_sized(out, INT_CLASS[(65 - (!v).leading_zeros()) as usize], v as u64);
    }
}

/// Header of a str/bin/array/map. `fix` is the fix-form base and `fix_max` its exclusive
/// bound (bin has no fix form); `first` is the 8-bit form's marker (0 when there is none).
fn put_header(out: &mut Vec<u8>, len: usize, fix: u8, fix_max: usize, first: u8, wide: [u8; 2]) -> PyResult<()> {
    if len < fix_max {
        out.push(fix | len as u8);
    } else if first != 0 && len <= 0xff {
        out.extend_from_slice(&[first, len as u8]);
    } else if len <= 0xffff {
        out.push(wide[0]);
        out.extend_from_slice(&(len as u16).to_be_bytes());
    } else if len <= 0xffff_ffff {
        out.push(wide[1]);
        out.extend_from_slice(&(len as u32).to_be_bytes());
    } else {
        return Err(PyTypeError::new_err("msgpack cannot hold a value longer than 2**32 - 1"));
    }
    Ok(())
}

fn put_str(out: &mut Vec<u8>, s: &[u8]) -> PyResult<()> {
    put_header(out, s.len(), 0xa0, 32, 0xd9, [0xda, 0xdb])?;
    out.extend_from_slice(s);
    Ok(())
}

fn put_bin(out: &mut Vec<u8>, b: &[u8]) -> PyResult<()> {
    put_header(out, b.len(), 0, 0, 0xc4, [0xc5, 0xc6])?;
    out.extend_from_slice(b);
    Ok(())
}

fn put_array_header(out: &mut Vec<u8>, len: usize) -> PyResult<()> {
    put_header(out, len, 0x90, 16, 0, [0xdc, 0xdd])
}

fn put_map_header(out: &mut Vec<u8>, len: usize) -> PyResult<()> {
    put_header(out, len, 0x80, 16, 0, [0xde, 0xdf])
}

/// Rewrite the count of a map header written for `sized_for` entries, keeping its width.
fn patch_map_header(out: &mut [u8], at: usize, sized_for: usize, count: usize) {
    if sized_for < 16 {
        out[at] = 0x80 | count as u8;
    } else if sized_for <= 0xffff {
        out[at + 1..at + 3].copy_from_slice(&(count as u16).to_be_bytes());
    } else {
        out[at + 1..at + 5].copy_from_slice(&(count as u32).to_be_bytes());
    }
}

// --- per-type plans ----------------------------------------------------------------------

struct Field {
    /// The encoded name (msgpack str), written as-is in map mode.
    key: Vec<u8>,
    offset: isize,
    attr: String,
}

/// How to write one msgspec Struct type, derived once from its `__struct_config__`.
struct Plan {
    /// Owned reference, never released, so the address can never name another type.
    ty: *mut ffi::PyTypeObject,
    array_like: bool,
    /// Fields plus the tag: sizes the header even when fields are omitted.
    len: usize,
    /// Written right after the header: the tag value (array) or tag key and value (map).
    prefix: Vec<u8>,
    fields: Vec<Field>,
    /// Fields from here on are skipped when None (map mode with `omit_defaults`).
    omit_none_from: usize,
}

/// What every call needs from the interpreter, looked up once.
struct Setup {
    struct_meta: Py<PyAny>,
    unset: Py<PyAny>,
    layout: cpython::Layout,
}

static SETUP: PyOnceLock<Setup> = PyOnceLock::new();

fn setup(py: Python<'_>) -> PyResult<&'static Setup> {
    SETUP.get_or_try_init(py, || {
        let msgspec = py.import("msgspec")?;
        Ok(Setup {
            struct_meta: msgspec.getattr("Struct")?.get_type().into_any().unbind(),
            unset: msgspec.getattr("UNSET")?.unbind(),
            layout: cpython::detect(py),
        })
    })
}

#[derive(Default)]
struct State {
    buf: Vec<u8>,
    plans: Vec<Rc<Plan>>,
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
        self.buf.clear();
        let mut enc = Encoder {
            py,
            out: &mut self.buf,
            plans: &mut self.plans,
            struct_meta: setup.struct_meta.as_ptr() as *mut ffi::PyTypeObject,
            unset: setup.unset.as_ptr(),
            layout: setup.layout,
            depth: 0,
        };
        // SAFETY: `obj` is a live object and the GIL is held for the whole encode; nothing
        // below runs Python code that could mutate the containers being walked.
        unsafe { enc.value(obj.as_ptr())? };
        let bytes = PyBytes::new(py, &self.buf);
        if self.buf.capacity() > KEEP_BUFFER_BYTES {
            self.buf = Vec::new();
        }
        Ok(bytes)
    }
}

struct Encoder<'a, 'py> {
    py: Python<'py>,
    out: &'a mut Vec<u8>,
    plans: &'a mut Vec<Rc<Plan>>,
    struct_meta: *mut ffi::PyTypeObject,
    unset: *mut ffi::PyObject,
    layout: cpython::Layout,
    depth: u32,
}

impl Encoder<'_, '_> {
    unsafe fn value(&mut self, obj: *mut ffi::PyObject) -> PyResult<()> {
        let ty = ffi::Py_TYPE(obj);
        // Exact types only, like msgspec: an int/str/float subclass is not silently flattened.
        if ty == addr_of_mut!(ffi::PyLong_Type) {
            self.int(obj)
        } else if ty == addr_of_mut!(ffi::PyUnicode_Type) {
            self.str(obj)
        } else if ty == addr_of_mut!(ffi::PyList_Type) {
            self.list(obj)
        } else if obj == ffi::Py_None() {
            self.out.push(0xc0);
            Ok(())
        } else if ty == addr_of_mut!(ffi::PyFloat_Type) {
            let x = ffi::PyFloat_AsDouble(obj);
            self.out.push(0xcb);
            self.out.extend_from_slice(&x.to_bits().to_be_bytes());
            Ok(())
        } else if ty == addr_of_mut!(ffi::PyBool_Type) {
            self.out.push(if obj == ffi::Py_True() { 0xc3 } else { 0xc2 });
            Ok(())
        } else if ty == addr_of_mut!(ffi::PyBytes_Type) {
            let data = ffi::PyBytes_AsString(obj) as *const u8;
            let len = ffi::PyBytes_Size(obj) as usize;
            put_bin(self.out, std::slice::from_raw_parts(data, len))
        } else if ty == addr_of_mut!(ffi::PyTuple_Type) {
            self.tuple(obj)
        } else if ty == addr_of_mut!(ffi::PyDict_Type) {
            self.dict(obj)
        } else if ty == addr_of_mut!(ffi::PyByteArray_Type) {
            let data = ffi::PyByteArray_AsString(obj) as *const u8;
            let len = ffi::PyByteArray_Size(obj) as usize;
            put_bin(self.out, std::slice::from_raw_parts(data, len))
        } else {
            self.uncommon(obj, ty)
        }
    }

    unsafe fn uncommon(&mut self, obj: *mut ffi::PyObject, ty: *mut ffi::PyTypeObject) -> PyResult<()> {
        if let Some(plan) = self.plan_for(obj, ty)? {
            return self.strukt(obj, &plan);
        }
        // Subclasses msgspec also writes as their base container.
        if ffi::PyList_Check(obj) != 0 {
            self.list(obj)
        } else if ffi::PyTuple_Check(obj) != 0 {
            self.tuple(obj)
        } else if ffi::PyDict_Check(obj) != 0 {
            self.dict(obj)
        } else {
            let name = Bound::from_borrowed_ptr(self.py, obj).get_type().name()?;
            Err(PyTypeError::new_err(format!(
                "the native encoder cannot represent a value of type {name}"
            )))
        }
    }

    #[inline(always)]
    unsafe fn int(&mut self, obj: *mut ffi::PyObject) -> PyResult<()> {
        match cpython::int_parts(self.layout, obj) {
            Some((false, magnitude)) => put_uint(self.out, magnitude),
            Some((true, magnitude)) if magnitude <= 1 << 63 => put_int(self.out, magnitude.wrapping_neg() as i64),
            _ => return self.int_via_api(obj),
        }
        Ok(())
    }

    #[inline(never)]
    unsafe fn int_via_api(&mut self, obj: *mut ffi::PyObject) -> PyResult<()> {
        let mut overflow: c_int = 0;
        let v = ffi::PyLong_AsLongLongAndOverflow(obj, &mut overflow);
        if overflow == 0 {
            put_int(self.out, v);
            return Ok(());
        }
        if overflow > 0 {
            let u = ffi::PyLong_AsUnsignedLongLong(obj);
            if u != u64::MAX || ffi::PyErr_Occurred().is_null() {
                put_uint(self.out, u);
                return Ok(());
            }
            ffi::PyErr_Clear();
        }
        // msgspec's own error for the same value.
        Err(PyOverflowError::new_err("can't serialize ints < -2**63 or > 2**64 - 1"))
    }

    unsafe fn str(&mut self, obj: *mut ffi::PyObject) -> PyResult<()> {
        let mut len: ffi::Py_ssize_t = 0;
        let data = ffi::PyUnicode_AsUTF8AndSize(obj, &mut len);
        if data.is_null() {
            return Err(PyErr::fetch(self.py)); // lone surrogates: msgspec fails the same way
        }
        put_str(self.out, std::slice::from_raw_parts(data as *const u8, len as usize))
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

    unsafe fn list(&mut self, obj: *mut ffi::PyObject) -> PyResult<()> {
        let len = ffi::PyList_Size(obj);
        put_array_header(self.out, len as usize)?;
        self.enter()?;
        match cpython::list_items(self.layout, obj) {
            Some(items) => items.iter().try_for_each(|&item| self.item(item))?,
            None => (0..len).try_for_each(|i| self.item(ffi::PyList_GetItem(obj, i)))?,
        }
        self.depth -= 1;
        Ok(())
    }

    /// A list item. Token id lists are most of a batch: their ints skip the general dispatch.
    #[inline(always)]
    unsafe fn item(&mut self, item: *mut ffi::PyObject) -> PyResult<()> {
        if ffi::Py_TYPE(item) == addr_of_mut!(ffi::PyLong_Type) {
            self.int(item)
        } else {
            self.value(item)
        }
    }

    unsafe fn tuple(&mut self, obj: *mut ffi::PyObject) -> PyResult<()> {
        let len = ffi::PyTuple_Size(obj);
        put_array_header(self.out, len as usize)?;
        self.enter()?;
        for i in 0..len {
            self.value(ffi::PyTuple_GetItem(obj, i))?;
        }
        self.depth -= 1;
        Ok(())
    }

    unsafe fn dict(&mut self, obj: *mut ffi::PyObject) -> PyResult<()> {
        put_map_header(self.out, ffi::PyDict_Size(obj) as usize)?;
        self.enter()?;
        let (mut pos, mut key, mut val) = (0, std::ptr::null_mut(), std::ptr::null_mut());
        while ffi::PyDict_Next(obj, &mut pos, &mut key, &mut val) != 0 {
            // msgspec accepts str subclasses as keys (not as values).
            if ffi::PyUnicode_Check(key) != 0 {
                self.str(key)?;
            } else {
                self.value(key)?;
            }
            self.value(val)?;
        }
        self.depth -= 1;
        Ok(())
    }

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
        for (i, field) in plan.fields.iter().enumerate() {
            let val = *((obj as *const u8).offset(field.offset) as *const *mut ffi::PyObject);
            if val.is_null() {
                return Err(PyAttributeError::new_err(format!("Struct field {:?} is unset", field.attr)));
            }
            if !plan.array_like {
                if val == self.unset || (i >= plan.omit_none_from && val == ffi::Py_None()) {
                    continue;
                }
                self.out.extend_from_slice(&field.key);
            } else if val == self.unset {
                return Err(PyTypeError::new_err("the native encoder cannot write UNSET in an array-like Struct"));
            }
            self.value(val)?;
            written += 1;
        }
        if written != plan.len {
            patch_map_header(self.out, header_at, plan.len, written);
        }
        self.depth -= 1;
        Ok(())
    }

    /// The plan for `ty` if it is a msgspec Struct type, building it on first sight.
    unsafe fn plan_for(&mut self, obj: *mut ffi::PyObject, ty: *mut ffi::PyTypeObject) -> PyResult<Option<Rc<Plan>>> {
        if let Some(plan) = self.plans.iter().find(|p| p.ty == ty) {
            return Ok(Some(plan.clone()));
        }
        let meta = ffi::Py_TYPE(ty as *mut ffi::PyObject);
        if meta != self.struct_meta && ffi::PyType_IsSubtype(meta, self.struct_meta) == 0 {
            return Ok(None);
        }
        if self.plans.len() >= MAX_PLANS {
            return Err(PyTypeError::new_err(format!("the native encoder caches at most {MAX_PLANS} Struct types")));
        }
        let plan = Rc::new(build_plan(Bound::from_borrowed_ptr(self.py, obj))?);
        ffi::Py_IncRef(ty as *mut ffi::PyObject);
        self.plans.push(plan.clone());
        Ok(Some(plan))
    }
}

fn build_plan(obj: Bound<'_, PyAny>) -> PyResult<Plan> {
    let ty = obj.get_type();
    let unsupported = |why: &str| {
        PyTypeError::new_err(format!("the native encoder cannot write {}: {why}", ty.name().map(|n| n.to_string()).unwrap_or_default()))
    };
    let config = ty.getattr("__struct_config__")?;
    let array_like: bool = config.getattr("array_like")?.extract()?;
    let omit_defaults: bool = config.getattr("omit_defaults")?.extract()?;
    let tag = config.getattr("tag")?;
    let names = ty.getattr("__struct_fields__")?.cast_into::<PyTuple>()?;
    let keys = ty.getattr("__struct_encode_fields__")?.cast_into::<PyTuple>()?;
    let defaults = ty.getattr("__struct_defaults__")?.cast_into::<PyTuple>()?;

    let mut omit_none_from = names.len();
    if omit_defaults && !array_like {
        // msgspec compares against each default; only None defaults reduce to a pointer test.
        if defaults.iter().any(|d| !d.is_none()) {
            return Err(unsupported("omit_defaults with a default other than None"));
        }
        omit_none_from = names.len() - defaults.len();
    }

    let mut prefix = Vec::new();
    if !tag.is_none() {
        if !array_like {
            put_str(&mut prefix, config.getattr("tag_field")?.extract::<String>()?.as_bytes())?;
        }
        if let Ok(s) = tag.extract::<String>() {
            put_str(&mut prefix, s.as_bytes())?;
        } else {
            put_int(&mut prefix, tag.extract::<i64>()?);
        }
    }

    let slots = slot_offsets(&ty)?;
    let mut fields = Vec::with_capacity(names.len());
    for (name, key) in names.iter().zip(keys.iter()) {
        let attr: String = name.extract()?;
        let offset = slots
            .iter()
            .find(|(n, _)| *n == attr)
            .map(|(_, off)| *off)
            .ok_or_else(|| unsupported(&format!("field {attr:?} is not a plain slot")))?;
        // The one check that the slot really holds what getattr returns, before trusting it.
        let via_getattr = obj.getattr(attr.as_str())?;
        let in_slot = unsafe { *((obj.as_ptr() as *const u8).offset(offset) as *const *mut ffi::PyObject) };
        if via_getattr.as_ptr() != in_slot {
            return Err(unsupported(&format!("field {attr:?} does not live in its slot")));
        }
        let mut encoded = Vec::new();
        put_str(&mut encoded, key.extract::<String>()?.as_bytes())?;
        fields.push(Field { key: encoded, offset, attr });
    }
    Ok(Plan {
        ty: ty.as_ptr() as *mut ffi::PyTypeObject,
        array_like,
        len: fields.len() + usize::from(!tag.is_none()),
        prefix,
        fields,
        omit_none_from,
    })
}

/// (name, offset) of every writable object slot declared along `ty`'s MRO.
fn slot_offsets(ty: &Bound<'_, PyType>) -> PyResult<Vec<(String, isize)>> {
    let mut slots = Vec::new();
    for base in ty.getattr("__mro__")?.cast_into::<PyTuple>()?.iter() {
        // SAFETY: a type's tp_members is a NULL-name-terminated PyMemberDef array or NULL.
        unsafe {
            let mut member = ffi::PyType_GetSlot(base.as_ptr() as *mut ffi::PyTypeObject, ffi::Py_tp_members)
                as *const ffi::PyMemberDef;
            while !member.is_null() && !(*member).name.is_null() {
                let m = &*member;
                if m.type_code == ffi::Py_T_OBJECT_EX && m.flags & ffi::Py_READONLY == 0 {
                    let name = CStr::from_ptr(m.name).to_string_lossy().into_owned();
                    slots.push((name, m.offset as isize));
                }
                member = member.add(1);
            }
        }
    }
    Ok(slots)
}
