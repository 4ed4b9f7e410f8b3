//! The control-plane wire protocol: msgpack maps with a string `type` field, one message per
//! ZeroMQ payload frame.
//!
//! Decoding has two levels. A payload that is not a msgpack map of a known `type` is a
//! *malformed frame*: the transport drops and counts it and the session never sees it. A
//! message that decodes but carries invalid content (a key of the wrong length, lists of
//! different lengths) is a *protocol error*: [`Message::validate`] reports it and the session
//! that received it is torn down.

use serde::de::{self, Visitor};
use serde::{Deserialize, Deserializer, Serialize, Serializer};
use tiering_core::OffloadKey;

/// The wire version this build speaks; `connect` carries it and a peer with another major
/// version is refused at handshake.
pub const WIRE_VERSION: u32 = 2;

/// A byte string, encoded as msgpack `bin` (not an array of integers).
#[derive(Clone, Debug, PartialEq, Eq, Default)]
pub struct Bin(pub Vec<u8>);

impl Serialize for Bin {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_bytes(&self.0)
    }
}

struct BinVisitor;

impl<'de> Visitor<'de> for BinVisitor {
    type Value = Bin;

    fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("a byte string")
    }

    fn visit_bytes<E: de::Error>(self, v: &[u8]) -> Result<Bin, E> {
        Ok(Bin(v.to_vec()))
    }

    fn visit_byte_buf<E: de::Error>(self, v: Vec<u8>) -> Result<Bin, E> {
        Ok(Bin(v))
    }

    fn visit_str<E: de::Error>(self, v: &str) -> Result<Bin, E> {
        Ok(Bin(v.as_bytes().to_vec()))
    }
}

impl<'de> Deserialize<'de> for Bin {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        d.deserialize_byte_buf(BinVisitor)
    }
}

impl From<&OffloadKey> for Bin {
    fn from(k: &OffloadKey) -> Self {
        Self(k.to_bytes().to_vec())
    }
}

/// Bytes of a connect's nonce.
pub const NONCE_BYTES: usize = 32;
/// Bytes of a connect's authentication tag.
pub const CONNECT_TAG_BYTES: usize = 32;

/// The handshake: identity and data-plane layout of the sender.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Connect {
    /// Wire version of the sender.
    pub wire_version: u32,
    /// The sender's identity (`host:port` of its control socket).
    pub peer_id: String,
    /// A value unique to this incarnation of the sender, so a restarted peer is told apart from
    /// a duplicate `connect`.
    pub instance: u64,
    /// Random bytes fresh for this session; the session's data keys derive from both sides'
    /// nonces (see `crate::auth`).
    pub nonce: Bin,
    /// The sender's data-plane listener (`host:port`).
    pub data_addr: String,
    /// Payload bytes of one chunk; must be equal.
    pub chunk_bytes: u64,
    /// Rows of the sender's arena.
    pub num_chunks: u64,
    /// KV layout fingerprint; must be equal.
    pub layout_fingerprint: String,
    /// Hash seed; must be equal.
    pub hash_seed: String,
    /// Tag over every other field, keyed by the shared secret.
    pub auth: Bin,
}

/// One control message.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "type", rename_all = "snake_case")]
pub enum Message {
    /// Handshake (each side sends one).
    Connect(Connect),
    /// The peer registered the sender; queued messages may flow.
    ConnectAck {
        /// The acknowledging peer.
        peer_id: String,
    },
    /// Graceful close, also sent before a protocol-error teardown.
    Disconnect {
        /// Why.
        reason: String,
    },
    /// Consumer → producer: which of these keys do you hold?
    Lookup {
        /// The consumer's request id.
        kv_request_id: String,
        /// Packed keys.
        keys: Vec<Bin>,
        /// The round these keys belong to.
        round_seq: u64,
    },
    /// Producer → consumer: per-key answers, in the lookup's order.
    LookupResp {
        /// The consumer's request id.
        kv_request_id: String,
        /// The round answered.
        round_seq: u64,
        /// Packed keys.
        keys: Vec<Bin>,
        /// Hit flags, parallel to `keys`.
        hits: Vec<bool>,
    },
    /// Consumer → producer: push these keys into my rows. Empty lists end the request.
    Fetch {
        /// The consumer's request id.
        kv_request_id: String,
        /// The round fetched (closes it).
        round_seq: u64,
        /// Packed keys.
        keys: Vec<Bin>,
        /// Destination rows in the consumer's arena, parallel to `keys`.
        block_indexes: Vec<u32>,
        /// A hand-off fetch (`remote_prefiller`): keys the producer has not stored yet wait
        /// for its later stores (bounded by its load deadline) instead of failing at once.
        /// Absent on the wire when false, so a plain fetch encodes as before.
        #[serde(default, skip_serializing_if = "is_false")]
        await_stores: bool,
    },
    /// Producer → consumer: the round's data is acknowledged (or failed), per key.
    TransferDone {
        /// The consumer's request id.
        kv_request_id: String,
        /// The round.
        round_seq: u64,
        /// Every key succeeded.
        success: bool,
        /// Per-key success, parallel to the fetch's keys.
        key_ok: Vec<bool>,
    },
    /// Consumer → producer: cancel one round.
    AbortFetch {
        /// The consumer's request id.
        kv_request_id: String,
        /// The round.
        round_seq: u64,
    },
    /// Producer → consumer: the round's data plane is quiescent.
    AbortAck {
        /// The consumer's request id.
        kv_request_id: String,
        /// The round.
        round_seq: u64,
    },
}

