//! 1-D buffer-protocol exports (array.array, numpy, memoryview) without importing numpy.

use std::cell::Cell;
use std::ffi::CStr;
use std::mem::ManuallyDrop;

use pyo3::exceptions::PyBufferError;
use pyo3::ffi;
use pyo3::prelude::*;

/// A held buffer export, released on drop. Boxed because exporters may point `shape`/`strides`
/// into the Py_buffer itself. Not Send: the release needs the GIL.
pub struct Buffer {
    /// Taken back in drop, to be kept for the next export.
    view: ManuallyDrop<Box<ffi::Py_buffer>>,
}

thread_local! {
    /// A released export's box, for the thread's next export: a query exports one buffer per
    /// call, and its allocation and free were a measurable part of a ~1 us call.
    static SPARE: Cell<Option<Box<ffi::Py_buffer>>> = const { Cell::new(None) };
}

/// How integer items are laid out, from the struct-module format string.
#[derive(Clone, Copy)]
pub struct IntLayout {
    pub size: usize,
    pub signed: bool,
    /// Stored in the other byte order than this machine's.
    pub swap: bool,
}

impl Buffer {
    /// Exports `obj` with `flags`, which must include PyBUF_ND (so shape is filled in).
    pub fn get(obj: &Bound<'_, PyAny>, flags: i32) -> PyResult<Buffer> {
        let mut view = match SPARE.try_with(Cell::take).ok().flatten() {
            Some(mut spare) => {
                *spare = ffi::Py_buffer::new();
                spare
            }
            None => Box::new(ffi::Py_buffer::new()),
        };
        // SAFETY: view is a valid out-pointer; on success Drop releases the export.
        if unsafe { ffi::PyObject_GetBuffer(obj.as_ptr(), &mut *view, flags | ffi::PyBUF_FORMAT) }
            != 0
        {
            keep_spare(view);
            return Err(PyErr::fetch(obj.py()));
        }
        let buffer = Buffer {
            view: ManuallyDrop::new(view),
        };
        if buffer.view.ndim != 1 {
            let ndim = buffer.view.ndim;
            return Err(PyBufferError::new_err(format!(
                "buffer must be 1-dimensional, not {ndim}-dimensional"
            )));
        }
        Ok(buffer)
    }

    pub fn len(&self) -> usize {
        // SAFETY: ndim == 1 and PyBUF_ND was requested, so shape has one entry.
        unsafe { *self.view.shape as usize }
    }

    /// Bytes between items (the item size unless strides were requested and differ).
    pub fn stride(&self) -> isize {
        if self.view.strides.is_null() {
            self.view.itemsize
        } else {
            // SAFETY: ndim == 1, so strides has one entry.
            unsafe { *self.view.strides }
        }
    }

    pub fn ptr(&self) -> *mut u8 {
        self.view.buf as *mut u8
    }

    pub fn itemsize(&self) -> usize {
        self.view.itemsize as usize
    }

    pub fn format(&self) -> &str {
        if self.view.format.is_null() {
            return "B";
        }
        // SAFETY: a non-null format is a NUL-terminated string owned by the export.
        unsafe { CStr::from_ptr(self.view.format) }
            .to_str()
            .unwrap_or("?")
    }

    /// The layout if the items are 32- or 64-bit integers.
    pub fn int_layout(&self) -> Option<IntLayout> {
        let (prefix, code) = match self.format().as_bytes() {
            [c] => (b'@', *c),
            [p @ (b'@' | b'=' | b'<' | b'>' | b'!'), c] => (*p, *c),
            _ => return None,
        };
        let size = self.itemsize();
        if !b"iIlLqQnN".contains(&code) || !(size == 4 || size == 8) {
            return None;
        }
        let big = matches!(prefix, b'>' | b'!');
        let little = prefix == b'<';
        Some(IntLayout {
            size,
            signed: code.is_ascii_lowercase(),
            swap: if cfg!(target_endian = "little") {
                big
            } else {
                little
            },
        })
    }
}

impl Drop for Buffer {
    fn drop(&mut self) {
        // SAFETY: the view was filled by a successful PyObject_GetBuffer, and Buffer is !Send,
        // so this runs where the GIL is held.
        unsafe { ffi::PyBuffer_Release(&mut **self.view) }
        // SAFETY: the view is not used again. Released, nothing points into the box any more.
        keep_spare(unsafe { ManuallyDrop::take(&mut self.view) });
    }
}

fn keep_spare(view: Box<ffi::Py_buffer>) {
    // The thread may be exiting, in which case the box is simply freed.
    let _ = SPARE.try_with(|spare| spare.set(Some(view)));
}
