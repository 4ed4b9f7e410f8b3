//! The on-disk format: a superblock, then fixed slots of `header block | payload | commit block`.
//!
//! ```text
//! offset 0           superblock (4 KiB): magic, format version, chunk geometry, slot count
//! 4 KiB + i·slot     slot i: header (4 KiB) | payload (chunk_bytes rounded up to 4 KiB) | commit (4 KiB)
//! ```
//!
//! A slot is written with **one** vectored write, header first and commit block last. The header
//! holds magic, format version, a sequence number unique to this write, the key, the payload
//! length and an xxh3 checksum of the header fields plus the payload; the commit block repeats
//! the sequence and the checksum. A write that was cut short (the process was killed in the
//! middle of it, the disk filled) leaves a new header with an old or missing commit block, so the
//! start-up scan discards the slot without reading its payload. Every load additionally verifies
//! the payload checksum, which also catches corruption that a crash cannot explain.
//!
//! Every block is 4 KiB so every I/O is aligned for `O_DIRECT`.

use std::fmt;

use tiering_core::OffloadKey;
use tiering_core::key::KEY_BYTES;
use xxhash_rust::xxh3::{Xxh3Default, xxh3_64};

/// The alignment and size of the superblock, the slot header and the commit block.
pub const BLOCK: usize = 4096;
/// The format version written in the superblock and in every header.
pub const FORMAT_VERSION: u32 = 1;

const SUPER_MAGIC: [u8; 8] = *b"KVTDISK\0";
const HEADER_MAGIC: [u8; 8] = *b"KVTSLOT\0";
const COMMIT_MAGIC: [u8; 8] = *b"KVTCMIT\0";

const SUPER_LEN: usize = 48;
const HEADER_CHECKED: usize = 72;
/// Bytes of the header block that carry the header.
pub const HEADER_LEN: usize = 88;
const COMMIT_LEN: usize = 32;

fn u32_at(b: &[u8], at: usize) -> u32 {
    let mut w = [0u8; 4];
    w.copy_from_slice(&b[at..at + 4]);
    u32::from_le_bytes(w)
}

fn u64_at(b: &[u8], at: usize) -> u64 {
    let mut w = [0u8; 8];
    w.copy_from_slice(&b[at..at + 8]);
    u64::from_le_bytes(w)
}

/// Where everything lives in a slab file of a given geometry.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SlabLayout {
    /// Payload bytes per chunk.
    pub chunk_bytes: usize,
    /// Payload bytes reserved per slot: `chunk_bytes` rounded up to [`BLOCK`].
    pub payload_span: usize,
    /// Bytes per slot: header block + payload span + commit block.
    pub slot_bytes: u64,
    /// Number of slots.
    pub num_slots: u32,
}

impl SlabLayout {
    /// The layout for `chunk_bytes` within `capacity` bytes of file, or `None` when not even one
    /// slot fits (or the numbers overflow).
    #[must_use]
    pub fn for_capacity(chunk_bytes: usize, capacity: u64) -> Option<Self> {
        let payload_span = chunk_bytes.checked_next_multiple_of(BLOCK)?;
        let slot_bytes = u64::try_from(payload_span).ok()?.checked_add(2 * BLOCK as u64)?;
        let slots = capacity.checked_sub(BLOCK as u64)? / slot_bytes;
        let num_slots = u32::try_from(slots.min(u64::from(u32::MAX))).ok()?;
        (num_slots > 0 && chunk_bytes > 0).then_some(Self {
            chunk_bytes,
            payload_span,
            slot_bytes,
            num_slots,
        })
    }

    /// The file offset of slot `slot`'s header block.
    #[must_use]
    pub fn slot_offset(&self, slot: u32) -> u64 {
        BLOCK as u64 + u64::from(slot) * self.slot_bytes
    }

    /// The file offset of slot `slot`'s commit block.
    #[must_use]
    pub fn commit_offset(&self, slot: u32) -> u64 {
        self.slot_offset(slot) + self.slot_bytes - BLOCK as u64
    }

    /// Padding between the payload and the commit block.
    #[must_use]
    pub fn pad(&self) -> usize {
        self.payload_span - self.chunk_bytes
    }

    /// The size of the whole file.
    #[must_use]
    pub fn file_len(&self) -> u64 {
        self.slot_offset(self.num_slots)
    }
}

