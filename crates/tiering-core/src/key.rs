//! Chunk keys: the chained prefix hash of a chunk's last block plus the KV-group index.

use std::fmt;
use std::hash::{BuildHasher, Hash, Hasher};

/// Length in bytes of the prefix hash carried by an [`OffloadKey`].
pub const KEY_HASH_BYTES: usize = 32;

/// Length in bytes of an [`OffloadKey`] packed by [`OffloadKey::to_bytes`].
pub const KEY_BYTES: usize = KEY_HASH_BYTES + 4;

/// Names one offloaded chunk: the chained prefix hash of the chunk's last block and the
/// KV-cache group index. Equal keys mean equal content, so tiers only compare keys for equality.
#[derive(Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub struct OffloadKey {
    hash: [u8; KEY_HASH_BYTES],
    group: u32,
}

impl OffloadKey {
    /// Builds a key from a block hash and a KV-group index.
    #[must_use]
    pub const fn new(hash: [u8; KEY_HASH_BYTES], group: u32) -> Self {
        Self { hash, group }
    }

    /// A key whose hash is derived from `n` (group 0). Meant for tests, examples and simulators
    /// that need many distinct keys cheaply; the bytes are spread so the fast hasher stays fair.
    #[must_use]
    pub fn from_u64(n: u64) -> Self {
        let mut hash = [0u8; KEY_HASH_BYTES];
        let mut x = n;
        for chunk in hash.chunks_exact_mut(8) {
            x = splitmix64(x);
            chunk.copy_from_slice(&x.to_le_bytes());
        }
        // Keep `n` recoverable in the last 8 bytes so debugging output is readable.
        hash[24..].copy_from_slice(&n.to_be_bytes());
        Self { hash, group: 0 }
    }

    /// The chained prefix hash.
    #[must_use]
    pub const fn hash_bytes(&self) -> &[u8; KEY_HASH_BYTES] {
        &self.hash
    }

    /// The KV-cache group index.
    #[must_use]
    pub const fn group(&self) -> u32 {
        self.group
    }

    /// The key with its group replaced.
    #[must_use]
    pub const fn with_group(mut self, group: u32) -> Self {
        self.group = group;
        self
    }

    /// Packs the key as vLLM does: the hash followed by the group as 4 big-endian bytes.
    #[must_use]
    pub fn to_bytes(&self) -> [u8; KEY_BYTES] {
        let mut out = [0u8; KEY_BYTES];
        out[..KEY_HASH_BYTES].copy_from_slice(&self.hash);
        out[KEY_HASH_BYTES..].copy_from_slice(&self.group.to_be_bytes());
        out
    }

    /// Unpacks a key written by [`OffloadKey::to_bytes`]; `None` when the length is wrong.
    #[must_use]
    pub fn from_bytes(bytes: &[u8]) -> Option<Self> {
        if bytes.len() != KEY_BYTES {
            return None;
        }
        let mut hash = [0u8; KEY_HASH_BYTES];
        hash.copy_from_slice(&bytes[..KEY_HASH_BYTES]);
        let group = u32::from_be_bytes(bytes[KEY_HASH_BYTES..].try_into().ok()?);
        Some(Self { hash, group })
    }

    /// A 64-bit digest of the key for hash tables: the hash bytes are already the output of a
    /// strong hash, so folding two words and the group is enough.
    #[must_use]
    pub fn digest(&self) -> u64 {
        let a = u64::from_le_bytes(self.hash[0..8].try_into().unwrap_or_default());
        let b = u64::from_le_bytes(self.hash[24..32].try_into().unwrap_or_default());
        splitmix64(a ^ b.rotate_left(29) ^ u64::from(self.group).rotate_left(47))
    }
}

impl Hash for OffloadKey {
    fn hash<H: Hasher>(&self, state: &mut H) {
        // One word is enough: equal keys have equal digests, and the digest is well mixed.
        state.write_u64(self.digest());
    }
}

