//! The data-plane framing over one TCP connection from a producer to a consumer.
//!
//! The producer opens the connection and sends a `HELLO` naming itself; then, per transfer,
//! `BEGIN`, one `CHUNK` per row (header, then exactly `len` payload bytes), and `END`. The
//! consumer answers each transfer with one `ACK` carrying a status per chunk. Integers are
//! little-endian. `BEGIN`, each chunk header and each chunk payload carry a MAC under the
//! session's data key (see [`TransferMac`]).

use std::io::{self, Read, Write};
use std::sync::Arc;

use tiering_core::KEY_BYTES;
use tiering_core::OffloadKey;

use super::polyval::{BLOCK as POLYVAL_BLOCK, Polyval};
use crate::auth::{DataKey, TAG_BYTES, Tag, put_str};

const MAGIC: u32 = u32::from_le_bytes(*b"KVPD");
/// Data-plane framing version (4: a payload MAC folds per-piece POLYVAL hashes under BLAKE3).
pub const DATA_VERSION: u16 = 4;
const TAG_BEGIN: u8 = 1;
const TAG_CHUNK: u8 = 2;
const TAG_END: u8 = 3;
const TAG_ACK: u8 = 4;
/// Longest identity or request id accepted.
const MAX_NAME: usize = 4096;
/// Most chunks in one transfer.
const MAX_CHUNKS: u32 = 1 << 20;

/// The tag of a `BEGIN`: every field, under the session's data key.
#[must_use]
pub fn begin_tag(key: &DataKey, b: &Begin) -> Tag {
    let mut h = key.hasher(b"begin");
    absorb_begin(&mut h, b);
    h.finalize()
}

fn absorb_begin(h: &mut blake3::Hasher, b: &Begin) {
    h.update(&b.transfer_id.to_le_bytes());
    h.update(&b.round.to_le_bytes());
    put_str(h, &b.kv_request_id);
    h.update(&b.count.to_le_bytes());
}

fn absorb_header(h: &mut blake3::Hasher, c: &ChunkHeader) {
    h.update(&c.index.to_le_bytes());
    h.update(&c.dst_row.to_le_bytes());
    h.update(&c.key.to_bytes());
    h.update(&c.len.to_le_bytes());
}

/// The tag of a chunk header, bound to its transfer: checked before the destination row is
/// touched.
#[must_use]
pub fn header_tag(key: &DataKey, b: &Begin, c: &ChunkHeader) -> Tag {
    let mut h = key.hasher(b"chunk header");
    absorb_begin(&mut h, b);
    absorb_header(&mut h, c);
    h.finalize()
}

/// The MAC of a chunk's payload (see [`PayloadMac`]): header and transfer absorbed; feed the
/// payload and finalize. Bound to the key, so a chunk copied into the row of another key
/// fails too.
#[must_use]
pub fn payload_mac(key: &DataKey, b: &Begin, c: &ChunkHeader) -> PayloadMac {
    TransferMac::new(key, b).payload(c)
}

/// The MAC state of one transfer: its fields absorbed once, and its POLYVAL key.
///
/// A payload is MACed in pieces of [`PIECE`] bytes (the last may be shorter). Each piece is
/// hashed with POLYVAL (see [`super::polyval`]) under a key derived from the session's data
/// key and every `BEGIN` field, so each transfer has its own. The piece hashes are never
/// sent: each is folded, with the piece's length, into a keyed BLAKE3 over the transfer and
/// the chunk header, and that BLAKE3 output is the trailer. Forging a payload means making
/// some piece hash like another under a key the forger never sees anything of (the PRF
/// hides every hash): at most `PIECE / 16 / 2^128` per try. The fold's order binds each
/// piece to its place, the header to the chunk's row, key and length, and the transfer's
/// fields to the transfer. POLYVAL over 256 bytes per reduction (VPCLMULQDQ) runs at about
/// 3.5 times keyed BLAKE3 here, and each piece is hashed while it is in cache.
pub struct TransferMac {
    header: blake3::Hasher,
    payload: blake3::Hasher,
    polyval: Arc<Polyval>,
}

impl TransferMac {
    /// The MACs of transfer `b` under `key`.
    #[must_use]
    pub fn new(key: &DataKey, b: &Begin) -> Self {
        let mut header = key.hasher(b"chunk header");
        absorb_begin(&mut header, b);
        let mut payload = key.hasher(b"chunk payload v4");
        absorb_begin(&mut payload, b);
        let mut pk = key.hasher(b"chunk payload polyval key");
        absorb_begin(&mut pk, b);
        let mut h = [0u8; POLYVAL_BLOCK];
        h.copy_from_slice(&pk.finalize().as_bytes()[..POLYVAL_BLOCK]);
        Self {
            header,
            payload,
            polyval: Arc::new(Polyval::new(h)),
        }
    }

