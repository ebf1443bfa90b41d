//! The one cache hint the crate uses: bring a line into cache for a read a little later, so that
//! waits on memory overlap (list items ahead of the encoder's walk, table slots and holder sets
//! ahead of the index's and the view's lookups).

/// Asks the CPU for the cache line holding `p`. A hint: it never faults, whatever the address
/// (one past an array's end included), and does nothing off x86_64.
#[inline(always)]
pub(crate) fn prefetch<T>(p: *const T) {
    #[cfg(target_arch = "x86_64")]
    // SAFETY: a prefetch reads no memory the program can observe and never faults.
    unsafe {
        std::arch::x86_64::_mm_prefetch::<{ std::arch::x86_64::_MM_HINT_T0 }>(p as *const i8)
    };
    #[cfg(not(target_arch = "x86_64"))]
    let _ = p;
}