/// The first block of the file: what the slab was formatted for.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Superblock {
    /// Format version.
    pub format_version: u32,
    /// Block size.
    pub block: u32,
    /// Payload bytes per chunk.
    pub chunk_bytes: u64,
    /// Bytes per slot.
    pub slot_bytes: u64,
    /// Slots in the file when it was last opened.
    pub num_slots: u64,
}

/// What [`Superblock::decode`] found.
#[derive(Debug, PartialEq, Eq)]
pub enum SuperblockRead {
    /// An all-zero block: a file that was never formatted (or whose formatting did not finish).
    Blank,
    /// A valid superblock.
    Valid(Superblock),
    /// Something else; the reason says what.
    Foreign(String),
}

impl Superblock {
    /// The superblock describing `layout`.
    #[must_use]
    pub fn for_layout(layout: &SlabLayout) -> Self {
        Self {
            format_version: FORMAT_VERSION,
            block: BLOCK as u32,
            chunk_bytes: layout.chunk_bytes as u64,
            slot_bytes: layout.slot_bytes,
            num_slots: u64::from(layout.num_slots),
        }
    }

    /// Writes the superblock into the first bytes of `out` (at least one [`BLOCK`]); the rest
    /// of the block is zeroed.
    pub fn encode(&self, out: &mut [u8]) {
        out[..BLOCK].fill(0);
        out[0..8].copy_from_slice(&SUPER_MAGIC);
        out[8..12].copy_from_slice(&self.format_version.to_le_bytes());
        out[12..16].copy_from_slice(&self.block.to_le_bytes());
        out[16..24].copy_from_slice(&self.chunk_bytes.to_le_bytes());
        out[24..32].copy_from_slice(&self.slot_bytes.to_le_bytes());
        out[32..40].copy_from_slice(&self.num_slots.to_le_bytes());
        let crc = xxh3_64(&out[..40]);
        out[40..SUPER_LEN].copy_from_slice(&crc.to_le_bytes());
    }

    /// Reads a superblock from a block.
    #[must_use]
    pub fn decode(block: &[u8]) -> SuperblockRead {
        if block.len() < SUPER_LEN {
            return SuperblockRead::Foreign("file shorter than a superblock".to_owned());
        }
        if block[..BLOCK.min(block.len())].iter().all(|&b| b == 0) {
            return SuperblockRead::Blank;
        }
        if block[0..8] != SUPER_MAGIC {
            return SuperblockRead::Foreign("bad magic".to_owned());
        }
        if xxh3_64(&block[..40]) != u64_at(block, 40) {
            return SuperblockRead::Foreign("superblock checksum mismatch".to_owned());
        }
        SuperblockRead::Valid(Self {
            format_version: u32_at(block, 8),
            block: u32_at(block, 12),
            chunk_bytes: u64_at(block, 16),
            slot_bytes: u64_at(block, 24),
            num_slots: u64_at(block, 32),
        })
    }
}

impl fmt::Display for Superblock {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "format v{}, {}-byte chunks in {}-byte slots",
            self.format_version, self.chunk_bytes, self.slot_bytes
        )
    }
}

/// The header block of one slot.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SlotHeader {
    /// The write's sequence number (unique per write, increasing over the slab's life).
    pub seq: u64,
    /// The chunk's key.
    pub key: OffloadKey,
    /// Payload bytes.
    pub payload_len: u64,
    /// xxh3 of the header fields (bytes 0..72) followed by the payload.
    pub checksum: u64,
}

impl SlotHeader {
    fn write_fields(seq: u64, key: &OffloadKey, payload_len: u64, out: &mut [u8]) {
        let end = out.len().min(BLOCK);
        out[..end].fill(0);
        out[0..8].copy_from_slice(&HEADER_MAGIC);
        out[8..12].copy_from_slice(&FORMAT_VERSION.to_le_bytes());
        out[16..24].copy_from_slice(&seq.to_le_bytes());
        out[24..24 + KEY_BYTES].copy_from_slice(&key.to_bytes());
        out[64..72].copy_from_slice(&payload_len.to_le_bytes());
    }

