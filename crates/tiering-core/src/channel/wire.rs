//! The channel's wire format: a 12-byte header (magic, version, kind, payload length) and a
//! payload per message.

use crate::key::{KEY_BYTES, OffloadKey};

const MAGIC: [u8; 4] = *b"KVTC";
const VERSION: u16 = 1;
/// Bytes of a message header.
pub(crate) const HEADER: usize = 12;
const KIND_HELLO: u8 = 1;
const KIND_STORED: u8 = 2;
const KIND_GOODBYE: u8 = 3;
/// Bytes per key on the wire: the hash and the group index.
pub(crate) const WIRE_KEY: usize = KEY_BYTES;
/// Largest payload accepted (about 460 000 keys); larger ones are refused before allocating.
pub const MAX_PAYLOAD: usize = 16 << 20;

fn header(kind: u8, len: usize) -> [u8; HEADER] {
    let mut h = [0u8; HEADER];
    h[..4].copy_from_slice(&MAGIC);
    h[4..6].copy_from_slice(&VERSION.to_le_bytes());
    h[6] = kind;
    h[8..12].copy_from_slice(&u32::try_from(len).unwrap_or(u32::MAX).to_le_bytes());
    h
}

/// Why a message was refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum WireError {
    /// The header's magic is wrong: not a kvtier worker.
    #[error("bad magic {0:02x?}")]
    BadMagic([u8; 4]),
    /// Another protocol version.
    #[error("unsupported version {0}")]
    BadVersion(u16),
    /// An unknown message kind.
    #[error("unknown message kind {0}")]
    BadKind(u8),
    /// A payload over [`MAX_PAYLOAD`].
    #[error("payload of {0} bytes is over the limit")]
    TooLarge(usize),
    /// A payload whose length does not fit its kind.
    #[error("malformed {0} payload")]
    Malformed(&'static str),
}

/// A decoded message.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Message {
    /// The worker's rank and arena fingerprint.
    Hello {
        /// 0-based tensor-parallel rank.
        rank: u32,
        /// [`fingerprint`](super::fingerprint) of the worker's arena.
        fingerprint: u64,
    },
    /// Finished copies.
    Stored {
        /// Whether the copies succeeded.
        success: bool,
        /// The keys copied.
        keys: Vec<OffloadKey>,
    },
    /// Clean exit.
    Goodbye,
}

/// Checks a header; returns the kind and the payload length.
///
/// # Errors
/// Wrong magic, version or kind, or a payload over the limit.
pub fn decode_header(h: &[u8; HEADER]) -> Result<(u8, usize), WireError> {
    let magic = [h[0], h[1], h[2], h[3]];
    if magic != MAGIC {
        return Err(WireError::BadMagic(magic));
    }
    let version = u16::from_le_bytes([h[4], h[5]]);
    if version != VERSION {
        return Err(WireError::BadVersion(version));
    }
    let kind = h[6];
    if !matches!(kind, KIND_HELLO | KIND_STORED | KIND_GOODBYE) {
        return Err(WireError::BadKind(kind));
    }
    let len = u32::from_le_bytes([h[8], h[9], h[10], h[11]]) as usize;
    if len > MAX_PAYLOAD {
        return Err(WireError::TooLarge(len));
    }
    Ok((kind, len))
}

/// Decodes a payload of `kind`.
///
/// # Errors
/// A payload whose length or content does not fit its kind.
pub fn decode_payload(kind: u8, p: &[u8]) -> Result<Message, WireError> {
    match kind {
        KIND_HELLO => {
            let (Some(rank), Some(fp)) = (p.get(..4), p.get(4..12)) else {
                return Err(WireError::Malformed("hello"));
            };
            if p.len() != 12 {
                return Err(WireError::Malformed("hello"));
            }
            Ok(Message::Hello {
                rank: u32::from_le_bytes(rank.try_into().map_err(|_| WireError::Malformed("hello"))?),
                fingerprint: u64::from_le_bytes(fp.try_into().map_err(|_| WireError::Malformed("hello"))?),
            })
        }
        KIND_STORED => {
            let Some((&flag, rest)) = p.split_first() else {
                return Err(WireError::Malformed("stored"));
            };
            if flag > 1 || rest.len() % WIRE_KEY != 0 {
                return Err(WireError::Malformed("stored"));
            }
            let mut keys = Vec::with_capacity(rest.len() / WIRE_KEY);
            for chunk in rest.chunks_exact(WIRE_KEY) {
                let key = OffloadKey::from_bytes(chunk).ok_or(WireError::Malformed("stored"))?;
                keys.push(key);
            }
            Ok(Message::Stored {
                success: flag == 1,
                keys,
            })
        }
        KIND_GOODBYE if p.is_empty() => Ok(Message::Goodbye),
        KIND_GOODBYE => Err(WireError::Malformed("goodbye")),
        other => Err(WireError::BadKind(other)),
    }
}

/// Encodes a message (header and payload).
#[must_use]
pub fn encode(msg: &Message) -> Vec<u8> {
    let mut payload = Vec::new();
    let kind = match msg {
        Message::Hello { rank, fingerprint } => {
            payload.extend_from_slice(&rank.to_le_bytes());
            payload.extend_from_slice(&fingerprint.to_le_bytes());
            KIND_HELLO
        }
        Message::Stored { success, keys } => {
            payload.reserve(1 + keys.len() * WIRE_KEY);
            payload.push(u8::from(*success));
            for k in keys {
                payload.extend_from_slice(&k.to_bytes());
            }
            KIND_STORED
        }
        Message::Goodbye => KIND_GOODBYE,
    };
    let mut out = header(kind, payload.len()).to_vec();
    out.extend_from_slice(&payload);
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn messages_round_trip() {
        for msg in [
            Message::Hello {
                rank: 3,
                fingerprint: 0xdead_beef,
            },
            Message::Stored {
                success: true,
                keys: vec![OffloadKey::from_u64(1), OffloadKey::new([7; 32], 2)],
            },
            Message::Stored {
                success: false,
                keys: vec![],
            },
            Message::Goodbye,
        ] {
            let bytes = encode(&msg);
            let h: [u8; HEADER] = bytes[..HEADER].try_into().unwrap();
            let (kind, len) = decode_header(&h).unwrap();
            assert_eq!(len, bytes.len() - HEADER);
            assert_eq!(decode_payload(kind, &bytes[HEADER..]).unwrap(), msg);
        }
    }

    #[test]
    fn bad_headers_and_payloads_are_refused() {
        let mut h = header(KIND_STORED, 10);
        h[0] = b'X';
        assert!(matches!(decode_header(&h), Err(WireError::BadMagic(_))));
        let h = header(9, 0);
        assert_eq!(decode_header(&h), Err(WireError::BadKind(9)));
        let mut h = header(KIND_STORED, 0);
        h[8..12].copy_from_slice(&u32::MAX.to_le_bytes());
        assert!(matches!(decode_header(&h), Err(WireError::TooLarge(_))));
        assert_eq!(
            decode_payload(KIND_STORED, &[1, 2, 3]),
            Err(WireError::Malformed("stored"))
        );
        assert_eq!(
            decode_payload(KIND_STORED, &[2]),
            Err(WireError::Malformed("stored"))
        );
        assert_eq!(
            decode_payload(KIND_HELLO, &[0; 11]),
            Err(WireError::Malformed("hello"))
        );
        assert_eq!(
            decode_payload(KIND_GOODBYE, &[0]),
            Err(WireError::Malformed("goodbye"))
        );
    }
}
