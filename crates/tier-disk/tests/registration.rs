//! The `disk` tier type in the static registry: built from a chain-file table, options checked.

use std::sync::Arc;

use tier_disk as _;
use tiering_core::registry::TierFactory;
use tiering_core::{
    ControlWaker, Medium, TierError,
    arena::ChunkArena,
    registry::{Registry, SecondaryContext},
};

fn factory() -> tiering_core::registry::SecondaryFactory {
    let reg = Registry::global()
        .unwrap()
        .get("disk")
        .expect("type `disk` is registered");
    assert_eq!(reg.crate_name, "tier-disk");
    match reg.factory {
        TierFactory::Secondary(f) => f,
        TierFactory::Primary(_) => panic!("`disk` must be a secondary tier type"),
    }
}

#[test]
fn a_chain_table_builds_a_working_disk_tier() {
    let dir = tempfile::tempdir().unwrap();
    let table: toml::Table = toml::from_str(&format!(
        "path = {:?}\ncapacity = \"4MiB\"\nsync = \"batch\"\ndirect_io = \"auto\"\nio_threads = 2\nname = \"ssd\"",
        dir.path().display().to_string()
    ))
    .unwrap();
    let arena = ChunkArena::new(4, 64 * 1024).unwrap();
    let ctx = SecondaryContext::new(Arc::clone(&arena), ControlWaker::new());
    let tier = factory()(&table, &ctx).unwrap();
    let info = tier.info();
    assert_eq!(info.name, "ssd");
    assert_eq!(info.medium, Some(Medium::Storage));
    let stats = tier.stats();
    assert_eq!(stats.capacity_chunks, 4 * 1024 * 1024 / (64 * 1024 + 4096) as u64);
    assert!(dir.path().join(tier_disk::SLAB_FILE).exists());
}

#[test]
fn unknown_or_bad_options_are_config_errors_naming_the_key() {
    let dir = tempfile::tempdir().unwrap();
    let arena = ChunkArena::new(2, 4096).unwrap();
    let ctx = SecondaryContext::new(arena, ControlWaker::new());
    let path = dir.path().display().to_string();
    for (extra, word) in [
        ("capacity = \"1GiB\"\nfsync = true", "fsync"),
        ("capacity = \"lots\"", "lots"),
        ("capacity = \"1GiB\"\nsync = \"sometimes\"", "sometimes"),
    ] {
        let table: toml::Table = toml::from_str(&format!("path = {path:?}\n{extra}")).unwrap();
        match factory()(&table, &ctx) {
            Err(TierError::Config(msg)) => assert!(msg.contains(word), "{msg} should mention {word}"),
            Err(other) => panic!("expected a config error for {extra:?}, got {other}"),
            Ok(_) => panic!("{extra:?} was accepted"),
        }
    }
    let too_small: toml::Table = toml::from_str(&format!("path = {path:?}\ncapacity = 100")).unwrap();
    assert!(matches!(factory()(&too_small, &ctx), Err(TierError::Config(_))));
}
