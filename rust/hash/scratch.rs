//! Per-thread vectors reused across calls. A fresh multi-megabyte Vec per call is mmapped by the
//! allocator and page-faulted in zeroed pages every time, which cost more than the hashing.

use std::cell::Cell;
use std::ops::{Deref, DerefMut};
use std::thread::LocalKey;

/// Larger vectors are freed rather than kept, so one huge call does not pin its memory.
const KEEP_MAX_BYTES: usize = 16 << 20;

pub type Home<T> = LocalKey<Cell<Vec<T>>>;

/// A vector borrowed from this thread's pool, returned (emptied) on drop. A re-entrant call
/// finds the pool empty and simply allocates.
pub struct Recycled<T: 'static> {
    vec: Vec<T>,
    home: &'static Home<T>,
}

impl<T: 'static> Recycled<T> {
    pub fn take(home: &'static Home<T>) -> Self {
        Recycled { vec: home.take(), home }
    }
}

impl<T: 'static> Deref for Recycled<T> {
    type Target = Vec<T>;
    fn deref(&self) -> &Vec<T> {
        &self.vec
    }
}

impl<T: 'static> DerefMut for Recycled<T> {
    fn deref_mut(&mut self) -> &mut Vec<T> {
        &mut self.vec
    }
}

impl<T: 'static> Drop for Recycled<T> {
    fn drop(&mut self) {
        let mut vec = std::mem::take(&mut self.vec);
        if vec.capacity() * std::mem::size_of::<T>() <= KEEP_MAX_BYTES {
            vec.clear();
            // The thread may be exiting, in which case there is nothing to return to.
            let _ = self.home.try_with(|cell| cell.set(vec));
        }
    }
}