    /// The tag of chunk header `c` of this transfer (as [`header_tag`], without absorbing the
    /// transfer's fields again).
    #[must_use]
    pub fn header_tag(&self, c: &ChunkHeader) -> Tag {
        let mut h = self.header.clone();
        absorb_header(&mut h, c);
        h.finalize()
    }

    /// The MAC of chunk `c`'s payload, to be fed piece by piece.
    #[must_use]
    pub fn payload(&self, c: &ChunkHeader) -> PayloadMac {
        let mut fold = self.payload.clone();
        absorb_header(&mut fold, c);
        PayloadMac {
            fold,
            polyval: Arc::clone(&self.polyval),
            pieces: 0,
            ended: false,
            failed: false,
        }
    }
}

/// The MAC of one chunk's payload, fed in the wire's pieces (see [`TransferMac`]).
pub struct PayloadMac {
    fold: blake3::Hasher,
    polyval: Arc<Polyval>,
    pieces: u32,
    /// A short (last) piece was absorbed.
    ended: bool,
    failed: bool,
}

impl PayloadMac {
    /// Absorbs the next piece: [`PIECE`] bytes, or fewer for the last one. Pieces cut
    /// otherwise make the MAC fail (it would not match the peer's).
    pub fn piece(&mut self, piece: &[u8]) {
        if self.ended || piece.len() > PIECE || self.pieces == u32::MAX {
            self.failed = true;
            return;
        }
        self.ended = piece.len() < PIECE;
        self.pieces += 1;
        // POLYVAL pads the last block with zeros: the length keeps `ab` and `ab\0` apart.
        self.fold.update(&(piece.len() as u64).to_le_bytes());
        self.fold.update(&self.polyval.hash(piece));
    }

    /// Absorbs a whole payload, cut into pieces as on the wire, and finalizes.
    ///
    /// # Errors
    /// The MAC cannot be computed (see [`PayloadMac::finalize`]).
    pub fn tag_of(mut self, payload: &[u8]) -> io::Result<Tag> {
        self.pieces(payload);
        self.finalize()
    }

    /// Absorbs the next bytes of the payload, a whole number of pieces (or the payload's end),
    /// cut into pieces as on the wire.
    pub fn pieces(&mut self, bytes: &[u8]) {
        for piece in bytes.chunks(PIECE) {
            self.piece(piece);
        }
    }

    /// The MAC.
    ///
    /// # Errors
    /// The pieces were cut wrongly: there is no MAC to send or compare.
    pub fn finalize(self) -> io::Result<Tag> {
        if self.failed {
            return Err(io::Error::other("the payload MAC cannot be computed"));
        }
        Ok(self.fold.finalize())
    }
}

/// The consumer's verdict on one chunk.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[repr(u8)]
pub enum ChunkStatus {
    /// Written and verified.
    Ok = 0,
    /// The row is not reserved for an outstanding fetch of this peer (or the key differs, or it
    /// was already written): nothing was written.
    Rejected = 1,
    /// Written, but the payload's MAC did not match: the row's content is not trusted.
    ChecksumMismatch = 2,
    /// The length differs from the chunk size: nothing was written.
    BadLength = 3,
    /// The producer did not send it (cancelled, or not available).
    NotSent = 4,
    /// The connection failed before the chunk was acknowledged.
    IoError = 5,
}

impl ChunkStatus {
    fn from_u8(v: u8) -> Self {
        match v {
            0 => Self::Ok,
            1 => Self::Rejected,
            2 => Self::ChecksumMismatch,
            3 => Self::BadLength,
            4 => Self::NotSent,
            _ => Self::IoError,
        }
    }
}

fn bad(msg: impl Into<String>) -> io::Error {
    io::Error::new(io::ErrorKind::InvalidData, msg.into())
}

