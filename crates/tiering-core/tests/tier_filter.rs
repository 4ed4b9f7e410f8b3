//! Per-request tier filters against the tiers' medium and locality: a filter that excludes
//! STORAGE gets no hit from a storage tier on a workload that hits it without the filter, and
//! falls through to a tier it allows; overriding a tier's description changes what it matches.

mod common;

use common::*;
use tiering_core::Redescribed;
use tiering_core::testing::{ScriptedTier, ScriptedTierHandle};
use tiering_core::{
    Locality, LookupResult, ManagerConfig, Medium, ReqContext, RequestId, SecondaryTier, TierFilter,
    TierInfo, TierMatcher, TieringManager,
};

fn no_storage(id: &str) -> ReqContext {
    ReqContext::builder(RequestId::local(id))
        .filter(TierFilter::Matchers(vec![TierMatcher {
            medium: Some(Medium::Cpu),
            locality: None,
        }]))
        .build()
}

/// Runs the workload (keys 0..8, all in every tier, looked up twice) and returns the primary
/// hits of the second pass and how many promotions each tier ran.
fn workload(r: &mut Rig, make_ctx: fn(&str) -> ReqContext) -> (usize, Vec<usize>) {
    let ctx = make_ctx("w");
    r.m.on_new_request(&ctx).unwrap();
    for k in 0..8 {
        r.m.lookup(&key(k), &ctx).unwrap();
    }
    end_step(&mut r.m);
    let mut hits = 0;
    for k in 0..8 {
        if r.m.lookup(&key(k), &ctx).unwrap() == LookupResult::Hit {
            hits += 1;
        }
    }
    r.m.on_request_finished(&ctx).unwrap();
    end_step(&mut r.m);
    (hits, r.tiers.iter().map(|t| t.count("submit_load")).collect())
}

fn storage_rig() -> Rig {
    // `rig` builds scripted tiers: medium STORAGE, locality LOCAL (a disk).
    let r = rig(16, &["disk"], ManagerConfig::step_driven());
    for k in 0..8 {
        r.tiers[0].insert(key(k), bytes_for(&key(k)));
    }
    r
}

#[test]
fn a_filter_excluding_storage_gets_no_hit_from_a_storage_tier() {
    let mut r = storage_rig();
    let (hits, loads) = workload(&mut r, |id| ReqContext::local(id));
    assert_eq!(
        (hits, loads),
        (8, vec![1]),
        "unfiltered, the storage tier serves every key"
    );
    r.m.shutdown().unwrap();

    let mut r = storage_rig();
    let (hits, loads) = workload(&mut r, no_storage);
    assert_eq!((hits, loads), (0, vec![0]), "filtered, it is never promoted from");
    assert_eq!(r.tiers[0].count("lookup"), 0, "nor asked");
    r.m.shutdown().unwrap();
}

#[test]
fn the_filter_falls_through_to_a_tier_it_allows_and_follows_an_override() {
    let tier = |info: TierInfo| -> (Box<dyn SecondaryTier>, ScriptedTierHandle) {
        let (t, h) = ScriptedTier::with_info(info);
        for k in 0..8 {
            h.insert(key(k), bytes_for(&key(k)));
        }
        (Box::new(t), h)
    };
    let (disk, disk_h) = tier(TierInfo::new(
        "disk",
        Some(Medium::Storage),
        Some(Locality::Local),
    ));
    // A storage tier the deployment declares as host memory (say, a RAM disk).
    let (ram, ram_h) = tier(TierInfo::new(
        "ramdisk",
        Some(Medium::Storage),
        Some(Locality::Local),
    ));
    let ram = Redescribed::wrap(ram, Some(Medium::Cpu), None);
    let primary = tiering_core::testing::MemoryPrimary::new(16, CHUNK);
    let mut r = Rig {
        m: Engine::new(TieringManager::new(
            Box::new(primary.clone()),
            vec![disk, ram],
            ManagerConfig::step_driven(),
        )),
        primary,
        tiers: vec![disk_h, ram_h],
    };
    let (hits, loads) = workload(&mut r, no_storage);
    assert_eq!(
        (hits, loads),
        (8, vec![0, 1]),
        "every key came from the tier the filter allows"
    );
    let ctx = no_storage("read");
    r.m.on_new_request(&ctx).unwrap();
    assert_eq!(load_bytes(&mut r.m, &r.primary, &ctx, key(3)), bytes_for(&key(3)));
    r.m.on_request_finished(&ctx).unwrap();
    end_step(&mut r.m);
    r.m.shutdown().unwrap();
}
