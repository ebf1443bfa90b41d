//! How one msgspec Struct type is written, derived once from its `__struct_config__`.

use std::ffi::CStr;

use pyo3::exceptions::PyTypeError;
use pyo3::ffi;
use pyo3::prelude::*;
use pyo3::types::{PyTuple, PyType};

use super::msgpack::{put_int, put_str};

pub struct Field {
    /// The encoded name (msgpack str), written as-is in map mode.
    pub key: Vec<u8>,
    pub offset: isize,
    pub attr: String,
}

/// How to write one msgspec Struct type, derived once from its `__struct_config__`.
pub struct Plan {
    /// An owned reference, never released (see `build_plan`).
    pub ty: *mut ffi::PyTypeObject,
    pub array_like: bool,
    /// Fields plus the tag: sizes the header even when fields are omitted.
    pub len: usize,
    /// Written right after the header: the tag value (array) or tag key and value (map).
    pub prefix: Vec<u8>,
    pub fields: Vec<Field>,
    /// Fields from here on are skipped when None (map mode with `omit_defaults`).
    pub omit_none_from: usize,
}

/// The plan for `obj`'s type; `obj` itself proves each slot offset once. The plan keeps its
/// type alive for good, so the address it is looked up by can never name another type.
pub fn build_plan(obj: Bound<'_, PyAny>) -> PyResult<Plan> {
    let ty = obj.get_type();
    let unsupported = |why: &str| {
        PyTypeError::new_err(format!(
            "the native encoder cannot write {}: {why}",
            ty.name().map(|n| n.to_string()).unwrap_or_default()
        ))
    };
    let config = ty.getattr("__struct_config__")?;
    let array_like: bool = config.getattr("array_like")?.extract()?;
    let omit_defaults: bool = config.getattr("omit_defaults")?.extract()?;
    let tag = config.getattr("tag")?;
    let names = ty.getattr("__struct_fields__")?.cast_into::<PyTuple>()?;
    let keys = ty
        .getattr("__struct_encode_fields__")?
        .cast_into::<PyTuple>()?;
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
            put_str(
                &mut prefix,
                config.getattr("tag_field")?.extract::<String>()?.as_bytes(),
            )?;
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
        // SAFETY: `offset` is a writable object slot (Py_T_OBJECT_EX) that `ty`'s MRO declares,
        // so it lies inside every instance of `ty` and holds an object pointer or NULL.
        let in_slot =
            unsafe { *((obj.as_ptr() as *const u8).offset(offset) as *const *mut ffi::PyObject) };
        if via_getattr.as_ptr() != in_slot {
            return Err(unsupported(&format!(
                "field {attr:?} does not live in its slot"
            )));
        }
        let mut encoded = Vec::new();
        put_str(&mut encoded, key.extract::<String>()?.as_bytes())?;
        fields.push(Field {
            key: encoded,
            offset,
            attr,
        });
    }
    Ok(Plan {
        ty: ty.clone().unbind().into_ptr() as *mut ffi::PyTypeObject,
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
            let mut member =
                ffi::PyType_GetSlot(base.as_ptr() as *mut ffi::PyTypeObject, ffi::Py_tp_members)
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
