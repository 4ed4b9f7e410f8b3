//! What the tier writes to the server: key names and values (a fixed header followed by the
//! chunk's bytes).
//!
//! A key is `kvtier:<namespace>:<layout>:<key hex>`, where `<layout>` is 16 hex digits naming
//! the chunk geometry and layout fingerprint ([`LayoutId`]). The key contains no `{…}` hash
//! tag, so a cluster spreads chunks over every master.
//!
//! A value is [`HEADER_LEN`] bytes of header, then exactly `chunk_bytes` of payload. The header
//! (little endian) is: magic `KVTRDS01` (8), format version (u16), 6 reserved bytes,
//! chunk bytes (u64), layout id (u64), the chunk's key (36 bytes), 12 reserved bytes, and
//! an xxh3-64 checksum (u64) of the header's first 80 bytes followed by the payload. A value is
//! served only when every field matches what the reader expects and the checksum holds.

use std::fmt;
use std::io::Write;

use std::hash::Hasher as _;
use tiering_core::KEY_BYTES;
use tiering_core::OffloadKey;

use twox_hash::XxHash3_64;

/// The value format's magic bytes.
pub const MAGIC: [u8; 8] = *b"KVTRDS01";
/// The value format's version.
pub const FORMAT_VERSION: u16 = 1;
/// Header bytes before the payload.
pub const HEADER_LEN: usize = 88;
const CHECKSUM_AT: usize = HEADER_LEN - 8;

/// The identity of a chunk layout: chunk size and the operator's layout fingerprint. Chunks of
/// different layouts live under different keys and are refused if found under the wrong one.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct LayoutId(pub u64);

impl LayoutId {
    /// The layout of chunks of `chunk_bytes` bytes with fingerprint `fingerprint`.
    #[must_use]
    pub fn new(chunk_bytes: usize, fingerprint: &str) -> Self {
        let mut h = XxHash3_64::new();
        h.write(b"kvtier-redis-layout");
        h.write(&FORMAT_VERSION.to_le_bytes());
        h.write(&(chunk_bytes as u64).to_le_bytes());
        h.write(fingerprint.as_bytes());
        Self(h.finish())
    }
}

impl fmt::Display for LayoutId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{:016x}", self.0)
    }
}

/// Builds the server-side names of chunks for one namespace and layout.
#[derive(Clone, Debug)]
pub struct KeyScheme {
    prefix: String,
    layout: LayoutId,
    chunk_bytes: usize,
}

impl KeyScheme {
    /// Keys of `namespace` (already validated) for chunks of `chunk_bytes` and `layout`.
    #[must_use]
    pub fn new(namespace: &str, chunk_bytes: usize, fingerprint: &str) -> Self {
        let layout = LayoutId::new(chunk_bytes, fingerprint);
        Self {
            prefix: format!("kvtier:{namespace}:{layout}:"),
            layout,
            chunk_bytes,
        }
    }

    /// The prefix every key of this namespace starts with (any layout).
    #[must_use]
    pub fn namespace_prefix(namespace: &str) -> String {
        format!("kvtier:{namespace}:")
    }

    /// The server key of `key`.
    #[must_use]
    pub fn name(&self, key: &OffloadKey) -> Vec<u8> {
        let mut out = Vec::with_capacity(self.name_len());
        self.write_name(key, &mut out);
        out
    }

    /// The length of every server key of this scheme.
    #[must_use]
    pub fn name_len(&self) -> usize {
        self.prefix.len() + 2 * KEY_BYTES
    }

    /// Appends the server key of `key` to `out`.
    pub fn write_name(&self, key: &OffloadKey, out: &mut Vec<u8>) {
        const HEX: &[u8; 16] = b"0123456789abcdef";
        out.reserve(self.name_len());
        out.extend_from_slice(self.prefix.as_bytes());
        for b in key.to_bytes() {
            out.push(HEX[usize::from(b >> 4)]);
            out.push(HEX[usize::from(b & 15)]);
        }
    }

    /// The layout id.
    #[must_use]
    pub fn layout(&self) -> LayoutId {
        self.layout
    }

    /// Payload bytes of one chunk.
    #[must_use]
    pub fn chunk_bytes(&self) -> usize {
        self.chunk_bytes
    }