#[allow(
    clippy::trivially_copy_pass_by_ref,
    reason = "serde's `skip_serializing_if` signature"
)]
fn is_false(b: &bool) -> bool {
    !*b
}

/// Why a payload could not be decoded (a malformed frame).
#[derive(Debug, thiserror::Error)]
#[error("malformed control frame: {0}")]
pub struct DecodeError(String);

/// A message that decoded but breaks the protocol.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
#[error("protocol violation: {0}")]
pub struct ProtocolError(pub String);

impl Message {
    /// Encodes as a msgpack map.
    #[must_use]
    pub fn encode(&self) -> Vec<u8> {
        // Serialising these plain structs into a Vec cannot fail; an empty payload would be
        // dropped as malformed by the receiver, never misread.
        rmp_serde::to_vec_named(self).unwrap_or_default()
    }

    /// Encodes as a msgpack map, appending to `buf` (reused by the caller: no allocation once
    /// it is large enough).
    pub fn encode_into(&self, buf: &mut Vec<u8>) {
        // Writing these plain structs into a Vec cannot fail (see `encode`).
        let _ = rmp_serde::encode::write_named(buf, self);
    }

    /// Decodes one payload.
    ///
    /// # Errors
    /// The payload is not a msgpack map of a known message type.
    pub fn decode(bytes: &[u8]) -> Result<Self, DecodeError> {
        rmp_serde::from_slice(bytes).map_err(|e| DecodeError(e.to_string()))
    }

    /// The message type name, for logs.
    #[must_use]
    pub fn kind(&self) -> &'static str {
        match self {
            Self::Connect(_) => "connect",
            Self::ConnectAck { .. } => "connect_ack",
            Self::Disconnect { .. } => "disconnect",
            Self::Lookup { .. } => "lookup",
            Self::LookupResp { .. } => "lookup_resp",
            Self::Fetch { .. } => "fetch",
            Self::TransferDone { .. } => "transfer_done",
            Self::AbortFetch { .. } => "abort_fetch",
            Self::AbortAck { .. } => "abort_ack",
        }
    }

    /// Checks the content rules the types cannot express.
    ///
    /// # Errors
    /// The first rule broken.
    pub fn validate(&self) -> Result<(), ProtocolError> {
        let err = |m: String| Err(ProtocolError(m));
        match self {
            Self::Connect(c) => {
                if c.peer_id.is_empty()
                    || c.data_addr.is_empty()
                    || c.chunk_bytes == 0
                    || c.num_chunks == 0
                    || c.layout_fingerprint.is_empty()
                    || c.hash_seed.is_empty()
                {
                    return err(format!("connect with empty fields: {c:?}"));
                }
                if c.nonce.0.len() != NONCE_BYTES || c.auth.0.len() != CONNECT_TAG_BYTES {
                    return err(format!(
                        "connect with a nonce of {} bytes and a tag of {} bytes",
                        c.nonce.0.len(),
                        c.auth.0.len()
                    ));
                }
            }
            Self::Lookup { keys, .. } => {
                decode_keys(keys)?;
            }
            Self::LookupResp { keys, hits, .. } => {
                decode_keys(keys)?;
                if keys.len() != hits.len() {
                    return err(format!(
                        "lookup_resp with {} keys and {} hits",
                        keys.len(),
                        hits.len()
                    ));
                }
            }
            Self::Fetch {
                keys, block_indexes, ..
            } => {
                decode_keys(keys)?;
                if keys.len() != block_indexes.len() {
                    return err(format!(
                        "fetch with {} keys and {} rows",
                        keys.len(),
                        block_indexes.len()
                    ));
                }
            }
            Self::ConnectAck { .. }
            | Self::Disconnect { .. }
            | Self::TransferDone { .. }
            | Self::AbortFetch { .. }
            | Self::AbortAck { .. } => {}
        }
        Ok(())
    }
}