    /// Encodes the header for `payload` into `out` (at least [`HEADER_LEN`] bytes; the rest of
    /// the first block is zeroed), computing the checksum. Returns the header.
    pub fn encode_for(seq: u64, key: &OffloadKey, payload: &[u8], out: &mut [u8]) -> Self {
        let payload_len = payload.len() as u64;
        Self::write_fields(seq, key, payload_len, out);
        let checksum = content_checksum(&out[..HEADER_CHECKED], payload);
        out[72..80].copy_from_slice(&checksum.to_le_bytes());
        let crc = xxh3_64(&out[..80]);
        out[80..HEADER_LEN].copy_from_slice(&crc.to_le_bytes());
        Self {
            seq,
            key: *key,
            payload_len,
            checksum,
        }
    }

    /// Decodes a header block; `None` unless magic, version and the header's own checksum are
    /// right.
    #[must_use]
    pub fn decode(block: &[u8]) -> Option<Self> {
        if block.len() < HEADER_LEN || block[0..8] != HEADER_MAGIC || u32_at(block, 8) != FORMAT_VERSION {
            return None;
        }
        if xxh3_64(&block[..80]) != u64_at(block, 80) {
            return None;
        }
        Some(Self {
            seq: u64_at(block, 16),
            key: OffloadKey::from_bytes(&block[24..24 + KEY_BYTES])?,
            payload_len: u64_at(block, 64),
            checksum: u64_at(block, 72),
        })
    }

    /// Whether `payload` (read along with this header from `block`) matches the checksum.
    #[must_use]
    pub fn payload_matches(&self, block: &[u8], payload: &[u8]) -> bool {
        payload.len() as u64 == self.payload_len
            && content_checksum(&block[..HEADER_CHECKED], payload) == self.checksum
    }
}

/// The commit block that closes a slot write.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SlotCommit {
    /// Must equal the header's sequence.
    pub seq: u64,
    /// Must equal the header's checksum.
    pub checksum: u64,
}

impl SlotCommit {
    /// The commit block that seals `header`.
    #[must_use]
    pub fn sealing(header: &SlotHeader) -> Self {
        Self {
            seq: header.seq,
            checksum: header.checksum,
        }
    }

    /// Encodes into the first bytes of `out` and zeroes the rest of the first block.
    pub fn encode(&self, out: &mut [u8]) {
        let end = out.len().min(BLOCK);
        out[..end].fill(0);
        out[0..8].copy_from_slice(&COMMIT_MAGIC);
        out[8..16].copy_from_slice(&self.seq.to_le_bytes());
        out[16..24].copy_from_slice(&self.checksum.to_le_bytes());
        let crc = xxh3_64(&out[..24]);
        out[24..COMMIT_LEN].copy_from_slice(&crc.to_le_bytes());
    }

    /// Decodes a commit block; `None` unless magic and checksum are right.
    #[must_use]
    pub fn decode(block: &[u8]) -> Option<Self> {
        if block.len() < COMMIT_LEN
            || block[0..8] != COMMIT_MAGIC
            || xxh3_64(&block[..24]) != u64_at(block, 24)
        {
            return None;
        }
        Some(Self {
            seq: u64_at(block, 8),
            checksum: u64_at(block, 16),
        })
    }

    /// Whether this commit block seals `header`.
    #[must_use]
    pub fn seals(&self, header: &SlotHeader) -> bool {
        self.seq == header.seq && self.checksum == header.checksum
    }
}

fn content_checksum(header_fields: &[u8], payload: &[u8]) -> u64 {
    let mut h = Xxh3Default::new();
    h.update(header_fields);
    h.update(payload);
    h.digest()
}

/// Why a slot read was rejected.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum SlotDefect {
    /// Fewer bytes than a slot came back (the file was truncated).
    ShortRead,
    /// The header is missing or damaged.
    BadHeader,
    /// The header names another key or write than the index expects.
    WrongOccupant,
    /// The commit block is missing, damaged or belongs to another write.
    NotCommitted,
    /// The payload does not match its checksum.
    Checksum,
}

impl fmt::Display for SlotDefect {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Self::ShortRead => "short read",
            Self::BadHeader => "damaged header",
            Self::WrongOccupant => "header names another chunk",
            Self::NotCommitted => "slot write never completed (no matching commit block)",
            Self::Checksum => "payload checksum mismatch",
        })
    }
}

