//! The on-disk format: a superblock, then fixed slots of `payload | seal block`.
//!
//! ```text
//! offset 0           superblock (4 KiB): magic, format version, chunk geometry, slot count
//! 4 KiB + i·slot     slot i: payload (chunk_bytes rounded up to 4 KiB) | seal (4 KiB)
//! ```
//!
//! A slot costs its payload plus **one** 4 KiB block (a 16 KiB chunk takes 20 KiB of file), and
//! the payloads of consecutive slots are separated only by their seals, so one vectored write
//! or read covers several consecutive slots straight from or into arena rows.
//!
//! The seal holds magic, format version, a sequence number unique to this write, the key, the
//! payload length, an xxh3 of the payload's first block and an xxh3 of the seal fields plus the
//! whole payload. A slot is written payload first and seal last, in one vectored write, so a
//! write cut short (the process was killed in the middle of it) leaves either the slot's older
//! seal or none. An older seal does not match the new first payload block, so the start-up scan
//! discards the slot after reading just two blocks. Every load verifies the full payload checksum,
//! which also catches what a crash cannot explain (and the rare write cut short whose new first
//! block equals the old one).
//!
//! Every block is 4 KiB so every I/O is aligned for `O_DIRECT`.

use std::fmt;

use std::hash::Hasher as _;
use tiering_core::KEY_BYTES;
use tiering_core::OffloadKey;

use twox_hash::XxHash3_64;

/// The alignment and size of the superblock and the seal block.
pub const BLOCK: usize = 4096;
/// The format version written in the superblock and in every seal. Version 1 had a header and
/// a commit block per slot.
pub const FORMAT_VERSION: u32 = 2;

const SUPER_MAGIC: [u8; 8] = *b"KVTDISK\0";
const SEAL_MAGIC: [u8; 8] = *b"KVTSEAL\0";

const SUPER_LEN: usize = 48;
const SEAL_CHECKED: usize = 80;
/// Bytes of the seal block that carry the seal.
pub const SEAL_LEN: usize = 96;

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
    /// Bytes per slot: payload span + seal block.
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
        let slot_bytes = Self::slot_bytes_for(chunk_bytes)?;
        let slots = capacity.checked_sub(BLOCK as u64)? / slot_bytes;
        let num_slots = u32::try_from(slots.min(u64::from(u32::MAX))).ok()?;
        (num_slots > 0 && chunk_bytes > 0).then_some(Self {
            chunk_bytes,
            payload_span,
            slot_bytes,
            num_slots,
        })
    }

    /// Bytes per slot for chunks of `chunk_bytes`: the payload rounded up to a block, then one
    /// seal block (`None` when that overflows).
    #[must_use]
    pub fn slot_bytes_for(chunk_bytes: usize) -> Option<u64> {
        let payload_span = chunk_bytes.checked_next_multiple_of(BLOCK)?;
        u64::try_from(payload_span).ok()?.checked_add(BLOCK as u64)
    }

    /// The file offset of slot `slot` (its payload).
    #[must_use]
    pub fn slot_offset(&self, slot: u32) -> u64 {
        BLOCK as u64 + u64::from(slot) * self.slot_bytes
    }

    /// The file offset of slot `slot`'s seal block.
    #[must_use]
    pub fn seal_offset(&self, slot: u32) -> u64 {
        self.slot_offset(slot) + self.payload_span as u64
    }

    /// Padding between the payload and the seal block.
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
        let crc = XxHash3_64::oneshot(&out[..40]);
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
        if XxHash3_64::oneshot(&block[..40]) != u64_at(block, 40) {
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

/// The seal block that closes one slot: what the slot holds and how to check it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SlotSeal {
    /// The write's sequence number (unique per write, increasing over the slab's life).
    pub seq: u64,
    /// The chunk's key.
    pub key: OffloadKey,
    /// Payload bytes.
    pub payload_len: u64,
    /// xxh3 of the payload's first block (its first `min(payload_len, BLOCK)` bytes): what the
    /// start-up scan checks to tell a complete write from one cut short.
    pub head_checksum: u64,
    /// xxh3 of the seal fields (bytes 0..80) followed by the whole payload.
    pub checksum: u64,
}

impl SlotSeal {
    /// Encodes the seal for `payload`, written as write `seq` of `key`, into `out` (at least
    /// [`SEAL_LEN`] bytes; the rest of the first block is zeroed). Returns the seal.
    pub fn encode_for(seq: u64, key: &OffloadKey, payload: &[u8], out: &mut [u8]) -> Self {
        let end = out.len().min(BLOCK);
        out[SEAL_LEN.min(end)..end].fill(0);
        Self::encode_fields(seq, key, payload, out)
    }

