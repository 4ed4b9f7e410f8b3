//! JSONL trace replay: one request per line.
//!
//! ```text
//! {"arrival": 0.00, "session": "alice", "prefix": "sys", "prefix_tokens": 512, "tokens": 120, "output": 40}
//! {"arrival": 0.35, "session": "alice", "tokens": 60, "output": 32}
//! {"arrival": 0.40, "prefix": "sys", "tokens": 200}
//! {"arrival": 0.41, "token_ids": [1, 2, 3, 4], "output": 8}
//! ```
//!
//! - `arrival` (seconds, finite, ≥ 0, non-decreasing) is required.
//! - `session`: the request continues the session — its prompt is everything the session said
//!   and generated so far, then the new tokens; its output joins the session's history.
//! - `prefix`: a named shared prefix of `prefix_tokens` tokens (given at its first use; a later
//!   use may repeat the same length). A session's first request starts with it.
//! - `tokens`: how many new prompt tokens (generated from the seed and the line number), or
//!   `token_ids`: the new prompt tokens themselves.
//! - `output`: generated tokens (default 16, at least 1).
//!
//! Blank lines and lines starting with `#` are skipped. Every error names the line.

use std::collections::HashMap;
use std::path::Path;

use serde::Deserialize;

use super::error::SimError;
use super::rng::SimRng;
use super::workload::{RequestSpec, Workload};

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct Record {
    arrival: f64,
    #[serde(default)]
    session: Option<String>,
    #[serde(default)]
    prefix: Option<String>,
    #[serde(default)]
    prefix_tokens: Option<usize>,
    #[serde(default)]
    tokens: Option<usize>,
    #[serde(default)]
    token_ids: Option<Vec<u32>>,
    #[serde(default)]
    output: Option<usize>,
}

/// Longest prompt or output a trace line may ask for, so a typo cannot allocate gigabytes.
const MAX_TOKENS: usize = 1 << 20;

impl Workload {
    /// A workload replayed from a JSONL trace (see [`parse_trace`] for the format).
    ///
    /// # Errors
    /// The file cannot be read, or a line is invalid (the error names it).
    pub fn from_trace(path: &Path, seed: u64) -> Result<Self, SimError> {
        let requests = load_trace(path, seed)?;
        Ok(Self {
            label: format!("trace {} ({} requests)", path.display(), requests.len()),
            requests,
        })
    }
}

/// Reads and parses a trace file.
///
/// # Errors
/// The file cannot be read ([`SimError::TraceIo`]) or a line is invalid ([`SimError::TraceLine`],
/// with its line number).
pub fn load_trace(path: &Path, seed: u64) -> Result<Vec<RequestSpec>, SimError> {
    let text = std::fs::read_to_string(path).map_err(|error| SimError::TraceIo {
        path: path.to_owned(),
        error,
    })?;
    parse_trace(&text, path, seed)
}

