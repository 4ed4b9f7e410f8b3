//! Chunk keys from token ids: a chained prefix hash, so a key names the whole prefix up to the
//! end of its chunk (equal keys mean equal content), as an engine's prefix cache does.

use tiering_core::KEY_HASH_BYTES;
use tiering_core::OffloadKey;
use twox_hash::XxHash3_128;

/// The keys of every full chunk of `tokens`, for KV-cache group `group`.
#[must_use]
pub fn chunk_keys(tokens: &[u32], tokens_per_chunk: usize, group: u32) -> Vec<OffloadKey> {
    let mut keys = Vec::with_capacity(tokens.len() / tokens_per_chunk.max(1));
    let mut prev = [0u8; KEY_HASH_BYTES];
    let mut buf = Vec::with_capacity(KEY_HASH_BYTES + tokens_per_chunk * 4);
    for chunk in tokens.chunks_exact(tokens_per_chunk.max(1)) {
        buf.clear();
        buf.extend_from_slice(&prev);
        for t in chunk {
            buf.extend_from_slice(&t.to_le_bytes());
        }
        let lo = XxHash3_128::oneshot_with_seed(0x6b76_7469_6572, &buf);
        let hi = XxHash3_128::oneshot_with_seed(0x6b76_7469_6573, &buf);
        prev[..16].copy_from_slice(&lo.to_le_bytes());
        prev[16..].copy_from_slice(&hi.to_le_bytes());
        keys.push(OffloadKey::new(prev, group));
    }
    keys
}

/// Fills `out` with the deterministic content of the chunk named `key`: what the "model" writes
/// into a device block, and what a load must bring back.
pub fn fill_chunk(key: &OffloadKey, out: &mut [u8]) {
    let mut x = key.digest();
    for word in out.chunks_mut(8) {
        x = x
            .wrapping_mul(0x2545_F491_4F6C_DD1D)
            .wrapping_add(0x9E37_79B9_7F4A_7C15);
        let bytes = x.to_le_bytes();
        word.copy_from_slice(&bytes[..word.len()]);
    }
}

/// Whether `data` is the content [`fill_chunk`] writes for `key`.
#[must_use]
pub fn chunk_matches(key: &OffloadKey, data: &[u8]) -> bool {
    let mut x = key.digest();
    data.chunks(8).all(|word| {
        x = x
            .wrapping_mul(0x2545_F491_4F6C_DD1D)
            .wrapping_add(0x9E37_79B9_7F4A_7C15);
        word == &x.to_le_bytes()[..word.len()]
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keys_are_chained_prefixes() {
        let a: Vec<u32> = (0..64).collect();
        let mut b = a.clone();
        b[40] = 999;
        let ka = chunk_keys(&a, 16, 0);
        let kb = chunk_keys(&b, 16, 0);
        assert_eq!(ka.len(), 4);
        assert_eq!(ka[..2], kb[..2]);
        // A change in chunk 2 changes chunk 2 and every later key.
        assert_ne!(ka[2], kb[2]);
        assert_ne!(ka[3], kb[3]);
        // Same chunk content after a different prefix gives a different key.
        let mut c = a.clone();
        c[0] = 5;
        assert_ne!(chunk_keys(&c, 16, 0)[3], ka[3]);
    }

    #[test]
    fn partial_chunk_has_no_key_and_group_is_kept() {
        let t: Vec<u32> = (0..47).collect();
        let k = chunk_keys(&t, 16, 3);
        assert_eq!(k.len(), 2);
        assert!(k.iter().all(|k| k.group() == 3));
    }

    #[test]
    fn fill_and_verify_round_trip_and_detect_corruption() {
        let k = chunk_keys(&[1, 2, 3, 4], 4, 0)[0];
        let mut buf = vec![0u8; 100];
        fill_chunk(&k, &mut buf);
        assert!(chunk_matches(&k, &buf));
        buf[57] ^= 1;
        assert!(!chunk_matches(&k, &buf));
        let other = chunk_keys(&[1, 2, 3, 5], 4, 0)[0];
        fill_chunk(&k, &mut buf);
        assert!(!chunk_matches(&other, &buf));
    }
}
