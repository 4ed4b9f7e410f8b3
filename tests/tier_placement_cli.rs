//! `kvtier check --build` prints what request tier filters match for each secondary tier: its
//! type's medium and locality, or the chain's `medium` / `locality` override; `kvtier tiers`
//! says where they come from; a bad value is reported with file:line:key.

mod common;

use common::{kvtier, text};

#[test]
fn check_build_prints_each_tiers_medium_and_locality_with_the_overrides() {
    let dir = tempfile::tempdir().unwrap();
    let chain = dir.path().join("placed.toml");
    std::fs::write(
        &chain,
        "[primary]\ntype = \"cpu\"\ncapacity = \"8MiB\"\n\n\
         [[secondary]]\ntype = \"example\"\nname = \"as-declared\"\ncapacity = \"1MiB\"\n\n\
         [[secondary]]\ntype = \"example\"\nname = \"overridden\"\ncapacity = \"1MiB\"\nmedium = \"storage\"\nlocality = \"remote\"\n",
    )
    .unwrap();
    let out = kvtier(&[
        "check",
        "--build",
        "--chunk-bytes",
        "65536",
        chain.to_str().unwrap(),
    ]);
    let t = text(&out);
    assert!(out.status.success(), "{t}");
    assert!(t.contains("medium = Storage (overrides the type's)"), "{t}");
    assert!(
        t.contains("built: overridden — medium STORAGE, locality REMOTE"),
        "{t}"
    );
    assert!(t.contains("built: as-declared — medium "), "{t}");

    let bad = dir.path().join("bad.toml");
    std::fs::write(
        &bad,
        "[primary]\ntype = \"cpu\"\ncapacity = \"8MiB\"\n\n[[secondary]]\ntype = \"example\"\ncapacity = \"1MiB\"\nlocality = \"nearby\"\n",
    )
    .unwrap();
    let out = kvtier(&["check", bad.to_str().unwrap()]);
    let t = text(&out);
    assert!(!out.status.success(), "{t}");
    assert!(
        t.contains(&format!("{}:8: [[secondary]] #1", bad.display())),
        "{t}"
    );
    assert!(
        t.contains("key `locality`") && t.contains("must be \"local\" or \"remote\""),
        "{t}"
    );

    let out = kvtier(&["tiers"]);
    let t = text(&out);
    assert!(out.status.success(), "{t}");
    assert!(t.contains("redis: STORAGE/REMOTE"), "{t}");
}
