//! Large metadata arrays on transparent huge pages.
//!
//! At millions of rows, the chunk table, the key index and the policies' link and rank arrays
//! are hundreds of megabytes that every operation touches at random: with 4 KiB pages nearly
//! every access also misses the TLB. Asking the kernel for huge pages before the array is first
//! written (`MADV_HUGEPAGE`; a hint, ignored where transparent huge pages are off) makes each
//! random access cost its cache miss and little more.

/// Arrays smaller than this stay on normal pages (a few huge pages would be mostly empty).
const HUGE_THRESHOLD: usize = 8 << 20;

const HUGE_PAGE: usize = 2 << 20;

/// A vector of `n` copies of `value`, on huge pages when it is large.
pub(crate) fn filled_vec<T: Clone>(n: usize, value: T) -> Vec<T> {
    let mut v: Vec<T> = Vec::with_capacity(n);
    let bytes = n.saturating_mul(std::mem::size_of::<T>());
    if bytes >= HUGE_THRESHOLD {
        advise_huge(v.as_mut_ptr().cast::<u8>(), bytes);
    }
    v.resize(n, value);
    v
}

/// Starts loading the cache line of `value` without waiting for it, so a batch can have the
/// misses of all its keys in flight at once instead of one after the other.
#[inline]
pub(crate) fn prefetch<T>(value: &T) {
    #[cfg(target_arch = "x86_64")]
    {
        use std::arch::x86_64::{_MM_HINT_T0, _mm_prefetch};
        // SAFETY: a prefetch is only a hint: it never faults and changes no memory, and the
        // address comes from a live reference anyway.
        unsafe { _mm_prefetch::<_MM_HINT_T0>(std::ptr::from_ref(value).cast::<i8>()) }
    }
    #[cfg(not(target_arch = "x86_64"))]
    let _ = value;
}

fn advise_huge(ptr: *mut u8, bytes: usize) {
    // Only whole huge pages inside the buffer are advised.
    let start = (ptr as usize).next_multiple_of(HUGE_PAGE);
    let end = (ptr as usize + bytes) / HUGE_PAGE * HUGE_PAGE;
    if end <= start {
        return;
    }
    // SAFETY: `[start, end)` lies inside the allocation of `bytes` bytes at `ptr`, which this
    // process owns; MADV_HUGEPAGE only changes how the kernel backs those pages, never their
    // contents or validity, so no Rust invariant depends on the outcome (a failure is ignored).
    let rc = unsafe { libc::madvise(start as *mut libc::c_void, end - start, libc::MADV_HUGEPAGE) };
    if rc != 0 {
        tracing::debug!(bytes, "huge pages not available for tier metadata");
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn filled_vectors_hold_the_value_at_every_size() {
        for n in [0, 1, 1000, (HUGE_THRESHOLD / 8) + 3] {
            let v = filled_vec(n, 7u64);
            assert_eq!(v.len(), n);
            assert!(v.iter().all(|&x| x == 7));
        }
    }
}
