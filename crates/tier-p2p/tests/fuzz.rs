//! Structure-aware fuzzing of the two decoders that face peers, on the stable toolchain: the
//! control-plane message decoder (`wire::Message::decode` + `validate`) and the data-plane
//! frame decoder (`dataplane::frame`).
//!
//! Inputs are built with `arbitrary` by the shared driver (`tiering_core::testing::fuzz`: a
//! fixed-seed generator, so a failure names the input number that reproduces it): well-formed
//! messages or frame streams, then mutated (bytes flipped, inserted, removed, truncated,
//! spliced) or replaced by raw bytes. Each input must decode or fail cleanly, never panic or allocate from an unchecked
//! length; what decodes must re-encode to an equivalent value.
//!
//! The normal suite runs a short budget; the `#[ignore]`d tests run 10^6 inputs per target
//! (`KVTIER_FUZZ_INPUTS` overrides): `cargo test --release -p tier-p2p --test fuzz -- --ignored`.

use arbitrary::{Arbitrary, Unstructured};
use tier_p2p::auth::DataKey;
use tier_p2p::dataplane::frame::{self, Begin, ChunkHeader, ChunkStatus, Frame, Hello};
use tier_p2p::wire::{Bin, Connect, Message, decode_keys};
use tiering_core::KEY_BYTES;
use tiering_core::OffloadKey;
use tiering_core::testing::fuzz::{Mutation, drive, inputs, mutate};

/// A key: mostly valid (36 bytes), sometimes any length.
#[derive(Debug)]
struct AKey(Vec<u8>);

impl<'a> Arbitrary<'a> for AKey {
    fn arbitrary(u: &mut Unstructured<'a>) -> arbitrary::Result<Self> {
        if u.ratio(1, 8)? {
            return Ok(Self(Vec::arbitrary(u)?));
        }
        let mut k = vec![0u8; KEY_BYTES];
        u.fill_buffer(&mut k)?;
        Ok(Self(k))
    }
}

fn bins(keys: Vec<AKey>) -> Vec<Bin> {
    keys.into_iter().map(|k| Bin(k.0)).collect()
}

#[derive(Arbitrary, Debug)]
enum AMessage {
    Connect {
        wire_version: u32,
        peer_id: String,
        instance: u64,
        nonce: Vec<u8>,
        data_addr: String,
        chunk_bytes: u64,
        num_chunks: u64,
        layout_fingerprint: String,
        hash_seed: String,
        auth: Vec<u8>,
    },
    ConnectAck(String),
    Disconnect(String),
    Lookup(String, Vec<AKey>, u64),
    LookupResp(String, u64, Vec<AKey>, Vec<bool>),
    Fetch(String, u64, Vec<AKey>, Vec<u32>, bool),
    TransferDone(String, u64, bool, Vec<bool>),
    AbortFetch(String, u64),
    AbortAck(String, u64),
}

impl From<AMessage> for Message {
    fn from(m: AMessage) -> Self {
        match m {
            AMessage::Connect {
                wire_version,
                peer_id,
                instance,
                nonce,
                data_addr,
                chunk_bytes,
                num_chunks,
                layout_fingerprint,
                hash_seed,
                auth,
            } => Self::Connect(Connect {
                wire_version,
                peer_id,
                instance,
                nonce: Bin(nonce),
                data_addr,
                chunk_bytes,
                num_chunks,
                layout_fingerprint,
                hash_seed,
                auth: Bin(auth),
            }),
            AMessage::ConnectAck(peer_id) => Self::ConnectAck { peer_id },
            AMessage::Disconnect(reason) => Self::Disconnect { reason },
            AMessage::Lookup(kv_request_id, keys, round_seq) => Self::Lookup {
                kv_request_id,
                keys: bins(keys),
                round_seq,
            },
            AMessage::LookupResp(kv_request_id, round_seq, keys, hits) => Self::LookupResp {
                kv_request_id,
                round_seq,
                keys: bins(keys),
                hits,
            },
            AMessage::Fetch(kv_request_id, round_seq, keys, block_indexes, await_stores) => Self::Fetch {
                kv_request_id,
                round_seq,
                keys: bins(keys),
                block_indexes,
                await_stores,
            },
            AMessage::TransferDone(kv_request_id, round_seq, success, key_ok) => Self::TransferDone {
                kv_request_id,
                round_seq,
                success,
                key_ok,
            },
            AMessage::AbortFetch(kv_request_id, round_seq) => Self::AbortFetch {
                kv_request_id,
                round_seq,
            },
            AMessage::AbortAck(kv_request_id, round_seq) => Self::AbortAck {
                kv_request_id,
                round_seq,
            },
        }
    }
}

