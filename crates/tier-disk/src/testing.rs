//! Helpers for tests and the crash-test child (feature `test-utils`).

use tiering_core::OffloadKey;

/// Fills `buf` with the deterministic content of `key`: different for every key and every byte
/// position, so a torn or mixed chunk never matches the content of any key.
pub fn fill_chunk(key: &OffloadKey, buf: &mut [u8]) {
    let mut x = key.digest() | 1;
    for word in buf.chunks_mut(8) {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        word.copy_from_slice(&x.to_le_bytes()[..word.len()]);
    }
}

/// The content [`fill_chunk`] writes, as a vector of `len` bytes.
#[must_use]
pub fn chunk_content(key: &OffloadKey, len: usize) -> Vec<u8> {
    let mut v = vec![0u8; len];
    fill_chunk(key, &mut v);
    v
}