fn read_u8(r: &mut impl Read) -> io::Result<u8> {
    let mut b = [0u8; 1];
    r.read_exact(&mut b)?;
    Ok(b[0])
}
fn read_u16(r: &mut impl Read) -> io::Result<u16> {
    let mut b = [0u8; 2];
    r.read_exact(&mut b)?;
    Ok(u16::from_le_bytes(b))
}
fn read_u32(r: &mut impl Read) -> io::Result<u32> {
    let mut b = [0u8; 4];
    r.read_exact(&mut b)?;
    Ok(u32::from_le_bytes(b))
}
fn read_u64(r: &mut impl Read) -> io::Result<u64> {
    let mut b = [0u8; 8];
    r.read_exact(&mut b)?;
    Ok(u64::from_le_bytes(b))
}
fn read_name(r: &mut impl Read) -> io::Result<String> {
    let len = usize::from(read_u16(r)?);
    if len > MAX_NAME {
        return Err(bad("name too long"));
    }
    let mut b = vec![0u8; len];
    r.read_exact(&mut b)?;
    String::from_utf8(b).map_err(|_| bad("name is not UTF-8"))
}
fn put_name(buf: &mut Vec<u8>, s: &str) -> io::Result<()> {
    let len = u16::try_from(s.len()).map_err(|_| bad("name too long"))?;
    buf.extend_from_slice(&len.to_le_bytes());
    buf.extend_from_slice(s.as_bytes());
    Ok(())
}

/// The producer's greeting.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Hello {
    /// The producer's identity (`host:port` of its control socket).
    pub peer_id: String,
    /// The producer's incarnation (as in its `connect`).
    pub instance: u64,
}

/// Writes a `HELLO`.
///
/// # Errors
/// I/O errors.
pub fn write_hello(w: &mut impl Write, h: &Hello) -> io::Result<()> {
    let mut buf = Vec::with_capacity(32 + h.peer_id.len());
    buf.extend_from_slice(&MAGIC.to_le_bytes());
    buf.extend_from_slice(&DATA_VERSION.to_le_bytes());
    put_name(&mut buf, &h.peer_id)?;
    buf.extend_from_slice(&h.instance.to_le_bytes());
    w.write_all(&buf)
}

/// Reads a `HELLO`.
///
/// # Errors
/// I/O errors, a wrong magic or version.
pub fn read_hello(r: &mut impl Read) -> io::Result<Hello> {
    if read_u32(r)? != MAGIC {
        return Err(bad("not a kvtier data connection"));
    }
    let v = read_u16(r)?;
    if v != DATA_VERSION {
        return Err(bad(format!("data-plane version {v}, expected {DATA_VERSION}")));
    }
    let peer_id = read_name(r)?;
    let instance = read_u64(r)?;
    Ok(Hello { peer_id, instance })
}

/// The start of one transfer.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Begin {
    /// Producer-unique transfer id.
    pub transfer_id: u64,
    /// The consumer's request id.
    pub kv_request_id: String,
    /// The fetch round.
    pub round: u64,
    /// Chunks announced.
    pub count: u32,
}

/// One chunk header, followed by its [`header_tag`], `len` payload bytes and the payload's
/// [`payload_mac`] (a trailer, so both sides hash each piece while it is still in cache).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ChunkHeader {
    /// Position in the transfer.
    pub index: u32,
    /// Destination row in the consumer's arena.
    pub dst_row: u32,
    /// The chunk's key.
    pub key: OffloadKey,
    /// Payload length.
    pub len: u32,
}

/// Bytes MACed and sent (or received and MACed) at a time: part of the wire format, since a
/// payload MAC is computed per piece (see [`TransferMac`]).
pub const PIECE: usize = 256 * 1024;

/// Bytes written or read at a time, and then MACed while the copy left them in cache: whole
/// pieces, eight of them. Not part of the wire format (the MAC stays per [`PIECE`]). Written a
/// piece at a time, each end slept and woke once per piece while the other MACed, and a 16 ×
/// 2 MiB transfer cost 1.39 times a raw stream's CPU time and ran at 0.81 of its speed; in
/// spans of 2 MiB, 1.13–1.17 and 0.94–0.97 (`profile-data-*` modes of the p2p bench).
pub const SPAN: usize = 8 * PIECE;

/// What the consumer reads next.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Frame {
    /// A transfer starts (with the tag it carried).
    Begin(Begin, Tag),
    /// A chunk header (with the tag it carried); the payload follows.
    Chunk(ChunkHeader, Tag),
    /// The transfer ends after `sent` chunks.
    End {
        /// Chunks actually sent.
        sent: u32,
    },
}

/// Writes a `BEGIN` with its tag under `key`.
///
/// # Errors
/// I/O errors.
pub fn write_begin(w: &mut impl Write, key: &DataKey, b: &Begin) -> io::Result<()> {
    let mut buf = Vec::with_capacity(64 + b.kv_request_id.len());
    buf.push(TAG_BEGIN);
    buf.extend_from_slice(&b.transfer_id.to_le_bytes());
    buf.extend_from_slice(&b.round.to_le_bytes());
    put_name(&mut buf, &b.kv_request_id)?;
    buf.extend_from_slice(&b.count.to_le_bytes());
    buf.extend_from_slice(begin_tag(key, b).as_bytes());
    w.write_all(&buf)
}

