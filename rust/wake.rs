//! Waking the publisher's loop from the engine thread without giving up the GIL.
//!
//! `os.write` / `os.eventfd_write` / asyncio's `call_soon_threadsafe` release the GIL around the
//! syscall; the loop thread, just woken by that very write, then takes the GIL and the engine
//! thread waits for it to let go again -- tens to hundreds of microseconds inside `publish()`.
//! Writing here, with the GIL held, costs the syscall only; the loop runs when the engine next
//! releases the GIL (it sleeps, waits on the GPU, or hits the switch interval).

use std::fs::File;
use std::io::{Read, Write};
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

/// Reset the eventfd (or timerfd) `fd` by reading its counter, with the GIL held (non-blocking,
/// so the read never waits). True when it had been signalled. `os.read` would release the GIL
/// around the syscall: the engine thread that just signalled, still holding the GIL, would be
/// handed it back and forth, and the read allocates a bytes object nobody looks at.
#[pyfunction]
fn eventfd_consume(fd: i32) -> bool {
    if fd < 0 {
        return false;
    }
    let mut buf = [0u8; 8];
    // SAFETY: as in `eventfd_signal`, the File is never dropped: the caller's fd stays open.
    let file = ManuallyDrop::new(unsafe { File::from_raw_fd(fd) });
    matches!((&*file).read(&mut buf), Ok(8))
}

#[repr(C)]
struct Timespec {
    tv_sec: i64,
    tv_nsec: i64,
}

#[repr(C)]
struct Itimerspec {
    interval: Timespec,
    value: Timespec,
}

extern "C" {
    fn timerfd_create(clockid: i32, flags: i32) -> i32;
    fn timerfd_settime(fd: i32, flags: i32, new: *const Itimerspec, old: *mut Itimerspec) -> i32;
}

const CLOCK_MONOTONIC: i32 = 1;
const TFD_NONBLOCK: i32 = 0o4000;
const TFD_CLOEXEC: i32 = 0o2000000;

/// A non-blocking, close-on-exec timerfd (Python < 3.13 has no os.timerfd_create); -1 on error.
/// asyncio's epoll selector rounds timeouts up to whole milliseconds; a timerfd registered as a
/// reader fires at the interval asked for.
#[pyfunction]
fn timerfd_new() -> i32 {
    // SAFETY: plain syscall wrapper, no pointers.
    unsafe { timerfd_create(CLOCK_MONOTONIC, TFD_NONBLOCK | TFD_CLOEXEC) }
}

/// Arm `fd` to fire every `interval_ns` (0 disarms it). False on error.
#[pyfunction]
fn timerfd_every(fd: i32, interval_ns: u64) -> bool {
    let ts = Timespec {
        tv_sec: (interval_ns / 1_000_000_000) as i64,
        tv_nsec: (interval_ns % 1_000_000_000) as i64,
    };
    let spec = Itimerspec {
        interval: Timespec {
            tv_sec: ts.tv_sec,
            tv_nsec: ts.tv_nsec,
        },
        value: ts,
    };
    // SAFETY: `spec` outlives the call; a null `old` is allowed.
    unsafe { timerfd_settime(fd, 0, &spec, std::ptr::null_mut()) == 0 }
}

pub fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_function(wrap_pyfunction!(eventfd_signal, m)?)?;
    m.add_function(wrap_pyfunction!(eventfd_consume, m)?)?;
    m.add_function(wrap_pyfunction!(timerfd_new, m)?)?;
    m.add_function(wrap_pyfunction!(timerfd_every, m)?)
}