/// One control-plane input.
fn wire_case(u: &mut Unstructured<'_>) -> arbitrary::Result<()> {
    let msg: Message = AMessage::arbitrary(u)?.into();
    let encoded = msg.encode();
    // The unmutated encoding decodes to the same message.
    assert_eq!(Message::decode(&encoded).as_ref().ok(), Some(&msg));
    let input = mutate(encoded, Mutation::arbitrary(u)?, &[]);
    if let Ok(m) = Message::decode(&input) {
        let _ = m.kind();
        if m.validate().is_ok()
            && let Message::Lookup { keys, .. }
            | Message::LookupResp { keys, .. }
            | Message::Fetch { keys, .. } = &m
        {
            assert!(decode_keys(keys).is_ok(), "validated keys must decode");
        }
        // Whatever decodes re-encodes to an equivalent message.
        assert_eq!(Message::decode(&m.encode()).ok(), Some(m));
    }
    Ok(())
}

#[derive(Arbitrary, Debug)]
enum AFrame {
    Begin {
        transfer_id: u64,
        kv: String,
        round: u64,
        count: u32,
    },
    Chunk {
        index: u32,
        dst_row: u32,
        key: u64,
        payload: Vec<u8>,
        tamper: bool,
    },
    End(u32),
    Ack(u64, Vec<u8>),
}

/// One data-plane input: a HELLO and a frame stream, mutated, read back as the receiver does.
fn frame_case(u: &mut Unstructured<'_>) -> arbitrary::Result<()> {
    let dk = DataKey::from_bytes(<[u8; 32]>::arbitrary(u)?);
    let hello = Hello {
        peer_id: String::arbitrary(u)?,
        instance: u64::arbitrary(u)?,
    };
    let frames: Vec<AFrame> = u.arbitrary()?;
    let mut buf = Vec::new();
    if frame::write_hello(&mut buf, &hello).is_err() {
        return Ok(());
    }
    let mut begin = Begin {
        transfer_id: 0,
        kv_request_id: String::new(),
        round: 0,
        count: 0,
    };
    for f in &frames {
        let written = match f {
            AFrame::Begin {
                transfer_id,
                kv,
                round,
                count,
            } => {
                begin = Begin {
                    transfer_id: *transfer_id,
                    kv_request_id: kv.clone(),
                    round: *round,
                    // The decoder refuses more than 2^20 chunks (tested with mutations).
                    count: *count % ((1 << 20) + 1),
                };
                frame::write_begin(&mut buf, &dk, &begin)
            }
            AFrame::Chunk {
                index,
                dst_row,
                key,
                payload,
                tamper,
            } => {
                let h = ChunkHeader {
                    index: *index,
                    dst_row: *dst_row,
                    key: OffloadKey::from_u64(*key),
                    len: payload.len() as u32,
                };
                frame::write_chunk(&mut buf, &dk, &begin, &h, payload, |t| {
                    if *tamper { frame::begin_tag(&dk, &begin) } else { t }
                })
                .map(|_| ())
            }
            AFrame::End(n) => frame::write_end(&mut buf, *n),
            AFrame::Ack(id, st) => {
                let st: Vec<ChunkStatus> = st.iter().map(|&b| status(b)).collect();
                frame::write_ack(&mut buf, *id, &st)
            }
        };
        if written.is_err() {
            return Ok(());
        }
    }
    let mutation = Mutation::arbitrary(u)?;
    let unmutated = mutation.is_none();
    let input = mutate(buf, mutation, &[]);
    read_stream(&input, &dk, unmutated.then_some((&hello, frames.as_slice())));
    Ok(())
}

