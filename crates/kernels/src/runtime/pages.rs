//! Huge pages for the packed weights, which a decode step streams once
//! each: on 4 KiB pages the hardware prefetchers stop at every page
//! boundary and every page costs a TLB walk, so a weight matrix of
//! hundreds of megabytes streams below the memory's bandwidth. Linux's
//! transparent huge pages are often given only to memory that asks for
//! them (`/sys/kernel/mm/transparent_hugepage/enabled` = `madvise`).

/// `len` copies of `value` in memory the kernel was asked to back with
/// huge pages before any of it was written ([`advise_huge`]).
pub(crate) fn filled<T: Clone>(len: usize, value: T) -> Vec<T> {
    let mut v = reserved(len);
    v.resize(len, value);
    v
}

/// An empty vector with room for `len` elements, in memory the kernel was
/// asked to back with huge pages ([`advise_huge`]): for a caller that
/// writes it once by pushing.
pub(crate) fn reserved<T>(len: usize) -> Vec<T> {
    let v = Vec::with_capacity(len);
    advise_huge(v.as_ptr() as usize, len * size_of::<T>());
    v
}

/// Asks the kernel to back the `len` bytes from `ptr` with huge pages
/// where it can (Linux `madvise(MADV_HUGEPAGE)` on the whole 4 KiB pages
/// inside them), before they are written: pages first touched afterwards
/// come 2 MiB at a time. Advice only: nothing happens on other systems,
/// for buffers under 2 MiB, or where the kernel declines.
fn advise_huge(ptr: usize, len: usize) {
    #[cfg(target_os = "linux")]
    {
        const PAGE: usize = 4096;
        const HUGE: usize = 2 << 20;
        if len < HUGE {
            return;
        }
        let start = ptr.next_multiple_of(PAGE);
        let end = (ptr + len) / PAGE * PAGE;
        if end > start {
            // SAFETY: the range lies inside the caller's allocation,
            // whole pages; MADV_HUGEPAGE changes no contents, and its
            // result is advice the program does not depend on.
            unsafe {
                libc::madvise(start as *mut libc::c_void, end - start, libc::MADV_HUGEPAGE);
            }
        }
    }
    #[cfg(not(target_os = "linux"))]
    let _ = (ptr, len);
}