    /// The bytes of a value holding `payload` for `key`.
    #[must_use]
    pub fn encode(&self, key: &OffloadKey, payload: &[u8]) -> Vec<u8> {
        let mut out = Vec::with_capacity(HEADER_LEN + payload.len());
        self.write_value(key, payload, &mut out);
        out
    }

    /// Writes the value for `key` and `payload` into `out` (header, then payload).
    pub fn write_value(&self, key: &OffloadKey, payload: &[u8], out: &mut impl Write) {
        let header = self.header(key, payload);
        // Writes into a Vec or the client's argument buffer cannot fail.
        let _ = out.write_all(&header);
        let _ = out.write_all(payload);
    }

    fn header(&self, key: &OffloadKey, payload: &[u8]) -> [u8; HEADER_LEN] {
        let mut h = [0u8; HEADER_LEN];
        h[0..8].copy_from_slice(&MAGIC);
        h[8..10].copy_from_slice(&FORMAT_VERSION.to_le_bytes());
        h[16..24].copy_from_slice(&(payload.len() as u64).to_le_bytes());
        h[24..32].copy_from_slice(&self.layout.0.to_le_bytes());
        h[32..32 + KEY_BYTES].copy_from_slice(&key.to_bytes());
        let sum = checksum(&h[..CHECKSUM_AT], payload);
        h[CHECKSUM_AT..].copy_from_slice(&sum.to_le_bytes());
        h
    }

    /// Checks that `value` is a complete, intact chunk of `key` in this layout, and returns its
    /// payload.
    ///
    /// # Errors
    /// What is wrong with the value.
    pub fn decode<'v>(&self, key: &OffloadKey, value: &'v [u8]) -> Result<&'v [u8], ValueDefect> {
        if value.len() < HEADER_LEN {
            return Err(ValueDefect::Short(value.len()));
        }
        let (h, payload) = value.split_at(HEADER_LEN);
        if h[0..8] != MAGIC {
            return Err(ValueDefect::Magic);
        }
        let version = u16::from_le_bytes([h[8], h[9]]);
        if version != FORMAT_VERSION {
            return Err(ValueDefect::Version(version));
        }
        let len = read_u64(&h[16..24]);
        if len != self.chunk_bytes as u64 || payload.len() != self.chunk_bytes {
            return Err(ValueDefect::Length {
                header: len,
                payload: payload.len(),
                expected: self.chunk_bytes,
            });
        }
        if read_u64(&h[24..32]) != self.layout.0 {
            return Err(ValueDefect::Layout);
        }
        if h[32..32 + KEY_BYTES] != key.to_bytes() {
            return Err(ValueDefect::Key);
        }
        if read_u64(&h[CHECKSUM_AT..]) != checksum(&h[..CHECKSUM_AT], payload) {
            return Err(ValueDefect::Checksum);
        }
        Ok(payload)
    }
}

/// A value as a command argument, written straight into the command buffer (no intermediate
/// copy of the payload).
pub(crate) struct ValueArg<'a> {
    scheme: &'a KeyScheme,
    key: &'a OffloadKey,
    payload: &'a [u8],
}

impl<'a> ValueArg<'a> {
    /// The value of `key` holding `payload`.
    pub(crate) fn new(scheme: &'a KeyScheme, key: &'a OffloadKey, payload: &'a [u8]) -> Self {
        Self { scheme, key, payload }
    }
}

impl redis::ToRedisArgs for ValueArg<'_> {
    fn write_redis_args<W>(&self, out: &mut W)
    where
        W: ?Sized + redis::RedisWrite,
    {
        let mut w = out.writer_for_next_arg();
        self.scheme.write_value(self.key, self.payload, &mut w);
    }
}

fn read_u64(b: &[u8]) -> u64 {
    let mut a = [0u8; 8];
    a.copy_from_slice(&b[..8]);
    u64::from_le_bytes(a)
}

fn checksum(header: &[u8], payload: &[u8]) -> u64 {
    if payload.is_empty() {
        return XxHash3_64::oneshot(header);
    }
    let mut h = XxHash3_64::new();
    h.write(header);
    h.write(payload);
    h.finish()
}

