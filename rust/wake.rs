//! Waking the publisher's loop from the engine thread without giving up the GIL.
//!
//! `os.write` / `os.eventfd_write` / asyncio's `call_soon_threadsafe` release the GIL around the
//! syscall; the loop thread, just woken by that very write, then takes the GIL and the engine
//! thread waits for it to let go again -- tens to hundreds of microseconds inside `publish()`.
//! Writing here, with the GIL held, costs the syscall only; the loop runs when the engine next
//! releases the GIL (it sleeps, waits on the GPU, or hits the switch interval).

use std::fs::File;
use std::io::Write;
use std::mem::ManuallyDrop;
use std::os::fd::FromRawFd;

use pyo3::prelude::*;

/// Add 1 to the eventfd `fd` (non-blocking). False when the write failed (closed fd, EAGAIN).
#[pyfunction]
fn eventfd_signal(fd: i32) -> bool {
    if fd < 0 {
        return false;
    }
    // SAFETY: the File is never dropped, so the caller's fd is not closed; a stale fd number
    // only makes the write fail or hit another eventfd-sized write, which the caller rules out
    // by closing the fd only after the last publish() can have read it.
    let file = ManuallyDrop::new(unsafe { File::from_raw_fd(fd) });
    (&*file).write(&1u64.to_ne_bytes()).is_ok()
}

pub fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_function(wrap_pyfunction!(eventfd_signal, m)?)
}
