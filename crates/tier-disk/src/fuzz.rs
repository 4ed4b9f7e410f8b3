//! Structure-aware fuzzing of what the tier parses from disk: the seal block, the slot scan
//! and load verification, the superblock, and the index rebuilt from what a scan found.
//!
//! Inputs start from a valid slot (a seal written for a payload) or superblock and are then
//! damaged by a list of mutations (bit flips, byte overwrites, truncation, splicing bytes from
//! another seal, zeroing ranges), so most inputs reach deep into the parser instead of failing
//! the magic check. The driver is proptest: a short budget in the normal suite, one million
//! inputs per target behind `#[ignore]` (`cargo test -p tier-disk --lib fuzz -- --ignored
//! --nocapture` prints the counts). Shrinking is on, failure files are off: a failure found
//! here becomes an explicit regression test below.

use std::sync::atomic::{AtomicU64, Ordering};

use proptest::prelude::*;
use proptest::test_runner::{Config, TestRunner};
use tiering_core::OffloadKey;

use crate::format::{
    BLOCK, SEAL_LEN, ScannedSlot, SlabLayout, SlotSeal, Superblock, SuperblockRead, scan_slot, verify_slot,
};
use crate::index::Index;

/// One way to damage a byte buffer.
#[derive(Clone, Debug)]
enum Mutation {
    Flip { at: usize, mask: u8 },
    Set { at: usize, value: u8 },
    Truncate { len: usize },
    Zero { at: usize, len: usize },
    Splice { at: usize, from: usize, len: usize },
}

fn mutation() -> impl Strategy<Value = Mutation> {
    // Positions favour the bytes the parsers read (the first 100 of a block).
    let pos = prop_oneof![4 => 0usize..SEAL_LEN + 4, 1 => 0usize..2 * BLOCK];
    prop_oneof![
        (pos.clone(), 1u8..=255).prop_map(|(at, mask)| Mutation::Flip { at, mask }),
        (pos.clone(), any::<u8>()).prop_map(|(at, value)| Mutation::Set { at, value }),
        (0usize..2 * BLOCK).prop_map(|len| Mutation::Truncate { len }),
        (pos.clone(), 1usize..64).prop_map(|(at, len)| Mutation::Zero { at, len }),
        (pos, 0usize..SEAL_LEN, 1usize..32).prop_map(|(at, from, len)| Mutation::Splice { at, from, len }),
    ]
}

fn apply(buf: &mut Vec<u8>, donor: &[u8], m: &Mutation) {
    match *m {
        Mutation::Flip { at, mask } => {
            if let Some(b) = buf.get_mut(at) {
                *b ^= mask;
            }
        }
        Mutation::Set { at, value } => {
            if let Some(b) = buf.get_mut(at) {
                *b = value;
            }
        }
        Mutation::Truncate { len } => buf.truncate(len),
        Mutation::Zero { at, len } => {
            let end = (at + len).min(buf.len());
            if at < end {
                buf[at..end].fill(0);
            }
        }
        Mutation::Splice { at, from, len } => {
            for i in 0..len {
                if let (Some(d), Some(src)) = (buf.get_mut(at + i), donor.get(from + i)) {
                    *d = *src;
                }
            }
        }
    }
}

/// A valid slot and what to do to it.
#[derive(Clone, Debug)]
struct SlotCase {
    seq: u64,
    key: u64,
    group: u32,
    payload: Vec<u8>,
    /// Damage to the seal block.
    seal_damage: Vec<Mutation>,
    /// Damage to the payload.
    payload_damage: Vec<Mutation>,
    /// Another seal's key (spliced from).
    donor_key: u64,
}

fn slot_case() -> impl Strategy<Value = SlotCase> {
    (
        any::<u64>(),
        any::<u64>(),
        0u32..4,
        prop_oneof![
            3 => proptest::collection::vec(any::<u8>(), 0..600),
            1 => proptest::collection::vec(any::<u8>(), BLOCK..BLOCK + 64),
        ],
        proptest::collection::vec(mutation(), 0..4),
        proptest::collection::vec(mutation(), 0..2),
        any::<u64>(),
    )
        .prop_map(
            |(seq, key, group, payload, seal_damage, payload_damage, donor_key)| SlotCase {
                seq,
                key,
                group,
                payload,
                seal_damage,
                payload_damage,
                donor_key,
            },
        )
}

