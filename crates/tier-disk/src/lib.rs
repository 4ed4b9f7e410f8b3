//! The persistent disk secondary tier of kvtier: pre-allocated slab files of checksummed slots,
//! an index rebuilt at start, a pread/pwrite worker pool.
//!
//! Not implemented yet; tracked by the tier-disk issue.
