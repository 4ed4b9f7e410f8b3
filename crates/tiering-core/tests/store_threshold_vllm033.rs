//! kvtier's `store_threshold` admission policy against transcripts of vLLM 0.33.0's threshold
//! filter (`tests/data/store_threshold/README.md`).

use std::path::PathBuf;

use tiering_core::OffloadKey;
use tiering_core::admission::{Access, AdmissionConfig, AdmissionContext};

fn transcripts() -> Vec<PathBuf> {
    let dir = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/data/store_threshold/vllm033");
    let mut files: Vec<PathBuf> = std::fs::read_dir(&dir)
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|e| e == "txt"))
        .collect();
    files.sort();
    files
}

fn keys(text: &str) -> Vec<u64> {
    text.split_whitespace().map(|k| k.parse().unwrap()).collect()
}

#[test]
fn store_threshold_matches_vllm_0_33_0() {
    let files = transcripts();
    assert!(files.len() >= 8, "transcripts missing: {files:?}");
    let mut offers = 0;
    let mut admitted_total = 0;
    for file in files {
        let text = std::fs::read_to_string(&file).unwrap();
        let mut lines = text.lines();
        let header: Vec<&str> = lines.next().unwrap().split_whitespace().collect();
        assert_eq!(header[0], "new");
        let options: toml::Table = format!("n = {}\nmax_tracker_size = {}", header[1], header[2])
            .parse()
            .unwrap();
        let mut policy = AdmissionConfig::new("store_threshold", options)
            .unwrap()
            .build(&AdmissionContext::default())
            .unwrap();
        for (n, line) in lines.enumerate() {
            let (offer, expected) = line.strip_prefix("offer ").unwrap().split_once('=').unwrap();
            let offered: Vec<OffloadKey> = keys(offer).into_iter().map(OffloadKey::from_u64).collect();
            policy.on_access(&offered, Access::Offered);
            let got: Vec<u64> = keys(offer)
                .into_iter()
                .filter(|&k| policy.admit(&OffloadKey::from_u64(k)))
                .collect();
            assert_eq!(got, keys(expected), "{}:{}: {line}", file.display(), n + 2);
            offers += 1;
            admitted_total += got.len();
        }
    }
    // The transcripts exercise both outcomes.
    assert!(
        offers >= 600 && admitted_total > 100,
        "{offers} offers, {admitted_total} admitted"
    );
}