/// The properties of one slot case: nothing panics; an intact slot scans complete and
/// verifies; a damaged one never verifies as something it is not.
fn check_slot(c: &SlotCase) -> Result<(), TestCaseError> {
    let key = OffloadKey::from_u64(c.key).with_group(c.group);
    let mut seal = vec![0u8; BLOCK];
    let written = SlotSeal::encode_for(c.seq, &key, &c.payload, &mut seal);
    let mut donor = vec![0u8; BLOCK];
    SlotSeal::encode_for(
        c.seq ^ 1,
        &OffloadKey::from_u64(c.donor_key),
        &c.payload,
        &mut donor,
    );

    let intact = (c.seal_damage.is_empty(), c.payload_damage.is_empty());
    let mut bad_seal = seal.clone();
    for m in &c.seal_damage {
        apply(&mut bad_seal, &donor, m);
    }
    let mut bad_payload = c.payload.clone();
    for m in &c.payload_damage {
        apply(&mut bad_payload, &donor, m);
    }

    let scanned = scan_slot(&bad_payload, &bad_seal, c.payload.len());
    let verified = verify_slot(&bad_payload, &bad_seal, &key, c.seq);
    let _ = SlotSeal::decode(&bad_seal);
    let _ = Superblock::decode(&bad_seal);

    if intact == (true, true) {
        prop_assert_eq!(scanned, ScannedSlot::Complete { key, seq: c.seq });
        prop_assert_eq!(verified, Ok(written));
    }
    // Whatever the damage, a verified slot carries exactly what was written.
    if let Ok(found) = verified {
        prop_assert_eq!(found, written);
        prop_assert_eq!(&bad_payload, &c.payload);
        prop_assert_eq!(&bad_seal[..SEAL_LEN], &seal[..SEAL_LEN]);
    }
    // A slot the scan adopts names the key and write that were sealed, and its first block is
    // the one that was written.
    if let ScannedSlot::Complete { key: k, seq } = scanned {
        prop_assert_eq!((k, seq), (key, c.seq));
        let head = c.payload.len().min(BLOCK);
        prop_assert_eq!(&bad_payload[..head], &c.payload[..head]);
    }
    Ok(())
}

/// A valid superblock and damage to it.
fn check_superblock(chunk: usize, capacity: u64, damage: &[Mutation]) -> Result<(), TestCaseError> {
    let Some(layout) = SlabLayout::for_capacity(chunk, capacity) else {
        return Ok(());
    };
    prop_assert!(layout.file_len() <= capacity);
    let sb = Superblock::for_layout(&layout);
    let mut block = vec![0u8; BLOCK];
    sb.encode(&mut block);
    let original = block.clone();
    for m in damage {
        apply(&mut block, &original, m);
    }
    match Superblock::decode(&block) {
        SuperblockRead::Valid(found) => {
            prop_assert_eq!(found, sb);
            prop_assert_eq!(&block[..48], &original[..48]);
        }
        SuperblockRead::Blank => prop_assert!(block.iter().all(|&b| b == 0)),
        SuperblockRead::Foreign(_) => prop_assert!(!damage.is_empty()),
    }
    Ok(())
}