const fn splitmix64(mut x: u64) -> u64 {
    x = x.wrapping_add(0x9E37_79B9_7F4A_7C15);
    x = (x ^ (x >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    x = (x ^ (x >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    x ^ (x >> 31)
}

impl fmt::Debug for OffloadKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Key(")?;
        for b in &self.hash[..4] {
            write!(f, "{b:02x}")?;
        }
        write!(f, "…")?;
        for b in &self.hash[28..] {
            write!(f, "{b:02x}")?;
        }
        write!(f, "/g{})", self.group)
    }
}

impl fmt::Display for OffloadKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Debug::fmt(self, f)
    }
}

/// A hasher for maps keyed by [`OffloadKey`]: the key hashes itself as one word
/// ([`OffloadKey::digest`]), which this hasher finishes with one cheap mix instead of running
/// SipHash over it.
/// Other writes (request ids, strings) are folded eight bytes at a time and mixed once per
/// write, so the hasher stays correct and fast for any key type. Not meant for keys an adversary
/// picks to collide (the engine's request ids and the keys' own hashes are not).
#[derive(Default, Clone, Copy)]
pub struct KeyHasher {
    state: u64,
}

impl Hasher for KeyHasher {
    fn finish(&self) -> u64 {
        self.state
    }

    fn write(&mut self, bytes: &[u8]) {
        const K: u64 = 0x9E37_79B9_7F4A_7C15;
        let mut h = self.state ^ (bytes.len() as u64).wrapping_mul(K);
        let mut words = bytes.chunks_exact(8);
        for w in &mut words {
            let mut b = [0u8; 8];
            b.copy_from_slice(w);
            h = (h ^ u64::from_le_bytes(b)).wrapping_mul(K).rotate_left(31);
        }
        let rest = words.remainder();
        if !rest.is_empty() {
            let mut b = [0u8; 8];
            b[..rest.len()].copy_from_slice(rest);
            h = (h ^ u64::from_le_bytes(b)).wrapping_mul(K).rotate_left(31);
        }
        self.state = splitmix64(h);
    }

    fn write_u8(&mut self, n: u8) {
        self.write_u64(u64::from(n));
    }

    fn write_u32(&mut self, n: u32) {
        self.write_u64(u64::from(n));
    }

    fn write_usize(&mut self, n: usize) {
        self.write_u64(n as u64);
    }

    fn write_isize(&mut self, n: isize) {
        self.write_u64(n as u64);
    }

    fn write_u64(&mut self, n: u64) {
        // Always mixed: an `OffloadKey` digest is already random, but a map keyed by small
        // integers with this hasher would otherwise get identical control bytes and probe badly.
        self.state = splitmix64(self.state ^ n);
    }
}

/// [`BuildHasher`] for [`KeyHasher`].
#[derive(Default, Clone, Copy, Debug)]
pub struct KeyBuildHasher;

impl BuildHasher for KeyBuildHasher {
    type Hasher = KeyHasher;

    fn build_hasher(&self) -> KeyHasher {
        KeyHasher::default()
    }
}

/// A `HashMap` keyed by [`OffloadKey`] with the fast [`KeyHasher`].
pub type KeyMap<V> = std::collections::HashMap<OffloadKey, V, KeyBuildHasher>;

/// A `HashSet` of [`OffloadKey`]s with the fast [`KeyHasher`].
pub type KeySet = std::collections::HashSet<OffloadKey, KeyBuildHasher>;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bytes_round_trip_and_group_is_big_endian() {
        let k = OffloadKey::from_u64(7).with_group(3);
        let b = k.to_bytes();
        assert_eq!(&b[32..], &[0, 0, 0, 3]);
        assert_eq!(OffloadKey::from_bytes(&b), Some(k));
        assert_eq!(OffloadKey::from_bytes(&b[1..]), None);
    }

    #[test]
    fn distinct_numbers_give_distinct_keys_and_digests() {
        let keys: KeySet = (0..10_000).map(OffloadKey::from_u64).collect();
        assert_eq!(keys.len(), 10_000);
        let digests: std::collections::HashSet<u64> =
            (0..10_000).map(|n| OffloadKey::from_u64(n).digest()).collect();
        assert_eq!(digests.len(), 10_000);
    }

    #[test]
    fn the_byte_path_separates_strings_and_request_ids() {
        let names: std::collections::HashSet<u64> = (0..10_000)
            .map(|n| KeyBuildHasher.hash_one(format!("req-{n}")))
            .collect();
        assert_eq!(names.len(), 10_000);
        // Prefixes and zero padding do not collide with each other.
        let h = |b: &[u8]| {
            let mut s = KeyHasher::default();
            s.write(b);
            s.finish()
        };
        assert_ne!(h(b"a"), h(b"a\0"));
        assert_ne!(h(b""), h(b"\0"));
        assert_ne!(h(b"abcdefgh"), h(b"abcdefgh\0"));
        let mut m: std::collections::HashMap<crate::request::RequestId, u32, KeyBuildHasher> =
            std::collections::HashMap::default();
        m.insert(crate::request::RequestId::local("a"), 1);
        m.insert(crate::request::RequestId::remote("", "a"), 2);
        assert_eq!(m.len(), 2);
        assert_eq!(m[&crate::request::RequestId::local("a")], 1);
    }

    #[test]
    fn groups_distinguish_keys_in_maps() {
        let mut m = KeyMap::default();
        m.insert(OffloadKey::from_u64(1), 1);
        m.insert(OffloadKey::from_u64(1).with_group(1), 2);
        assert_eq!(m.len(), 2);
    }
}