/// Why a value read from the server is not served.
#[derive(Clone, Copy, Debug, PartialEq, Eq, thiserror::Error)]
pub enum ValueDefect {
    /// The key does not exist (never stored, evicted, expired, invalidated).
    #[error("missing (evicted or never stored)")]
    Missing,
    /// Fewer bytes than a header.
    #[error("short value: {0} bytes")]
    Short(usize),
    /// Not written by this tier.
    #[error("bad magic")]
    Magic,
    /// Written by another format version.
    #[error("format version {0}")]
    Version(u16),
    /// The payload is not one chunk long.
    #[error("length {payload} (header says {header}), expected {expected}")]
    Length {
        /// The header's length field.
        header: u64,
        /// The payload actually present.
        payload: usize,
        /// The chunk size.
        expected: usize,
    },
    /// Written for another layout.
    #[error("another layout")]
    Layout,
    /// Written for another key.
    #[error("another key")]
    Key,
    /// The checksum does not match.
    #[error("checksum mismatch")]
    Checksum,
    /// The server returned something that is not a string.
    #[error("unexpected reply type")]
    Type,
}

#[cfg(test)]
mod tests {
    use super::*;

    fn scheme(chunk: usize) -> KeyScheme {
        KeyScheme::new("ns", chunk, "fp")
    }

    #[test]
    fn the_checksum_is_standard_xxh3_so_stored_values_stay_readable() {
        // XXH3-64 (seed 0) of the empty input, from the reference implementation: values
        // written by any build (or another XXH3 library) verify the same way.
        assert_eq!(XxHash3_64::oneshot(b""), 0x2d06_8005_38d3_94c2);
        let (header, payload) = (b"header".as_slice(), vec![7u8; 4096]);
        let whole: Vec<u8> = [header, payload.as_slice()].concat();
        assert_eq!(checksum(header, &payload), XxHash3_64::oneshot(&whole));
    }

    #[test]
    fn a_value_round_trips_and_every_defect_is_detected() {
        let s = scheme(64);
        let k = OffloadKey::from_u64(7);
        let payload: Vec<u8> = (0..64u8).collect();
        let v = s.encode(&k, &payload);
        assert_eq!(v.len(), HEADER_LEN + 64);
        assert_eq!(s.decode(&k, &v).unwrap(), &payload[..]);

        assert_eq!(s.decode(&k, &v[..10]), Err(ValueDefect::Short(10)));
        assert!(matches!(
            s.decode(&k, &v[..v.len() - 1]),
            Err(ValueDefect::Length { .. })
        ));
        let mut bad = v.clone();
        bad[HEADER_LEN + 3] ^= 1;
        assert_eq!(s.decode(&k, &bad), Err(ValueDefect::Checksum));
        let mut bad = v.clone();
        bad[0] = b'X';
        assert_eq!(s.decode(&k, &bad), Err(ValueDefect::Magic));
        assert_eq!(s.decode(&OffloadKey::from_u64(8), &v), Err(ValueDefect::Key));
        assert_eq!(
            KeyScheme::new("ns", 64, "other").decode(&k, &v),
            Err(ValueDefect::Layout)
        );
        assert!(matches!(
            scheme(32).decode(&k, &v),
            Err(ValueDefect::Length { .. })
        ));
    }

    #[test]
    fn names_separate_namespaces_and_layouts() {
        let k = OffloadKey::from_u64(1);
        let a = String::from_utf8(scheme(64).name(&k)).unwrap();
        assert!(a.starts_with("kvtier:ns:"), "{a}");
        assert!(
            !a.contains('{'),
            "no hash tag: keys must spread over cluster slots"
        );
        assert_eq!(a.len(), "kvtier:ns:".len() + 16 + 1 + 2 * KEY_BYTES);
        assert_ne!(a, String::from_utf8(scheme(128).name(&k)).unwrap());
        assert_ne!(
            a,
            String::from_utf8(KeyScheme::new("ns", 64, "x").name(&k)).unwrap()
        );
        assert_ne!(
            a,
            String::from_utf8(KeyScheme::new("other", 64, "fp").name(&k)).unwrap()
        );
        assert_ne!(
            a,
            String::from_utf8(scheme(64).name(&OffloadKey::from_u64(2))).unwrap()
        );
    }
}