/// Parses trace text; `path` only names the source in errors.
///
/// # Errors
/// The first invalid line, by number.
pub fn parse_trace(text: &str, path: &Path, seed: u64) -> Result<Vec<RequestSpec>, SimError> {
    let mut prefixes: HashMap<String, Vec<u32>> = HashMap::new();
    let mut sessions: HashMap<String, Vec<u32>> = HashMap::new();
    let mut out = Vec::new();
    let mut last_arrival = 0.0f64;
    for (idx, raw) in text.lines().enumerate() {
        let line = idx + 1;
        let trimmed = raw.trim();
        if trimmed.is_empty() || trimmed.starts_with('#') {
            continue;
        }
        let err = |reason: String| SimError::TraceLine {
            path: path.to_owned(),
            line,
            reason,
        };
        let rec: Record = serde_json::from_str(trimmed).map_err(|e| err(format!("invalid record: {e}")))?;
        if !rec.arrival.is_finite() || rec.arrival < 0.0 {
            return Err(err(format!(
                "arrival {} is not a finite, non-negative time",
                rec.arrival
            )));
        }
        if rec.arrival < last_arrival {
            return Err(err(format!(
                "arrival {} is earlier than the previous line's {last_arrival}",
                rec.arrival
            )));
        }
        last_arrival = rec.arrival;
        let mut rng = SimRng::derive(seed, line as u64);
        let fresh: Vec<u32> = match (rec.tokens, rec.token_ids) {
            (Some(_), Some(_)) => return Err(err("give `tokens` or `token_ids`, not both".into())),
            (Some(n), None) if n > MAX_TOKENS => {
                return Err(err(format!("tokens = {n} exceeds the limit of {MAX_TOKENS}")));
            }
            (Some(n), None) => rng.tokens(n),
            (None, Some(ids)) => ids,
            (None, None) => Vec::new(),
        };
        let output_len = rec.output.unwrap_or(16);
        if output_len == 0 || output_len > MAX_TOKENS {
            return Err(err(format!(
                "output = {output_len} must be between 1 and {MAX_TOKENS}"
            )));
        }
        let prefix: Option<&[u32]> = match &rec.prefix {
            None => {
                if rec.prefix_tokens.is_some() {
                    return Err(err("`prefix_tokens` without `prefix`".into()));
                }
                None
            }
            Some(name) => {
                let known = prefixes.get(name).map(Vec::len);
                match (known, rec.prefix_tokens) {
                    (None, None) => {
                        return Err(err(format!(
                            "prefix `{name}` is used for the first time without `prefix_tokens`"
                        )));
                    }
                    (None, Some(n)) if n == 0 || n > MAX_TOKENS => {
                        return Err(err(format!(
                            "prefix_tokens = {n} must be between 1 and {MAX_TOKENS}"
                        )));
                    }
                    (None, Some(n)) => {
                        let stream = 1u64 << 40 | prefixes.len() as u64;
                        prefixes.insert(name.clone(), SimRng::derive(seed, stream).tokens(n));
                    }
                    (Some(have), Some(n)) if have != n => {
                        return Err(err(format!(
                            "prefix `{name}` was declared with {have} tokens, not {n}"
                        )));
                    }
                    (Some(_), _) => {}
                }
                prefixes.get(name).map(Vec::as_slice)
            }
        };
        let mut prompt = Vec::new();
        let history = rec
            .session
            .as_ref()
            .map(|s| sessions.entry(s.clone()).or_default());
        match history {
            Some(h) if !h.is_empty() => prompt.extend_from_slice(h),
            _ => prompt.extend_from_slice(prefix.unwrap_or_default()),
        }
        prompt.extend_from_slice(&fresh);
        if prompt.is_empty() {
            return Err(err(
                "the request has an empty prompt (no tokens, prefix or session history)".into(),
            ));
        }
        let output = rng.tokens(output_len);
        if let Some(s) = &rec.session
            && let Some(h) = sessions.get_mut(s)
        {
            h.clone_from(&prompt);
            h.extend_from_slice(&output);
        }
        out.push(RequestSpec {
            name: format!("line{line}"),
            arrival: rec.arrival,
            prompt: prompt.into(),
            output: output.into(),
        });
    }
    if out.is_empty() {
        return Err(SimError::EmptyWorkload);
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(text: &str) -> Result<Vec<RequestSpec>, SimError> {
        parse_trace(text, Path::new("<trace>"), 1)
    }

    fn line_of(e: &SimError) -> usize {
        match e {
            SimError::TraceLine { line, .. } => *line,
            other => panic!("not a line error: {other}"),
        }
    }

    #[test]
    fn sessions_accumulate_history_and_prefixes_are_shared() {
        let reqs = parse(
            "# a comment\n\
             {\"arrival\": 0.0, \"session\": \"a\", \"prefix\": \"sys\", \"prefix_tokens\": 64, \"tokens\": 10, \"output\": 5}\n\
             \n\
             {\"arrival\": 0.1, \"session\": \"a\", \"tokens\": 7, \"output\": 3}\n\
             {\"arrival\": 0.2, \"prefix\": \"sys\", \"token_ids\": [1, 2, 3]}\n",
        )
        .unwrap();
        assert_eq!(reqs.len(), 3);
        assert_eq!(reqs[0].name, "line2");
        assert_eq!(reqs[0].prompt.len(), 74);
        let mut ctx = reqs[0].prompt.to_vec();
        ctx.extend_from_slice(&reqs[0].output);
        assert!(reqs[1].prompt.starts_with(&ctx));
        assert_eq!(reqs[1].prompt.len(), 74 + 5 + 7);
        assert_eq!(reqs[2].prompt[..64], reqs[0].prompt[..64]);
        assert_eq!(&reqs[2].prompt[64..], &[1, 2, 3]);
        assert_eq!(reqs[2].output.len(), 16);
    }

    #[test]
    fn invalid_lines_are_named_by_number() {
        let cases = [
            ("{\"arrival\": 0.0, \"tokens\": 4}\nnot json\n", 2),
            (
                "{\"arrival\": 0.0, \"tokens\": 4}\n\n{\"arrival\": 1.0, \"tokns\": 4}\n",
                3,
            ),
            ("{\"arrival\": -1.0, \"tokens\": 4}\n", 1),
            (
                "{\"arrival\": 2.0, \"tokens\": 4}\n{\"arrival\": 1.0, \"tokens\": 4}\n",
                2,
            ),
            ("{\"arrival\": 0.0}\n", 1),
            ("{\"arrival\": 0.0, \"prefix\": \"p\", \"tokens\": 3}\n", 1),
            (
                "{\"arrival\": 0.0, \"prefix\": \"p\", \"prefix_tokens\": 8}\n{\"arrival\": 0.0, \"prefix\": \"p\", \"prefix_tokens\": 9}\n",
                2,
            ),
            ("{\"arrival\": 0.0, \"tokens\": 4, \"output\": 0}\n", 1),
            ("{\"arrival\": 0.0, \"tokens\": 4, \"token_ids\": [1]}\n", 1),
        ];
        for (text, want) in cases {
            let e = parse(text).unwrap_err();
            assert_eq!(line_of(&e), want, "{text:?}: {e}");
            assert!(e.to_string().starts_with(&format!("<trace>:{want}: ")), "{e}");
        }
    }

    #[test]
    fn empty_trace_and_missing_file_are_errors() {
        assert!(matches!(parse("\n# nothing\n"), Err(SimError::EmptyWorkload)));
        let e = load_trace(Path::new("/nonexistent/trace.jsonl"), 0).unwrap_err();
        assert!(matches!(e, SimError::TraceIo { .. }));
        assert!(e.to_string().contains("/nonexistent/trace.jsonl"));
    }
}