/// Verifies a slot read back in full: its header block, payload and commit block, against the
/// key and write sequence the index expects in that slot.
///
/// # Errors
/// The first defect found.
pub fn verify_slot(
    header_block: &[u8],
    payload: &[u8],
    commit_block: &[u8],
    expect_key: &OffloadKey,
    expect_seq: u64,
) -> Result<SlotHeader, SlotDefect> {
    let header = SlotHeader::decode(header_block).ok_or(SlotDefect::BadHeader)?;
    if header.key != *expect_key || header.seq != expect_seq {
        return Err(SlotDefect::WrongOccupant);
    }
    if !SlotCommit::decode(commit_block).is_some_and(|c| c.seals(&header)) {
        return Err(SlotDefect::NotCommitted);
    }
    if !header.payload_matches(header_block, payload) {
        return Err(SlotDefect::Checksum);
    }
    Ok(header)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn layout_fits_capacity_and_aligns_every_slot() {
        let l = SlabLayout::for_capacity(10_000, 1 << 20).unwrap();
        assert_eq!(l.payload_span, 12_288);
        assert_eq!(l.slot_bytes, 12_288 + 8192);
        assert!(l.file_len() <= 1 << 20);
        assert!(l.file_len() + l.slot_bytes > 1 << 20, "as many slots as fit");
        for s in 0..l.num_slots {
            assert_eq!(l.slot_offset(s) % BLOCK as u64, 0);
            assert_eq!(l.commit_offset(s) % BLOCK as u64, 0);
        }
        assert_eq!(
            SlabLayout::for_capacity(4096, 4096 * 3),
            None,
            "no room for one slot"
        );
        assert_eq!(SlabLayout::for_capacity(0, 1 << 30), None);
    }

    #[test]
    fn superblock_round_trips_and_detects_damage() {
        let l = SlabLayout::for_capacity(8192, 1 << 20).unwrap();
        let sb = Superblock::for_layout(&l);
        let mut block = vec![0u8; BLOCK];
        sb.encode(&mut block);
        assert_eq!(Superblock::decode(&block), SuperblockRead::Valid(sb));
        block[20] ^= 1;
        assert!(matches!(Superblock::decode(&block), SuperblockRead::Foreign(_)));
        assert_eq!(Superblock::decode(&[0u8; BLOCK]), SuperblockRead::Blank);
        assert!(matches!(
            Superblock::decode(
                b"#!/bin/sh\necho not a slab\n\0\0\0\0\0\0\0\0\0\0\0\0\0\0\0\0\0\0\0\0\0\0\0\0"
            ),
            SuperblockRead::Foreign(_)
        ));
    }

    #[test]
    fn a_sealed_slot_verifies_and_every_defect_is_named() {
        let key = OffloadKey::from_u64(42).with_group(3);
        let payload: Vec<u8> = (0..5000u32).map(|i| (i * 7) as u8).collect();
        let mut header = vec![0u8; BLOCK];
        let mut commit = vec![0u8; BLOCK];
        let h = SlotHeader::encode_for(9, &key, &payload, &mut header);
        SlotCommit::sealing(&h).encode(&mut commit);
        assert_eq!(verify_slot(&header, &payload, &commit, &key, 9), Ok(h));

        let mut flipped = payload.clone();
        flipped[4999] ^= 0x80;
        assert_eq!(
            verify_slot(&header, &flipped, &commit, &key, 9),
            Err(SlotDefect::Checksum)
        );
        assert_eq!(
            verify_slot(&header, &payload, &commit, &OffloadKey::from_u64(1), 9),
            Err(SlotDefect::WrongOccupant)
        );
        assert_eq!(
            verify_slot(&header, &payload, &commit, &key, 8),
            Err(SlotDefect::WrongOccupant)
        );
        assert_eq!(
            verify_slot(&header, &payload, &vec![0u8; BLOCK], &key, 9),
            Err(SlotDefect::NotCommitted)
        );
        let mut bad_header = header.clone();
        bad_header[30] ^= 1;
        assert_eq!(
            verify_slot(&bad_header, &payload, &commit, &key, 9),
            Err(SlotDefect::BadHeader)
        );

        // A commit block of an older write of the same slot does not seal the new header.
        let mut old_commit = vec![0u8; BLOCK];
        SlotCommit {
            seq: 3,
            checksum: h.checksum,
        }
        .encode(&mut old_commit);
        assert_eq!(
            verify_slot(&header, &payload, &old_commit, &key, 9),
            Err(SlotDefect::NotCommitted)
        );
    }
}
