//! Replays transcripts recorded from the released vLLM 0.33.0 `CPUOffloadingManager` (lru and
//! arc): every lookup verdict, store output (keys, chunk ids, evictions), load chunk ids, event
//! batch and internal policy order must match exactly. See `tests/data/README.md`.

mod common;

use std::path::Path;

#[test]
fn every_recorded_vllm_transcript_replays_identically() {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/data/vllm033");
    let mut files: Vec<_> = std::fs::read_dir(&dir)
        .unwrap()
        .map(|e| e.unwrap().path())
        .collect();
    files.retain(|p| p.extension().is_some_and(|e| e == "txt"));
    files.sort();
    assert!(files.len() >= 10, "transcripts missing from {}", dir.display());
    for f in &files {
        let text = std::fs::read_to_string(f).unwrap();
        common::check_transcript(&f.file_name().unwrap().to_string_lossy(), &text);
    }
}

/// Replays every transcript in the directory named by `KVTIER_TRANSCRIPTS` (for large batches
/// recorded locally with the generator described in `tests/data/README.md`).
#[test]
#[ignore = "needs KVTIER_TRANSCRIPTS pointing at recorded transcripts"]
fn transcripts_from_env_replay_identically() {
    let Ok(dir) = std::env::var("KVTIER_TRANSCRIPTS") else {
        panic!("set KVTIER_TRANSCRIPTS to a directory of transcripts");
    };
    let mut n = 0;
    for entry in std::fs::read_dir(dir).unwrap() {
        let path = entry.unwrap().path();
        let text = std::fs::read_to_string(&path).unwrap();
        common::check_transcript(&path.display().to_string(), &text);
        n += 1;
    }
    assert!(n > 0, "no transcript found");
    eprintln!("{n} transcripts replayed identically");
}