    /// [`SlotSeal::encode_for`] into a block whose bytes past [`SEAL_LEN`] the caller knows to
    /// be zero already (a scratch block only seals have been written into): only the seal's own
    /// bytes are written.
    pub(crate) fn encode_fields(seq: u64, key: &OffloadKey, payload: &[u8], out: &mut [u8]) -> Self {
        out[..SEAL_LEN].fill(0);
        let payload_len = payload.len() as u64;
        let head_checksum = XxHash3_64::oneshot(head_of(payload));
        out[0..8].copy_from_slice(&SEAL_MAGIC);
        out[8..12].copy_from_slice(&FORMAT_VERSION.to_le_bytes());
        out[16..24].copy_from_slice(&seq.to_le_bytes());
        out[24..24 + KEY_BYTES].copy_from_slice(&key.to_bytes());
        out[64..72].copy_from_slice(&payload_len.to_le_bytes());
        out[72..80].copy_from_slice(&head_checksum.to_le_bytes());
        let checksum = content_checksum(&out[..SEAL_CHECKED], payload);
        out[80..88].copy_from_slice(&checksum.to_le_bytes());
        let crc = XxHash3_64::oneshot(&out[..88]);
        out[88..SEAL_LEN].copy_from_slice(&crc.to_le_bytes());
        Self {
            seq,
            key: *key,
            payload_len,
            head_checksum,
            checksum,
        }
    }

    /// Decodes a seal block; `None` unless magic, version and the seal's own checksum are
    /// right.
    #[must_use]
    pub fn decode(block: &[u8]) -> Option<Self> {
        if block.len() < SEAL_LEN || block[0..8] != SEAL_MAGIC || u32_at(block, 8) != FORMAT_VERSION {
            return None;
        }
        if XxHash3_64::oneshot(&block[..88]) != u64_at(block, 88) {
            return None;
        }
        Some(Self {
            seq: u64_at(block, 16),
            key: OffloadKey::from_bytes(&block[24..24 + KEY_BYTES])?,
            payload_len: u64_at(block, 64),
            head_checksum: u64_at(block, 72),
            checksum: u64_at(block, 80),
        })
    }

    /// Whether `first_block` (the slot's first payload block, as read by the start-up scan)
    /// is the one this seal was written with: false for a write that was cut short.
    #[must_use]
    pub fn head_matches(&self, first_block: &[u8]) -> bool {
        let n = usize::try_from(self.payload_len).unwrap_or(usize::MAX).min(BLOCK);
        first_block.len() >= n && XxHash3_64::oneshot(&first_block[..n]) == self.head_checksum
    }

    /// Whether `payload` (read along with this seal from `block`) matches the checksum.
    #[must_use]
    pub fn payload_matches(&self, block: &[u8], payload: &[u8]) -> bool {
        payload.len() as u64 == self.payload_len
            && content_checksum(&block[..SEAL_CHECKED], payload) == self.checksum
    }
}

fn head_of(payload: &[u8]) -> &[u8] {
    &payload[..payload.len().min(BLOCK)]
}

fn content_checksum(seal_fields: &[u8], payload: &[u8]) -> u64 {
    let mut h = XxHash3_64::new();
    h.write(seal_fields);
    h.write(payload);
    h.finish()
}

/// Why a slot read was rejected.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum SlotDefect {
    /// Fewer bytes than a slot came back (the file was truncated).
    ShortRead,
    /// The seal is missing, damaged, or belongs to a write that never completed.
    BadSeal,
    /// The seal names another key or write than the index expects.
    WrongOccupant,
    /// The payload does not match its checksum.
    Checksum,
}

impl fmt::Display for SlotDefect {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Self::ShortRead => "short read",
            Self::BadSeal => "missing or damaged seal block",
            Self::WrongOccupant => "seal names another chunk",
            Self::Checksum => "payload checksum mismatch",
        })
    }
}

/// Verifies a slot read back in full (payload and seal block) against the key and write
/// sequence the index expects in that slot.
///
/// # Errors
/// The first defect found.
pub fn verify_slot(
    payload: &[u8],
    seal_block: &[u8],
    expect_key: &OffloadKey,
    expect_seq: u64,
) -> Result<SlotSeal, SlotDefect> {
    let seal = SlotSeal::decode(seal_block).ok_or(SlotDefect::BadSeal)?;
    if seal.key != *expect_key || seal.seq != expect_seq {
        return Err(SlotDefect::WrongOccupant);
    }
    if !seal.payload_matches(seal_block, payload) {
        return Err(SlotDefect::Checksum);
    }
    Ok(seal)
}