/// Writes a `CHUNK` of transfer `b`: header, header tag, payload, payload MAC. `tamper` is
/// applied to the payload MAC (fault injection; identity otherwise). Returns the MAC sent.
///
/// # Errors
/// I/O errors.
pub fn write_chunk(
    w: &mut impl Write,
    key: &DataKey,
    b: &Begin,
    h: &ChunkHeader,
    payload: &[u8],
    tamper: impl FnOnce(Tag) -> Tag,
) -> io::Result<Tag> {
    let macs = TransferMac::new(key, b);
    w.write_all(&chunk_head(&macs, h))?;
    let mut mac = macs.payload(h);
    for piece in payload.chunks(PIECE) {
        w.write_all(piece)?;
        // After the write, the piece is in cache (the kernel's copy just read it).
        mac.piece(piece);
    }
    let mac = tamper(mac.finalize()?);
    w.write_all(mac.as_bytes())?;
    Ok(mac)
}

const CHUNK_HEAD: usize = 1 + 4 + 4 + KEY_BYTES + 4;

/// A `CHUNK`'s header and header tag.
pub(crate) fn chunk_head(macs: &TransferMac, h: &ChunkHeader) -> [u8; CHUNK_HEAD + TAG_BYTES] {
    let mut buf = [0u8; CHUNK_HEAD + TAG_BYTES];
    buf[0] = TAG_CHUNK;
    buf[1..5].copy_from_slice(&h.index.to_le_bytes());
    buf[5..9].copy_from_slice(&h.dst_row.to_le_bytes());
    buf[9..9 + KEY_BYTES].copy_from_slice(&h.key.to_bytes());
    let o = 9 + KEY_BYTES;
    buf[o..o + 4].copy_from_slice(&h.len.to_le_bytes());
    buf[CHUNK_HEAD..].copy_from_slice(macs.header_tag(h).as_bytes());
    buf
}

/// Appends a `CHUNK`'s header and header tag (the payload and its MAC follow).
pub(crate) fn put_chunk_header(buf: &mut Vec<u8>, macs: &TransferMac, h: &ChunkHeader) {
    buf.extend_from_slice(&chunk_head(macs, h));
}

/// Reads a chunk's payload into `dst` (exactly `dst.len()` bytes) and its MAC trailer; returns
/// whether the MAC matches (`mac` is [`payload_mac`] of the chunk).
///
/// # Errors
/// I/O errors.
pub fn read_payload(r: &mut impl Read, mut mac: PayloadMac, dst: &mut [u8]) -> io::Result<bool> {
    for span in dst.chunks_mut(SPAN) {
        r.read_exact(span)?;
        // Just written by the kernel's copy: in cache, or most of it.
        mac.pieces(span);
    }
    let sent = read_tag(r)?;
    // Tags compare in constant time; a MAC that cannot be computed verifies nothing.
    Ok(mac.finalize().is_ok_and(|m| m == sent))
}

/// Reads and discards a chunk's payload of `len` bytes and its trailer.
///
/// # Errors
/// I/O errors.
pub fn skip_payload(r: &mut impl Read, len: u32) -> io::Result<()> {
    skip(r, u64::from(len) + TAG_BYTES as u64)
}

fn read_tag(r: &mut impl Read) -> io::Result<Tag> {
    let mut b = [0u8; TAG_BYTES];
    r.read_exact(&mut b)?;
    Ok(Tag::from_bytes(b))
}

/// Writes an `END`.
///
/// # Errors
/// I/O errors.
pub fn write_end(w: &mut impl Write, sent: u32) -> io::Result<()> {
    w.write_all(&end_frame(sent))
}

/// An `END`'s bytes.
pub(crate) fn end_frame(sent: u32) -> [u8; 5] {
    let mut buf = [0u8; 5];
    buf[0] = TAG_END;
    buf[1..].copy_from_slice(&sent.to_le_bytes());
    buf
}

/// Reads the next frame header (a chunk's payload is left unread).
///
/// # Errors
/// I/O errors and malformed frames.
pub fn read_frame(r: &mut impl Read) -> io::Result<Frame> {
    match read_u8(r)? {
        TAG_BEGIN => {
            let transfer_id = read_u64(r)?;
            let round = read_u64(r)?;
            let kv_request_id = read_name(r)?;
            let count = read_u32(r)?;
            if count > MAX_CHUNKS {
                return Err(bad("too many chunks in one transfer"));
            }
            let tag = read_tag(r)?;
            Ok(Frame::Begin(
                Begin {
                    transfer_id,
                    kv_request_id,
                    round,
                    count,
                },
                tag,
            ))
        }
        TAG_CHUNK => {
            let index = read_u32(r)?;
            let dst_row = read_u32(r)?;
            let mut kb = [0u8; KEY_BYTES];
            r.read_exact(&mut kb)?;
            let key = OffloadKey::from_bytes(&kb).ok_or_else(|| bad("bad key"))?;
            let len = read_u32(r)?;
            let tag = read_tag(r)?;
            Ok(Frame::Chunk(
                ChunkHeader {
                    index,
                    dst_row,
                    key,
                    len,
                },
                tag,
            ))
        }
        TAG_END => Ok(Frame::End { sent: read_u32(r)? }),
        t => Err(bad(format!("unknown data frame tag {t}"))),
    }
}