fn status(b: u8) -> ChunkStatus {
    match b % 6 {
        0 => ChunkStatus::Ok,
        1 => ChunkStatus::Rejected,
        2 => ChunkStatus::ChecksumMismatch,
        3 => ChunkStatus::BadLength,
        4 => ChunkStatus::NotSent,
        _ => ChunkStatus::IoError,
    }
}

/// Reads `input` as a receiver would (payloads into a bounded buffer, never sized by the
/// input); with `expect`, the stream is unmutated and must read back exactly, tags verifying.
fn read_stream(input: &[u8], dk: &DataKey, expect: Option<(&Hello, &[AFrame])>) {
    let mut r = input;
    let hello = frame::read_hello(&mut r);
    if let Some((h, _)) = expect {
        assert_eq!(hello.as_ref().ok(), Some(h));
    }
    if hello.is_err() {
        return;
    }
    let mut expected = expect.map(|(_, f)| f.iter());
    let mut begin: Option<Begin> = None;
    let mut dst = vec![0u8; 4096];
    loop {
        let want = expected.as_mut().map(Iterator::next);
        if let Some(Some(AFrame::Ack(id, st))) = want {
            let (rid, rst) = frame::read_ack(&mut r).expect("an unmutated ACK reads back");
            assert_eq!(rid, *id);
            assert_eq!(rst, st.iter().map(|&b| status(b)).collect::<Vec<_>>());
            continue;
        }
        if r.is_empty() {
            assert!(matches!(want, None | Some(None)), "stream ended early");
            return;
        }
        let Ok(f) = frame::read_frame(&mut r) else {
            assert!(want.is_none(), "an unmutated frame failed to read");
            // The receiver cuts the connection here; an ACK reader is tried for coverage.
            let _ = frame::read_ack(&mut r);
            return;
        };
        match f {
            Frame::Begin(b, tag) => {
                let ok = frame::begin_tag(dk, &b) == tag;
                if want.is_some() {
                    assert!(ok, "an unmutated BEGIN verifies");
                }
                begin = Some(b);
            }
            Frame::Chunk(h, tag) => {
                let b = begin.clone().unwrap_or(Begin {
                    transfer_id: 0,
                    kv_request_id: String::new(),
                    round: 0,
                    count: 0,
                });
                let header_ok = frame::header_tag(dk, &b, &h) == tag;
                let len = h.len as usize;
                let read = if len <= dst.len() {
                    frame::read_payload(&mut r, frame::payload_mac(dk, &b, &h), &mut dst[..len])
                } else {
                    frame::skip_payload(&mut r, h.len).map(|()| false)
                };
                if let Some(Some(AFrame::Chunk { tamper, payload, .. })) = want {
                    assert!(header_ok, "an unmutated chunk header verifies");
                    let ok = *read.as_ref().expect("an unmutated payload reads back");
                    if len <= dst.len() {
                        assert_eq!(ok, !*tamper, "the MAC verifies exactly when untampered");
                        assert_eq!(&dst[..len], payload.as_slice());
                    }
                }
                if read.is_err() {
                    return;
                }
            }
            Frame::End { sent } => {
                if let Some(Some(AFrame::End(n))) = want {
                    assert_eq!(sent, *n);
                }
            }
        }
    }
}

#[test]
fn fuzz_wire_decoder_short() {
    assert!(drive("wire", 20_000, 0x5eed_0001, wire_case) > 0);
}

#[test]
fn fuzz_data_frame_decoder_short() {
    assert!(drive("data-frames", 5_000, 0x5eed_0002, frame_case) > 0);
}

#[test]
#[ignore = "long run: 10^6 inputs"]
fn fuzz_wire_decoder_long() {
    assert!(drive("wire", inputs(1_000_000), 0x10c5_0001, wire_case) > 0);
}

#[test]
#[ignore = "long run: 10^6 inputs"]
fn fuzz_data_frame_decoder_long() {
    assert!(drive("data-frames", inputs(1_000_000), 0x10c5_0002, frame_case) > 0);
}