/// The index rebuilt from arbitrary scan findings stays consistent.
fn check_recovered(num_slots: u32, found: &[(u32, u64, u64)]) -> Result<(), TestCaseError> {
    let entries: Vec<(u32, OffloadKey, u64)> = found
        .iter()
        .map(|&(s, k, q)| (s, OffloadKey::from_u64(k), q))
        .collect();
    let (mut ix, rejected) = Index::recovered(num_slots, 1, entries);
    let live = ix.live_keys();
    prop_assert_eq!(live.len(), ix.live());
    prop_assert!(ix.live() <= num_slots as usize);
    for s in &rejected {
        prop_assert!(*s < num_slots);
    }
    // Every live key is the newest copy found of it, in a slot it was found in.
    for k in &live {
        let (slot, _) = ix
            .slot_of(k)
            .ok_or_else(|| TestCaseError::fail("live key without slot"))?;
        let newest = found
            .iter()
            .filter(|&&(s, key, _)| OffloadKey::from_u64(key) == *k && s < num_slots)
            .map(|&(_, _, q)| q)
            .max();
        prop_assert!(newest.is_some());
        prop_assert!(
            found
                .iter()
                .any(|&(s, key, _)| s == slot && OffloadKey::from_u64(key) == *k)
        );
    }
    // Every free slot can be reserved, and the next write number is past all of them.
    let max_seq = found
        .iter()
        .filter(|f| f.0 < num_slots)
        .map(|f| f.2)
        .max()
        .unwrap_or(0);
    let free = num_slots as usize - ix.live();
    for n in 0..free {
        match ix.reserve(OffloadKey::from_u64(u64::MAX - n as u64), None) {
            crate::index::Reservation::Slot { seq, evicted, .. } => {
                prop_assert!(evicted.is_none());
                prop_assert!(seq > max_seq.min(u64::MAX - 1) || max_seq == u64::MAX);
            }
            crate::index::Reservation::Full => {
                return Err(TestCaseError::fail("a free slot was not reservable"));
            }
        }
    }
    Ok(())
}

fn runner(cases: u32) -> TestRunner {
    TestRunner::new(Config {
        cases,
        failure_persistence: None,
        ..Config::default()
    })
}

fn fuzz_slots(cases: u32) -> u64 {
    let count = AtomicU64::new(0);
    runner(cases)
        .run(&slot_case(), |c| {
            count.fetch_add(1, Ordering::Relaxed);
            check_slot(&c)
        })
        .unwrap();
    count.into_inner()
}

fn fuzz_superblock(cases: u32) -> u64 {
    let count = AtomicU64::new(0);
    let strategy = (
        prop_oneof![1usize..70_000, Just(16 * 1024), Just(2 << 20)],
        any::<u64>(),
        proptest::collection::vec(mutation(), 0..3),
    );
    runner(cases)
        .run(&strategy, |(chunk, capacity, damage)| {
            count.fetch_add(1, Ordering::Relaxed);
            check_superblock(chunk, capacity, &damage)
        })
        .unwrap();
    count.into_inner()
}

fn fuzz_recovery(cases: u32) -> u64 {
    let count = AtomicU64::new(0);
    let strategy = (
        1u32..40,
        proptest::collection::vec((0u32..48, 0u64..12, any::<u64>()), 0..48),
    );
    runner(cases)
        .run(&strategy, |(n, found)| {
            count.fetch_add(1, Ordering::Relaxed);
            check_recovered(n, &found)
        })
        .unwrap();
    count.into_inner()
}

#[test]
fn fuzz_slot_seal_scan_and_verify_short() {
    assert_eq!(fuzz_slots(2_000), 2_000);
}

#[test]
fn fuzz_superblock_short() {
    assert_eq!(fuzz_superblock(1_000), 1_000);
}

#[test]
fn fuzz_recovered_index_short() {
    assert_eq!(fuzz_recovery(500), 500);
}

#[test]
#[ignore = "long fuzz run: one million inputs per target"]
fn fuzz_long_one_million_inputs_per_target() {
    let slots = fuzz_slots(1_000_000);
    eprintln!("fuzz: slot seal / scan / verify: {slots} inputs, 0 failures");
    let supers = fuzz_superblock(1_000_000);
    eprintln!("fuzz: superblock: {supers} inputs, 0 failures");
    let recovered = fuzz_recovery(1_000_000);
    eprintln!("fuzz: recovered index: {recovered} inputs, 0 failures");
}

#[test]
fn regression_a_seal_block_shorter_than_a_seal_is_rejected_not_read_past_its_end() {
    let key = OffloadKey::from_u64(5);
    let mut seal = vec![0u8; BLOCK];
    SlotSeal::encode_for(1, &key, b"abc", &mut seal);
    for len in [0, 8, SEAL_LEN - 1] {
        assert_eq!(SlotSeal::decode(&seal[..len]), None);
        assert!(matches!(
            scan_slot(b"abc", &seal[..len], 3),
            ScannedSlot::Discarded { .. } | ScannedSlot::Empty
        ));
    }
    assert_eq!(
        scan_slot(b"ab", &seal, 3),
        ScannedSlot::Discarded { seq: 1 },
        "a short first block"
    );
}