/// Writes an `ACK`.
///
/// # Errors
/// I/O errors.
pub fn write_ack(w: &mut impl Write, transfer_id: u64, statuses: &[ChunkStatus]) -> io::Result<()> {
    let count = u32::try_from(statuses.len()).map_err(|_| bad("too many statuses"))?;
    let mut buf = Vec::with_capacity(13 + statuses.len());
    buf.push(TAG_ACK);
    buf.extend_from_slice(&transfer_id.to_le_bytes());
    buf.extend_from_slice(&count.to_le_bytes());
    buf.extend(statuses.iter().map(|s| *s as u8));
    w.write_all(&buf)
}

/// Reads an `ACK`.
///
/// # Errors
/// I/O errors and malformed frames.
pub fn read_ack(r: &mut impl Read) -> io::Result<(u64, Vec<ChunkStatus>)> {
    if read_u8(r)? != TAG_ACK {
        return Err(bad("expected an ACK"));
    }
    let id = read_u64(r)?;
    let count = read_u32(r)?;
    if count > MAX_CHUNKS {
        return Err(bad("too many statuses"));
    }
    let mut b = vec![0u8; count as usize];
    r.read_exact(&mut b)?;
    Ok((id, b.into_iter().map(ChunkStatus::from_u8).collect()))
}

