//! Authentication of peers and of the data plane.
//!
//! Every node of a deployment holds one shared secret (named in the chain by `secret_env`, or
//! the well-known insecure key when `insecure = true`). From it:
//!
//! - each `connect` carries a tag over all its fields, keyed by the secret: a peer with another
//!   secret (or none) is refused at handshake;
//! - each session direction gets its own data key, derived from the secret and *both* sides'
//!   identities, incarnations and per-session nonces. A frame captured in one session does not
//!   verify in any other session, even between the same two processes;
//! - every data-plane frame (`BEGIN`, each chunk header, each chunk payload) carries a tag under
//!   that data key, bound to the transfer, request, round, position, row and key. The consumer
//!   checks a chunk header's tag before it touches the destination row, so a peer without the
//!   key gets no byte into any row.
//!
//! The keyed hash is BLAKE3 in keyed mode (a PRF, so a MAC), and key derivation uses BLAKE3's
//! `derive_key` mode; tags are compared in constant time. A chunk payload's MAC is a keyed
//! BLAKE3 over the chunk's fields and the POLYVAL hashes of its pieces, under a POLYVAL key
//! derived per transfer from the data key: POLYVAL with VPCLMULQDQ is several times faster
//! than BLAKE3 over bulk bytes, and the BLAKE3 fold keeps every hash secret (see
//! `dataplane::frame::TransferMac`).

use std::fmt;
use std::io::Read;

use crate::wire::{CONNECT_TAG_BYTES, Connect};

/// Bytes of a tag.
pub const TAG_BYTES: usize = 32;
// A connect carries one tag in a field the wire format sizes.
const _: () = assert!(TAG_BYTES == CONNECT_TAG_BYTES);

const SECRET_CONTEXT: &str = "kvtier p2p v1 shared secret";
const INSECURE_CONTEXT: &str = "kvtier p2p v1 insecure well-known key";

/// A tag (keyed BLAKE3 output); compares in constant time.
pub type Tag = blake3::Hash;

/// The deployment's shared secret, reduced to a 256-bit key.
#[derive(Clone)]
pub struct SharedSecret {
    key: [u8; 32],
    insecure: bool,
}

impl SharedSecret {
    /// A secret from its text (any length; it is stretched by key derivation, not used as is).
    #[must_use]
    pub fn new(secret: &[u8]) -> Self {
        Self {
            key: blake3::derive_key(SECRET_CONTEXT, secret),
            insecure: false,
        }
    }

    /// The well-known key of `insecure = true`: every insecure node shares it, so it
    /// authenticates nothing; the checks still run, on the same code path.
    #[must_use]
    pub fn insecure() -> Self {
        Self {
            key: blake3::derive_key(INSECURE_CONTEXT, b""),
            insecure: true,
        }
    }

    /// Whether this is the insecure well-known key.
    #[must_use]
    pub fn is_insecure(&self) -> bool {
        self.insecure
    }

    /// The tag a `connect` must carry: every field but `auth`, keyed by the secret.
    #[must_use]
    pub fn connect_tag(&self, c: &Connect) -> Tag {
        let mut h = blake3::Hasher::new_keyed(&self.key);
        h.update(b"connect\0");
        h.update(&c.wire_version.to_le_bytes());
        put_str(&mut h, &c.peer_id);
        h.update(&c.instance.to_le_bytes());
        put_bytes(&mut h, &c.nonce.0);
        put_str(&mut h, &c.data_addr);
        h.update(&c.chunk_bytes.to_le_bytes());
        h.update(&c.num_chunks.to_le_bytes());
        put_str(&mut h, &c.layout_fingerprint);
        put_str(&mut h, &c.hash_seed);
        h.finalize()
    }

    /// Whether `c.auth` is the tag of `c` under this secret (constant-time comparison).
    #[must_use]
    pub fn verify_connect(&self, c: &Connect) -> bool {
        <[u8; TAG_BYTES]>::try_from(c.auth.0.as_slice())
            .is_ok_and(|t| Tag::from_bytes(t) == self.connect_tag(c))
    }

