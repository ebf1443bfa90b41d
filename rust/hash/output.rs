//! Delivering hashes to Python: a list of ints or bytes, or a caller's uint64 buffer.

use pyo3::exceptions::{PyTypeError, PyValueError};
use pyo3::ffi;
use pyo3::prelude::*;
use pyo3::types::PyList;

use super::algo::Digest;
use super::buffer::Buffer;

/// Where digests go, filled in order as they are produced.
pub enum Output<'py> {
    List {
        list: Bound<'py, PyList>,
        as_bytes: bool,
        next: usize,
    },
    Buffer {
        buffer: Buffer,
        next: usize,
    },
}

impl<'py> Output<'py> {
    pub fn new(
        py: Python<'py>,
        n_blocks: usize,
        as_bytes: bool,
        out: Option<&Bound<'py, PyAny>>,
    ) -> PyResult<Self> {
        if let Some(o) = out {
            return Ok(Output::Buffer {
                buffer: out_buffer(o, n_blocks, as_bytes)?,
                next: 0,
            });
        }
        // SAFETY: a new list of n NULL slots; every slot is set by push before it is returned,
        // and a list dropped half-filled releases its NULL slots safely.
        let list = unsafe {
            Bound::from_owned_ptr_or_err(py, ffi::PyList_New(n_blocks as ffi::Py_ssize_t))?
        };
        Ok(Output::List {
            list: list.cast_into()?,
            as_bytes,
            next: 0,
        })
    }

    pub fn push(&mut self, digests: &[Digest]) -> PyResult<()> {
        match self {
            Output::List {
                list,
                as_bytes,
                next,
            } => {
                for d in digests {
                    // SAFETY: slot *next is in range (n_blocks digests in total) and still NULL;
                    // PyList_SetItem steals the new reference.
                    unsafe {
                        let item = if *as_bytes {
                            let b = d.as_bytes();
                            ffi::PyBytes_FromStringAndSize(
                                b.as_ptr().cast(),
                                b.len() as ffi::Py_ssize_t,
                            )
                        } else {
                            ffi::PyLong_FromUnsignedLongLong(d.event_hash())
                        };
                        if item.is_null() {
                            return Err(PyErr::fetch(list.py()));
                        }
                        ffi::PyList_SetItem(list.as_ptr(), *next as ffi::Py_ssize_t, item);
                    }
                    *next += 1;
                }
            }
            Output::Buffer { .. } if digests.is_empty() => {}
            Output::Buffer { buffer, next } => {
                // SAFETY: out_buffer checked an aligned, contiguous, writable u64 buffer with room
                // for every block (so it is not empty here); the export is held.
                let dst = unsafe {
                    std::slice::from_raw_parts_mut(buffer.ptr() as *mut u64, buffer.len())
                };
                for (slot, d) in dst[*next..].iter_mut().zip(digests) {
                    *slot = d.event_hash();
                }
                *next += digests.len();
            }
        }
        Ok(())
    }

    /// The list, or the number of hashes written to the buffer.
    pub fn finish(self, py: Python<'py>) -> PyResult<Bound<'py, PyAny>> {
        match self {
            Output::List { list, .. } => Ok(list.into_any()),
            Output::Buffer { next, .. } => Ok(next.into_pyobject(py)?.into_any()),
        }
    }
}

/// The `out` argument: a writable, contiguous, native uint64 buffer with room for every block.
fn out_buffer(out: &Bound<'_, PyAny>, n_blocks: usize, as_bytes: bool) -> PyResult<Buffer> {
    if as_bytes {
        return Err(PyValueError::new_err(
            "out receives 64-bit hashes; it cannot be combined with as_bytes=True",
        ));
    }
    let buffer = Buffer::get(out, ffi::PyBUF_WRITABLE | ffi::PyBUF_C_CONTIGUOUS)?;
    let native_u64 = buffer
        .int_layout()
        .is_some_and(|l| l.size == 8 && !l.signed && !l.swap);
    // An empty export may point anywhere (array.array's is a static byte), so only a buffer that
    // will be written must be aligned.
    let aligned = buffer.len() == 0 || (buffer.ptr() as usize).is_multiple_of(8);
    if !native_u64 || !aligned {
        return Err(PyTypeError::new_err(format!(
            "out must be an aligned native uint64 buffer (numpy uint64, array('Q')), not format '{}'",
            buffer.format()
        )));
    }
    if buffer.len() < n_blocks {
        return Err(PyValueError::new_err(format!(
            "out has room for {} hashes but the tokens make {n_blocks} full blocks",
            buffer.len()
        )));
    }
    Ok(buffer)
}