/// Reads and discards `len` bytes (a rejected chunk's payload).
///
/// # Errors
/// I/O errors.
pub fn skip(r: &mut impl Read, len: u64) -> io::Result<()> {
    let copied = io::copy(&mut r.take(len), &mut io::sink())?;
    if copied == len {
        Ok(())
    } else {
        Err(io::Error::from(io::ErrorKind::UnexpectedEof))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn flip(t: Tag) -> Tag {
        let mut b = *t.as_bytes();
        b[0] ^= 1;
        Tag::from_bytes(b)
    }

    #[test]
    fn frames_round_trip_and_tags_verify() {
        let dk = DataKey::from_bytes([9; 32]);
        let mut buf = Vec::new();
        let h = Hello {
            peer_id: "127.0.0.1:9".into(),
            instance: 3,
        };
        write_hello(&mut buf, &h).unwrap();
        let b = Begin {
            transfer_id: 1,
            kv_request_id: "req".into(),
            round: 2,
            count: 2,
        };
        write_begin(&mut buf, &dk, &b).unwrap();
        let key = OffloadKey::from_u64(5);
        let payload = [7u8; 16];
        let ch = ChunkHeader {
            index: 0,
            dst_row: 4,
            key,
            len: 16,
        };
        let sent = write_chunk(&mut buf, &dk, &b, &ch, &payload, |s| s).unwrap();
        let one_shot = payload_mac(&dk, &b, &ch).tag_of(&payload).unwrap();
        assert_eq!(sent, one_shot, "streamed and one-shot MACs agree");
        let ch2 = ChunkHeader { index: 1, ..ch };
        write_chunk(&mut buf, &dk, &b, &ch2, &payload, flip).unwrap();
        write_end(&mut buf, 2).unwrap();
        write_ack(&mut buf, 1, &[ChunkStatus::Ok, ChunkStatus::ChecksumMismatch]).unwrap();
        let mut r = buf.as_slice();
        assert_eq!(read_hello(&mut r).unwrap(), h);
        assert_eq!(
            read_frame(&mut r).unwrap(),
            Frame::Begin(b.clone(), begin_tag(&dk, &b))
        );
        assert_eq!(
            read_frame(&mut r).unwrap(),
            Frame::Chunk(ch, header_tag(&dk, &b, &ch))
        );
        let mut dst = [0u8; 16];
        assert!(read_payload(&mut r, payload_mac(&dk, &b, &ch), &mut dst).unwrap());
        assert_eq!(dst, payload);
        assert_eq!(
            read_frame(&mut r).unwrap(),
            Frame::Chunk(ch2, header_tag(&dk, &b, &ch2))
        );
        assert!(
            !read_payload(&mut r, payload_mac(&dk, &b, &ch2), &mut dst).unwrap(),
            "a tampered trailer fails"
        );
        assert_eq!(read_frame(&mut r).unwrap(), Frame::End { sent: 2 });
        assert_eq!(
            read_ack(&mut r).unwrap(),
            (1, vec![ChunkStatus::Ok, ChunkStatus::ChecksumMismatch])
        );
        assert!(r.is_empty());
    }

    #[test]
    fn tags_bind_key_session_transfer_and_position() {
        let dk = DataKey::from_bytes([9; 32]);
        let b = Begin {
            transfer_id: 1,
            kv_request_id: "req".into(),
            round: 2,
            count: 2,
        };
        let c = ChunkHeader {
            index: 0,
            dst_row: 4,
            key: OffloadKey::from_u64(1),
            len: 16,
        };
        let t = header_tag(&dk, &b, &c);
        assert_ne!(
            t,
            header_tag(&DataKey::from_bytes([8; 32]), &b, &c),
            "another session"
        );
        assert_ne!(
            t,
            header_tag(
                &dk,
                &Begin {
                    round: 3,
                    ..b.clone()
                },
                &c
            ),
            "another round"
        );
        assert_ne!(
            t,
            header_tag(
                &dk,
                &Begin {
                    transfer_id: 2,
                    ..b.clone()
                },
                &c
            )
        );
        assert_ne!(
            t,
            header_tag(&dk, &b, &ChunkHeader { dst_row: 5, ..c }),
            "another row"
        );
        assert_ne!(
            t,
            header_tag(
                &dk,
                &b,
                &ChunkHeader {
                    key: OffloadKey::from_u64(2),
                    ..c
                }
            )
        );
        assert_ne!(t, header_tag(&dk, &b, &ChunkHeader { index: 1, ..c }));
        assert_ne!(
            begin_tag(&dk, &b),
            begin_tag(
                &dk,
                &Begin {
                    count: 3,
                    ..b.clone()
                }
            )
        );
    }

    /// The payload MAC covers every byte in its place: each piece is bound to its
    /// position (swapped pieces fail), to the chunk and to the transfer.
    #[test]
    fn payload_macs_bind_every_piece_its_position_the_chunk_and_the_transfer() {
        let dk = DataKey::from_bytes([3; 32]);
        let b = Begin {
            transfer_id: 7,
            kv_request_id: "req".into(),
            round: 1,
            count: 4,
        };
        let c = ChunkHeader {
            index: 2,
            dst_row: 9,
            key: OffloadKey::from_u64(11),
            len: (2 * PIECE + 100) as u32,
        };
        let mut payload: Vec<u8> = (0..c.len as usize).map(|i| (i % 251) as u8).collect();
        payload[..PIECE].fill(1);
        payload[PIECE..2 * PIECE].fill(2);
        let macs = TransferMac::new(&dk, &b);
        assert_eq!(macs.header_tag(&c), header_tag(&dk, &b, &c));
        let tag = macs.payload(&c).tag_of(&payload).unwrap();
        assert_eq!(tag, payload_mac(&dk, &b, &c).tag_of(&payload).unwrap());

        let mut swapped = payload.clone();
        swapped[..PIECE].fill(2);
        swapped[PIECE..2 * PIECE].fill(1);
        assert_ne!(tag, macs.payload(&c).tag_of(&swapped).unwrap(), "pieces swapped");
        let mut last = payload.clone();
        *last.last_mut().unwrap() ^= 0x80;
        assert_ne!(
            tag,
            macs.payload(&c).tag_of(&last).unwrap(),
            "a bit of the last piece"
        );
        let mut first = payload.clone();
        first[0] ^= 1;
        assert_ne!(
            tag,
            macs.payload(&c).tag_of(&first).unwrap(),
            "a bit of the first piece"
        );
        for other in [
            ChunkHeader { index: 3, ..c },
            ChunkHeader { dst_row: 8, ..c },
            ChunkHeader {
                key: OffloadKey::from_u64(12),
                ..c
            },
        ] {
            assert_ne!(tag, macs.payload(&other).tag_of(&payload).unwrap(), "{other:?}");
        }
        let next = Begin {
            transfer_id: 8,
            ..b.clone()
        };
        assert_ne!(
            tag,
            payload_mac(&dk, &next, &c).tag_of(&payload).unwrap(),
            "another transfer"
        );
        assert_ne!(
            tag,
            payload_mac(&DataKey::from_bytes([4; 32]), &b, &c)
                .tag_of(&payload)
                .unwrap(),
            "another session"
        );

        // Fed in the wire's pieces, the streaming MAC equals the one-shot one; cut otherwise,
        // it refuses to produce a MAC at all.
        let mut streamed = macs.payload(&c);
        for piece in payload.chunks(PIECE) {
            streamed.piece(piece);
        }
        assert_eq!(streamed.finalize().unwrap(), tag);
        let mut miscut = macs.payload(&c);
        for piece in payload.chunks(PIECE / 2) {
            miscut.piece(piece);
        }
        assert!(miscut.finalize().is_err());
        let mut oversized = macs.payload(&c);
        oversized.piece(&payload[..PIECE + 1]);
        assert!(oversized.finalize().is_err());
    }

    /// The payload trailer of a fixed chunk, as version 4 of the wire computes it (pinned from
    /// the in-house POLYVAL; RustCrypto's `polyval` in its place gives the same): two whole
    /// pieces and a short one whose length is not a multiple of the 256-byte stride nor of a
    /// block. A change here is a wire change (`DATA_VERSION`).
    #[test]
    fn the_payload_trailer_is_the_wire_v4_known_answer() {
        let dk = DataKey::from_bytes(std::array::from_fn(|i| i as u8));
        let b = Begin {
            transfer_id: 0x0123_4567_89ab_cdef,
            kv_request_id: "known answer".into(),
            round: 3,
            count: 1,
        };
        let c = ChunkHeader {
            index: 0,
            dst_row: 5,
            key: OffloadKey::from_u64(42),
            len: (2 * PIECE + 1000 + 7) as u32,
        };
        let payload: Vec<u8> = (0..c.len as usize).map(|i| (i * 131 + i / 977) as u8).collect();
        let tag = TransferMac::new(&dk, &b).payload(&c).tag_of(&payload).unwrap();
        assert_eq!(
            tag.to_hex().as_str(),
            "3f53f1de6aabf065e3f534e8ae3a7265ee5fcb05f51286de9822bbdbde1f9136"
        );
    }

    /// One chunk's frame on the wire (header, tag, payload, trailer) and where its payload
    /// starts in it.
    fn chunk_wire(dk: &DataKey, b: &Begin, c: &ChunkHeader, payload: &[u8]) -> (Vec<u8>, usize) {
        let mut w = Vec::new();
        write_chunk(&mut w, dk, b, c, payload, |t| t).unwrap();
        (w, CHUNK_HEAD + TAG_BYTES)
    }

    /// Reads one chunk frame as the consumer does: `None` when the header tag fails (the
    /// connection is cut), else whether the payload verified; an I/O error (truncation)
    /// passes through.
    fn consume(dk: &DataKey, b: &Begin, wire: &[u8]) -> io::Result<Option<bool>> {
        let mut r = wire;
        let Frame::Chunk(h, tag) = read_frame(&mut r)? else {
            panic!("expected a chunk")
        };
        let macs = TransferMac::new(dk, b);
        if macs.header_tag(&h) != tag {
            return Ok(None);
        }
        let mut dst = vec![0u8; h.len as usize];
        let ok = read_payload(&mut r, macs.payload(&h), &mut dst)?;
        assert!(r.is_empty(), "the frame was read whole");
        Ok(Some(ok))
    }

    /// Every payload byte is authenticated on the wire: a flipped byte in any piece, pieces
    /// swapped, a piece replayed from another chunk or from an earlier transfer of the same
    /// session, and a frame cut short are all refused; the untouched frame verifies.
    #[test]
    fn tampered_truncated_replayed_and_reordered_pieces_are_refused() {
        let dk = DataKey::from_bytes([6; 32]);
        let b = Begin {
            transfer_id: 3,
            kv_request_id: "req".into(),
            round: 1,
            count: 2,
        };
        let len = 2 * PIECE + 1000;
        let c = ChunkHeader {
            index: 0,
            dst_row: 7,
            key: OffloadKey::from_u64(70),
            len: len as u32,
        };
        let payload: Vec<u8> = (0..len).map(|i| (i * 7 + i / PIECE) as u8).collect();
        let (wire, at) = chunk_wire(&dk, &b, &c, &payload);
        assert_eq!(consume(&dk, &b, &wire).unwrap(), Some(true));

        for (what, offset) in [
            ("first byte", 0),
            ("inside the first piece", 12_345),
            ("last byte of a whole piece", PIECE - 1),
            ("inside the second piece", PIECE + 16),
            ("the short last piece", 2 * PIECE + 999),
        ] {
            let mut t = wire.clone();
            t[at + offset] ^= 0x01;
            assert_eq!(consume(&dk, &b, &t).unwrap(), Some(false), "{what}");
        }
        let mut trailer = wire.clone();
        *trailer.last_mut().unwrap() ^= 0x80;
        assert_eq!(consume(&dk, &b, &trailer).unwrap(), Some(false), "the trailer");

        let mut swapped = wire.clone();
        swapped[at..at + PIECE].copy_from_slice(&payload[PIECE..2 * PIECE]);
        swapped[at + PIECE..at + 2 * PIECE].copy_from_slice(&payload[..PIECE]);
        assert_eq!(consume(&dk, &b, &swapped).unwrap(), Some(false), "pieces swapped");

        // The same place of another chunk of this transfer, with a piece that chunk verified.
        let other = ChunkHeader {
            index: 1,
            dst_row: 8,
            key: OffloadKey::from_u64(71),
            ..c
        };
        let other_payload: Vec<u8> = payload.iter().map(|v| v ^ 0x55).collect();
        let (other_wire, _) = chunk_wire(&dk, &b, &other, &other_payload);
        assert_eq!(consume(&dk, &b, &other_wire).unwrap(), Some(true));
        let mut replayed = wire.clone();
        replayed[at..at + PIECE].copy_from_slice(&other_payload[..PIECE]);
        assert_eq!(
            consume(&dk, &b, &replayed).unwrap(),
            Some(false),
            "a piece of another chunk"
        );

        // The whole frame of an earlier transfer: its header tag no longer verifies; and its
        // payload and trailer under this transfer's header do not verify either.
        let earlier = Begin {
            transfer_id: 2,
            ..b.clone()
        };
        let (old_wire, _) = chunk_wire(&dk, &earlier, &c, &payload);
        assert_eq!(consume(&dk, &b, &old_wire).unwrap(), None, "a replayed frame");
        let mut spliced = wire[..at].to_vec();
        spliced.extend_from_slice(&old_wire[at..]);
        assert_eq!(
            consume(&dk, &b, &spliced).unwrap(),
            Some(false),
            "an earlier transfer's payload and trailer"
        );

        // Cut anywhere after the header: the reader never reports the chunk as verified.
        for cut in [at, at + 1, at + PIECE, at + len - 1, at + len, wire.len() - 1] {
            let e = consume(&dk, &b, &wire[..cut]).unwrap_err();
            assert_eq!(e.kind(), io::ErrorKind::UnexpectedEof, "cut at {cut}");
        }
        // A header that announces fewer bytes than were MACed fails at the header tag.
        let mut shorter = wire.clone();
        let o = 9 + KEY_BYTES;
        shorter[o..o + 4].copy_from_slice(&((len - PIECE) as u32).to_le_bytes());
        assert_eq!(consume(&dk, &b, &shorter[..wire.len() - PIECE]).unwrap(), None);
    }

    #[test]
    fn oversized_headers_are_refused_from_their_length_fields_before_any_body_is_read() {
        // Only the length fields are present: reading (or allocating) a body would end in
        // UnexpectedEof, refusing from the header ends in InvalidData.
        let mut name = vec![TAG_BEGIN];
        name.extend_from_slice(&[0; 16]);
        name.extend_from_slice(&u16::MAX.to_le_bytes());
        let e = read_frame(&mut name.as_slice()).unwrap_err();
        assert_eq!(e.kind(), io::ErrorKind::InvalidData, "{e}");
        let mut count = vec![TAG_BEGIN];
        count.extend_from_slice(&[0; 16]);
        count.extend_from_slice(&1u16.to_le_bytes());
        count.push(b'r');
        count.extend_from_slice(&u32::MAX.to_le_bytes());
        let e = read_frame(&mut count.as_slice()).unwrap_err();
        assert_eq!(e.kind(), io::ErrorKind::InvalidData, "{e}");
        let mut ack = vec![TAG_ACK];
        ack.extend_from_slice(&[0; 8]);
        ack.extend_from_slice(&u32::MAX.to_le_bytes());
        let e = read_ack(&mut ack.as_slice()).unwrap_err();
        assert_eq!(e.kind(), io::ErrorKind::InvalidData, "{e}");
        let mut hello = MAGIC.to_le_bytes().to_vec();
        hello.extend_from_slice(&DATA_VERSION.to_le_bytes());
        hello.extend_from_slice(&u16::MAX.to_le_bytes());
        let e = read_hello(&mut hello.as_slice()).unwrap_err();
        assert_eq!(e.kind(), io::ErrorKind::InvalidData, "{e}");
    }

    #[test]
    fn garbage_is_rejected() {
        assert!(read_hello(&mut &b"HTTP/1.1 200"[..]).is_err());
        assert!(read_frame(&mut &[9u8, 0, 0][..]).is_err());
        assert!(skip(&mut &[0u8; 3][..], 4).is_err());
    }
}