    /// The key of the data flowing from `producer` to `consumer` in one session (each side
    /// names itself by the fields of its `connect`).
    #[must_use]
    pub fn data_key(&self, producer: &Connect, consumer: &Connect) -> DataKey {
        let mut h = blake3::Hasher::new_keyed(&self.key);
        h.update(b"data key\0");
        for c in [producer, consumer] {
            put_str(&mut h, &c.peer_id);
            h.update(&c.instance.to_le_bytes());
            put_bytes(&mut h, &c.nonce.0);
        }
        DataKey(*h.finalize().as_bytes())
    }
}

impl PartialEq for SharedSecret {
    fn eq(&self, other: &Self) -> bool {
        Tag::from_bytes(self.key) == Tag::from_bytes(other.key) && self.insecure == other.insecure
    }
}

impl Eq for SharedSecret {}

impl fmt::Debug for SharedSecret {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(if self.insecure {
            "SharedSecret(insecure)"
        } else {
            "SharedSecret(..)"
        })
    }
}

/// The per-session, per-direction key of the data plane.
#[derive(Clone)]
pub struct DataKey([u8; 32]);

impl DataKey {
    /// A key from raw bytes (tests and fuzzing).
    #[must_use]
    pub fn from_bytes(b: [u8; 32]) -> Self {
        Self(b)
    }

    /// A keyed hasher, with `domain` absorbed first.
    #[must_use]
    pub fn hasher(&self, domain: &[u8]) -> blake3::Hasher {
        let mut h = blake3::Hasher::new_keyed(&self.0);
        put_bytes(&mut h, domain);
        h
    }
}

impl fmt::Debug for DataKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("DataKey(..)")
    }
}

/// Length-prefixed, so field boundaries cannot be shifted between fields.
pub(crate) fn put_bytes(h: &mut blake3::Hasher, b: &[u8]) {
    h.update(&(b.len() as u64).to_le_bytes());
    h.update(b);
}

pub(crate) fn put_str(h: &mut blake3::Hasher, s: &str) {
    put_bytes(h, s.as_bytes());
}

/// A fresh random nonce from the operating system.
///
/// # Errors
/// The system's random source cannot be read.
pub fn nonce() -> std::io::Result<[u8; crate::wire::NONCE_BYTES]> {
    let mut n = [0u8; crate::wire::NONCE_BYTES];
    std::fs::File::open("/dev/urandom")?.read_exact(&mut n)?;
    Ok(n)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::wire::{Bin, WIRE_VERSION};

    fn connect(id: &str, nonce: u8) -> Connect {
        Connect {
            wire_version: WIRE_VERSION,
            peer_id: id.into(),
            instance: 1,
            nonce: Bin(vec![nonce; crate::wire::NONCE_BYTES]),
            data_addr: "127.0.0.1:2".into(),
            chunk_bytes: 64,
            num_chunks: 4,
            layout_fingerprint: "fp".into(),
            hash_seed: "seed".into(),
            auth: Bin::default(),
        }
    }

    #[test]
    fn a_connect_verifies_only_under_its_own_secret_and_unchanged() {
        let s = SharedSecret::new(b"one");
        let mut c = connect("a:1", 1);
        c.auth = Bin(s.connect_tag(&c).as_bytes().to_vec());
        assert!(s.verify_connect(&c));
        assert!(!SharedSecret::new(b"two").verify_connect(&c));
        assert!(!SharedSecret::insecure().verify_connect(&c));
        let mut changed = c.clone();
        changed.hash_seed = "other".into();
        assert!(!s.verify_connect(&changed));
        let mut short = c;
        short.auth.0.truncate(31);
        assert!(!s.verify_connect(&short));
    }

    #[test]
    fn data_keys_differ_per_direction_nonce_and_secret() {
        let s = SharedSecret::new(b"one");
        let (a, b) = (connect("a:1", 1), connect("b:1", 2));
        let k =
            |s: &SharedSecret, p: &Connect, c: &Connect| *s.data_key(p, c).hasher(b"x").finalize().as_bytes();
        assert_eq!(k(&s, &a, &b), k(&s, &a, &b));
        assert_ne!(k(&s, &a, &b), k(&s, &b, &a));
        assert_ne!(k(&s, &a, &b), k(&s, &a, &connect("b:1", 3)));
        assert_ne!(k(&s, &a, &b), k(&SharedSecret::new(b"two"), &a, &b));
    }

    #[test]
    fn nonces_are_fresh() {
        assert_ne!(nonce().unwrap(), nonce().unwrap());
    }
}