/// Packs keys for the wire.
#[must_use]
pub fn encode_keys(keys: &[OffloadKey]) -> Vec<Bin> {
    keys.iter().map(Bin::from).collect()
}

/// Unpacks keys.
///
/// # Errors
/// A key of the wrong length.
pub fn decode_keys(keys: &[Bin]) -> Result<Vec<OffloadKey>, ProtocolError> {
    keys.iter()
        .map(|b| {
            OffloadKey::from_bytes(&b.0).ok_or_else(|| ProtocolError(format!("a key of {} bytes", b.0.len())))
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn keys(n: u64) -> Vec<OffloadKey> {
        (0..n).map(OffloadKey::from_u64).collect()
    }

    #[test]
    fn every_message_round_trips_as_a_map_with_a_type() {
        let msgs = vec![
            Message::Connect(Connect {
                wire_version: WIRE_VERSION,
                peer_id: "127.0.0.1:1".into(),
                instance: 7,
                nonce: Bin(vec![3; NONCE_BYTES]),
                data_addr: "127.0.0.1:2".into(),
                chunk_bytes: 64,
                num_chunks: 8,
                layout_fingerprint: "fp".into(),
                hash_seed: "0".into(),
                auth: Bin(vec![4; CONNECT_TAG_BYTES]),
            }),
            Message::ConnectAck {
                peer_id: "a:1".into(),
            },
            Message::Disconnect { reason: "bye".into() },
            Message::Lookup {
                kv_request_id: "r".into(),
                keys: encode_keys(&keys(3)),
                round_seq: 2,
            },
            Message::LookupResp {
                kv_request_id: "r".into(),
                round_seq: 2,
                keys: encode_keys(&keys(2)),
                hits: vec![true, false],
            },
            Message::Fetch {
                kv_request_id: "r".into(),
                round_seq: 0,
                keys: encode_keys(&keys(1)),
                block_indexes: vec![5],
                await_stores: false,
            },
            Message::Fetch {
                kv_request_id: "r".into(),
                round_seq: 1,
                keys: encode_keys(&keys(2)),
                block_indexes: vec![5, 6],
                await_stores: true,
            },
            Message::TransferDone {
                kv_request_id: "r".into(),
                round_seq: 0,
                success: false,
                key_ok: vec![true, false],
            },
            Message::AbortFetch {
                kv_request_id: "r".into(),
                round_seq: 1,
            },
            Message::AbortAck {
                kv_request_id: "r".into(),
                round_seq: 1,
            },
        ];
        for m in msgs {
            let bytes = m.encode();
            // A msgpack fixmap or map16 marker: the encoding is a self-describing map.
            assert!(bytes[0] & 0xf0 == 0x80 || bytes[0] == 0xde, "{}", m.kind());
            let back = Message::decode(&bytes).unwrap();
            assert_eq!(back, m);
            back.validate().unwrap();
        }
    }

    #[test]
    fn keys_travel_as_bin() {
        let m = Message::Lookup {
            kv_request_id: "r".into(),
            keys: encode_keys(&keys(1)),
            round_seq: 0,
        };
        let bytes = m.encode();
        // bin8 marker followed by the 36-byte length.
        assert!(bytes.windows(2).any(|w| w == [0xc4, 36]));
        let Message::Lookup { keys: k, .. } = Message::decode(&bytes).unwrap() else {
            panic!("wrong type")
        };
        assert_eq!(decode_keys(&k).unwrap(), keys(1));
    }

    #[test]
    fn garbage_and_unknown_types_are_decode_errors() {
        assert!(Message::decode(b"\x01\x02garbage").is_err());
        assert!(Message::decode(&[]).is_err());
        let unknown = rmp_serde::to_vec_named(&serde_json::json!({"type": "teleport"})).unwrap();
        assert!(Message::decode(&unknown).is_err());
    }

    #[test]
    fn invalid_content_is_a_protocol_error() {
        let short = Message::Lookup {
            kv_request_id: "r".into(),
            keys: vec![Bin(vec![1, 2, 3])],
            round_seq: 0,
        };
        assert!(short.validate().is_err());
        let mismatch = Message::Fetch {
            kv_request_id: "r".into(),
            round_seq: 0,
            keys: encode_keys(&keys(2)),
            block_indexes: vec![1],
            await_stores: false,
        };
        assert!(mismatch.validate().is_err());
        let resp = Message::LookupResp {
            kv_request_id: "r".into(),
            round_seq: 0,
            keys: encode_keys(&keys(2)),
            hits: vec![true],
        };
        assert!(resp.validate().is_err());
    }
}