/// What the start-up scan makes of one slot from its first payload block and its seal block.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ScannedSlot {
    /// Never written, or erased: an all-zero seal block.
    Empty,
    /// A complete write of `key`, write number `seq`.
    Complete {
        /// The chunk's key.
        key: OffloadKey,
        /// Its write number.
        seq: u64,
    },
    /// A damaged seal, a seal for another chunk size, or a write cut short; `seq` is the
    /// write number when the seal itself is intact (0 otherwise).
    Discarded {
        /// The write number of an intact seal, else 0.
        seq: u64,
    },
}

/// Classifies one slot for the start-up scan. `first_block` is the slot's first payload
/// block (at least `min(chunk_bytes, BLOCK)` bytes), `seal_block` its seal block.
#[must_use]
pub fn scan_slot(first_block: &[u8], seal_block: &[u8], chunk_bytes: usize) -> ScannedSlot {
    let Some(seal) = SlotSeal::decode(seal_block) else {
        let blank = seal_block.iter().all(|&b| b == 0);
        return if blank {
            ScannedSlot::Empty
        } else {
            ScannedSlot::Discarded { seq: 0 }
        };
    };
    if seal.payload_len != chunk_bytes as u64 || !seal.head_matches(first_block) {
        return ScannedSlot::Discarded { seq: seal.seq };
    }
    ScannedSlot::Complete {
        key: seal.key,
        seq: seal.seq,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn layout_fits_capacity_and_aligns_every_slot() {
        let l = SlabLayout::for_capacity(10_000, 1 << 20).unwrap();
        assert_eq!(l.payload_span, 12_288);
        assert_eq!(l.slot_bytes, 12_288 + 4096);
        assert!(l.file_len() <= 1 << 20);
        assert!(l.file_len() + l.slot_bytes > 1 << 20, "as many slots as fit");
        for s in 0..l.num_slots {
            assert_eq!(l.slot_offset(s) % BLOCK as u64, 0);
            assert_eq!(l.seal_offset(s) % BLOCK as u64, 0);
        }
        assert_eq!(
            SlabLayout::for_capacity(4096, 4096 * 2),
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
        let mut seal = vec![0u8; BLOCK];
        let h = SlotSeal::encode_for(9, &key, &payload, &mut seal);
        assert_eq!(verify_slot(&payload, &seal, &key, 9), Ok(h));
        assert_eq!(
            scan_slot(&payload, &seal, payload.len()),
            ScannedSlot::Complete { key, seq: 9 }
        );

        let mut flipped = payload.clone();
        flipped[4999] ^= 0x80;
        assert_eq!(verify_slot(&flipped, &seal, &key, 9), Err(SlotDefect::Checksum));
        assert_eq!(
            verify_slot(&payload, &seal, &OffloadKey::from_u64(1), 9),
            Err(SlotDefect::WrongOccupant)
        );
        assert_eq!(
            verify_slot(&payload, &seal, &key, 8),
            Err(SlotDefect::WrongOccupant)
        );
        assert_eq!(
            verify_slot(&payload, &vec![0u8; BLOCK], &key, 9),
            Err(SlotDefect::BadSeal)
        );
        let mut bad_seal = seal.clone();
        bad_seal[30] ^= 1;
        assert_eq!(
            verify_slot(&payload, &bad_seal, &key, 9),
            Err(SlotDefect::BadSeal)
        );
        assert_eq!(
            scan_slot(&payload, &bad_seal, payload.len()),
            ScannedSlot::Discarded { seq: 0 }
        );
        assert_eq!(scan_slot(&payload, &vec![0u8; BLOCK], 5000), ScannedSlot::Empty);
        assert_eq!(
            scan_slot(&payload, &seal, 4096),
            ScannedSlot::Discarded { seq: 9 },
            "a seal for another chunk size"
        );
    }

    #[test]
    fn a_write_cut_short_under_an_older_seal_is_discarded_by_the_scan() {
        let old_key = OffloadKey::from_u64(1);
        let old: Vec<u8> = (0..8192u32).map(|i| (i % 251) as u8).collect();
        let mut seal = vec![0u8; BLOCK];
        SlotSeal::encode_for(3, &old_key, &old, &mut seal);
        // A new write got through its first payload block and stopped before its seal.
        let mut torn = old.clone();
        torn[..BLOCK].fill(0xEE);
        assert_eq!(
            scan_slot(&torn, &seal, old.len()),
            ScannedSlot::Discarded { seq: 3 }
        );
        // Past the first block only: the scan cannot see it, the load's checksum does.
        let mut late = old.clone();
        late[BLOCK + 10] ^= 1;
        assert_eq!(
            scan_slot(&late, &seal, old.len()),
            ScannedSlot::Complete { key: old_key, seq: 3 }
        );
        assert_eq!(verify_slot(&late, &seal, &old_key, 3), Err(SlotDefect::Checksum));
    }
}
