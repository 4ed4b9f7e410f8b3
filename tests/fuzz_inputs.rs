//! Structure-aware fuzzing of the two text formats operators hand to `kvtier`, on the stable
//! toolchain: the TOML chain resolver (`ChainConfig::parse`, then what `kvtier check` runs:
//! `check_chain` against the real tier registry, each type's validate-only hook included, and the
//! `[control_plane]` settings) and the JSONL trace parser (`parse_trace`).
//!
//! Each input is a generated document, sometimes mutated with the shared driver's mutations
//! (`tiering_core::testing::fuzz`, which include splicing tokens of the format: TOML headers,
//! keys, quotes; JSON keys and brackets). Every input must parse or fail with an error naming
//! the file and a line inside the document, never panic. Unmutated traces are also checked
//! against a reference model of the trace rules (which line fails, prompt and output lengths,
//! session history and shared prefixes), and unmutated well-formed chains must parse to the
//! tiers that were written.
//!
//! The normal suite runs a short budget; the `#[ignore]`d test runs 10^6 inputs per target
//! (`KVTIER_FUZZ_INPUTS` overrides): `cargo test --release --test fuzz_inputs -- --ignored`.

use std::collections::HashMap;
use std::path::Path;
use std::sync::atomic::{AtomicU64, Ordering};

use arbitrary::{Arbitrary, Unstructured};
use kvtier::sim::SimError;
use kvtier::sim::parse_trace;
use tiering_config::ChainConfig;
use tiering_core::testing::fuzz::{Mutation, drive, inputs, mutate};

// ---------------------------------------------------------------------------------------------
// Chains
// ---------------------------------------------------------------------------------------------

const CHAIN_TOKENS: &[&[u8]] = &[
    b"[primary]\n",
    b"[[secondary]]\n",
    b"[control_plane]\n",
    b"[secondary]\n",
    b"[[primary]]\n",
    b"type = ",
    b"capacity = ",
    b"path = ",
    b"library = ",
    b"same_build = true\n",
    b"\"",
    b"'''",
    b"\"\"\"",
    b"=",
    b"\n",
    b"[",
    b"]",
    b"{",
    b"}",
    b",",
    b"#",
    b"\\u0000",
    b"${",
    b"}",
    b"1e400",
    b"-0",
    b"18446744073709551616",
    b"\"16EiB\"",
    b"\"0\"",
];

/// A tier type: the linked ones, a plausible unknown one, or any string.
#[derive(Arbitrary, Debug)]
enum TierType {
    Cpu,
    Disk,
    P2p,
    Redis,
    Example,
    Unknown,
    Any(String),
}

impl TierType {
    fn name(&self) -> &str {
        match self {
            Self::Cpu => "cpu",
            Self::Disk => "disk",
            Self::P2p => "p2p",
            Self::Redis => "redis",
            Self::Example => "example",
            Self::Unknown => "gpu-direct",
            Self::Any(s) => s,
        }
    }
}

/// An option key: those the shipped tiers read, or any string.
#[derive(Arbitrary, Debug)]
enum OptionKey {
    Capacity,
    Path,
    Name,
    Eviction,
    Sync,
    DirectIo,
    IoThreads,
    Bind,
    Peers,
    HashSeed,
    LayoutFingerprint,
    SecretEnv,
    Insecure,
    Url,
    Urls,
    Cluster,
    Workers,
    SharedMemory,
    Any(String),
}

impl OptionKey {
    fn name(&self) -> &str {
        match self {
            Self::Capacity => "capacity",
            Self::Path => "path",
            Self::Name => "name",
            Self::Eviction => "eviction",
            Self::Sync => "sync",
            Self::DirectIo => "direct_io",
            Self::IoThreads => "io_threads",
            Self::Bind => "bind",
            Self::Peers => "peers",
            Self::HashSeed => "hash_seed",
            Self::LayoutFingerprint => "layout_fingerprint",
            Self::SecretEnv => "secret_env",
            Self::Insecure => "insecure",
            Self::Url => "url",
            Self::Urls => "urls",
            Self::Cluster => "cluster",
            Self::Workers => "workers",
            Self::SharedMemory => "shared_memory",
            Self::Any(s) => s,
        }
    }
}

/// A value of any TOML shape, biased to the ones options take (sizes, durations, paths).
#[derive(Arbitrary, Debug)]
enum Value {
    Size(u32, u8),
    Duration(u16, u8),
    Path(u8),
    Str(String),
    Int(i64),
    Float(f64),
    Bool(bool),
    Ints(Vec<i32>),
    Strs(Vec<String>),
    Inline(Vec<(String, i32)>),
}

impl Value {
    fn render(&self) -> String {
        let s = |v: &str| toml::Value::String(v.to_owned()).to_string();
        match self {
            Self::Size(n, unit) => {
                let unit = ["", "B", "KiB", "MiB", "GiB", "TiB", "KB", "GB", "TB", "EiB", "x"]
                    [usize::from(*unit) % 11];
                s(&format!("{n}{unit}"))
            }
            Self::Duration(n, unit) => s(&format!(
                "{n}{}",
                ["ms", "s", "us", "m", "", "h"][usize::from(*unit) % 6]
            )),
            // Paths stay under a directory that does not exist: validation must not create it.
            Self::Path(n) => s(&format!("/nonexistent-kvtier-fuzz/{n}/../slab{}", n % 3)),
            Self::Str(v) => s(v),
            Self::Int(v) => v.to_string(),
            Self::Float(v) => toml::Value::Float(*v).to_string(),
            Self::Bool(v) => v.to_string(),
            Self::Ints(v) => {
                toml::Value::Array(v.iter().map(|&i| toml::Value::Integer(i.into())).collect()).to_string()
            }
            Self::Strs(v) => {
                toml::Value::Array(v.iter().map(|x| toml::Value::String(x.clone())).collect()).to_string()
            }
            Self::Inline(v) => {
                let t: toml::Table = v
                    .iter()
                    .map(|(k, i)| (k.clone(), toml::Value::Integer((*i).into())))
                    .collect();
                toml::Value::Table(t).to_string()
            }
        }
    }
}

#[derive(Debug)]
struct Tier {
    tier_type: TierType,
    options: Vec<(OptionKey, Value)>,
    /// A library tier (a path that does not exist, so nothing is loaded).
    library: bool,
    same_build: Option<bool>,
}

/// Tiers biased toward the linked types (an unknown type or a library in about one in 16).
impl<'a> Arbitrary<'a> for Tier {
    fn arbitrary(u: &mut Unstructured<'a>) -> arbitrary::Result<Self> {
        let rare = |u: &mut Unstructured<'a>| u.ratio(1u8, 16);
        let tier_type = if rare(u)? {
            TierType::arbitrary(u)?
        } else {
            [
                TierType::Cpu,
                TierType::Disk,
                TierType::P2p,
                TierType::Redis,
                TierType::Example,
            ]
            .into_iter()
            .nth(u.choose_index(5)?)
            .unwrap_or(TierType::Cpu)
        };
        Ok(Self {
            tier_type,
            options: Vec::arbitrary(u)?,
            library: rare(u)?,
            same_build: if rare(u)? { Some(bool::arbitrary(u)?) } else { None },
        })
    }
}

/// A `[control_plane]` setting: valid keys with valid values, or anything.
#[derive(Arbitrary, Debug)]
enum ControlSetting {
    Thread(bool),
    OffStep(bool),
    Reporters(u8),
    IdleWait(u16),
    TierTimeout(u16),
    OnTierFailure(bool),
    Any(String, Value),
}

impl ControlSetting {
    /// The line, and whether the setting is valid.
    fn render(&self) -> (String, bool) {
        match self {
            Self::Thread(b) => (format!("thread = {b}"), true),
            Self::OffStep(b) => (format!("off_step = {b}"), true),
            Self::Reporters(n) => (format!("reporters = {n}"), (1..=64).contains(n)),
            Self::IdleWait(ms) => (format!("idle_wait = \"{ms}ms\""), true),
            Self::TierTimeout(ms) => (format!("tier_timeout = \"{ms}ms\""), true),
            Self::OnTierFailure(q) => (
                format!("on_tier_failure = \"{}\"", if *q { "quarantine" } else { "fail" }),
                true,
            ),
            Self::Any(k, v) => (format!("{} = {}", toml_key(k), v.render()), false),
        }
    }
}

#[derive(Debug)]
struct Chain {
    primary: Option<Tier>,
    secondaries: Vec<Tier>,
    control: Vec<ControlSetting>,
    comments: bool,
}

/// Chains biased toward the valid shape (no primary in about one in 16).
impl<'a> Arbitrary<'a> for Chain {
    fn arbitrary(u: &mut Unstructured<'a>) -> arbitrary::Result<Self> {
        Ok(Self {
            primary: if u.ratio(1u8, 16)? {
                None
            } else {
                Some(Tier::arbitrary(u)?)
            },
            secondaries: Vec::arbitrary(u)?,
            control: if bool::arbitrary(u)? {
                Vec::arbitrary(u)?
            } else {
                Vec::new()
            },
            comments: bool::arbitrary(u)?,
        })
    }
}

/// `k` as a TOML key: bare when it can be, else a one-line basic string (the `toml` crate
/// renders a string with a newline as a multi-line string, which a key cannot be).
fn toml_key(k: &str) -> String {
    if !k.is_empty()
        && k.bytes()
            .all(|b| b.is_ascii_alphanumeric() || b == b'_' || b == b'-')
    {
        return k.to_owned();
    }
    let mut out = String::from("\"");
    for c in k.chars() {
        match c {
            '"' => out.push_str("\\\""),
            '\\' => out.push_str("\\\\"),
            c if c.is_control() => out.push_str(&format!("\\u{:04x}", u32::from(c))),
            c => out.push(c),
        }
    }
    out.push('"');
    out
}

fn render_tier(out: &mut String, header: &str, t: &Tier, comments: bool) {
    out.push_str(header);
    out.push('\n');
    if comments {
        out.push_str("# a comment between the header and the keys\n\n");
    }
    out.push_str(&format!(
        "type = {}\n",
        toml::Value::String(t.tier_type.name().to_owned())
    ));
    if t.library {
        out.push_str("library = \"/nonexistent-kvtier-fuzz/libtier.so\"\n");
    }
    if let Some(b) = t.same_build {
        out.push_str(&format!("same_build = {b}\n"));
    }
    let mut seen = vec!["type", "library", "same_build"];
    for (k, v) in &t.options {
        // A repeated key is a TOML error the mutations reach anyway; keep the document well-formed.
        if seen.contains(&k.name()) {
            continue;
        }
        seen.push(k.name());
        out.push_str(&format!("{} = {}\n", toml_key(k.name()), v.render()));
    }
    out.push('\n');
}

/// The chain's text, and whether it is structurally valid (the parser must accept it).
fn render_chain(c: &Chain) -> (String, bool) {
    let mut out = String::new();
    let mut valid = true;
    if let Some(p) = &c.primary {
        render_tier(&mut out, "[primary]", p, c.comments);
        valid &= !p.library && !p.tier_type.name().is_empty();
    } else {
        valid = false;
    }
    for s in &c.secondaries {
        render_tier(&mut out, "[[secondary]]", s, c.comments);
        valid &= !s.tier_type.name().is_empty();
    }
    if !c.control.is_empty() {
        out.push_str("[control_plane]\n");
        let mut seen = Vec::new();
        for setting in &c.control {
            let (line, ok) = setting.render();
            let key = line.split(" = ").next().unwrap_or_default().to_owned();
            if seen.contains(&key) {
                continue;
            }
            seen.push(key);
            valid &= ok;
            out.push_str(&line);
            out.push('\n');
        }
    }
    (out, valid)
}

/// How the inputs fared, printed after a run so a budget that stops exercising the parser
/// (every input refused at the first byte) shows.
static PARSED: AtomicU64 = AtomicU64::new(0);
static REFUSED: AtomicU64 = AtomicU64::new(0);
static MODEL_CHECKED: AtomicU64 = AtomicU64::new(0);

fn outcomes(name: &str) -> u64 {
    let parsed = PARSED.swap(0, Ordering::Relaxed);
    let refused = REFUSED.swap(0, Ordering::Relaxed);
    let checked = MODEL_CHECKED.swap(0, Ordering::Relaxed);
    eprintln!(
        "fuzz {name}: {parsed} parsed, {refused} refused with a located error, {checked} checked against the model"
    );
    parsed.min(refused).min(checked)
}

fn registry() -> &'static tiering_core::registry::Registry {
    kvtier::sim::registry().expect("the linked tier registry")
}

/// Asserts an error names the fuzz file and a line inside the document (or none).
fn assert_located(e: &tiering_config::ChainError, text: &str) {
    assert_eq!(e.file, "fuzz.toml", "{e}");
    let lines = text.lines().count().max(1) + 1;
    if let Some(l) = e.line {
        assert!(
            (1..=lines).contains(&l),
            "line {l} outside a {lines}-line document: {e}"
        );
    }
    assert!(!e.to_string().is_empty());
}

/// One chain input: parse, then everything `kvtier check` does.
fn chain_case(u: &mut Unstructured<'_>) -> arbitrary::Result<()> {
    let chain = Chain::arbitrary(u)?;
    let (text, valid) = render_chain(&chain);
    let mutation = Mutation::arbitrary(u)?;
    let unmutated = mutation.is_none();
    let input = mutate(text.into_bytes(), mutation, CHAIN_TOKENS);
    let Ok(text) = String::from_utf8(input) else {
        // `ChainConfig::load` refuses non-UTF-8 files before parsing.
        return Ok(());
    };
    match ChainConfig::parse("fuzz.toml", &text) {
        Err(e) => {
            assert!(
                !(unmutated && valid),
                "a well-formed chain was refused: {e}\n{text}"
            );
            assert_located(&e, &text);
            REFUSED.fetch_add(1, Ordering::Relaxed);
        }
        Ok(cfg) => {
            if unmutated && valid {
                let types: Vec<&str> = cfg.tiers().map(|t| t.tier_type.as_str()).collect();
                let mut want: Vec<&str> = chain.primary.iter().map(|t| t.tier_type.name()).collect();
                want.extend(chain.secondaries.iter().map(|t| t.tier_type.name()));
                assert_eq!(types, want, "{text}");
                MODEL_CHECKED.fetch_add(1, Ordering::Relaxed);
            }
            PARSED.fetch_add(1, Ordering::Relaxed);
            let _ = cfg.manager_config();
            let check = kvtier::check::check_chain(&cfg, registry(), false);
            for e in &check.errors {
                assert_located(e, &text);
            }
        }
    }
    Ok(())
}

// ---------------------------------------------------------------------------------------------
// Traces
// ---------------------------------------------------------------------------------------------

const TRACE_TOKENS: &[&[u8]] = &[
    b"\n",
    b"#",
    b"{",
    b"}",
    b"[",
    b"]",
    b",",
    b":",
    b"\"",
    b"\"arrival\": ",
    b"\"session\": ",
    b"\"prefix\": ",
    b"\"prefix_tokens\": ",
    b"\"tokens\": ",
    b"\"token_ids\": ",
    b"\"output\": ",
    b"1e308",
    b"-1",
    b"NaN",
    b"null",
    b"4294967296",
    b"1048577",
    b"\\ud800",
];

#[derive(Arbitrary, Debug)]
enum Body {
    None,
    Tokens(u8),
    Ids(Vec<u16>),
    Both(u8, Vec<u16>),
}

#[derive(Debug)]
struct Line {
    /// Blank or comment lines between records.
    filler: Option<bool>,
    /// Milliseconds after the previous line; with `earlier`, before it.
    gap_ms: u8,
    earlier: bool,
    session: Option<u8>,
    prefix: Option<u8>,
    prefix_tokens: Option<u8>,
    body: Body,
    output: Option<u8>,
    unknown_field: bool,
}

/// Lines biased toward valid records (each rule is broken in about one line in 40), so a
/// trace of many lines usually parses far enough to exercise sessions and prefixes.
impl<'a> Arbitrary<'a> for Line {
    fn arbitrary(u: &mut Unstructured<'a>) -> arbitrary::Result<Self> {
        let rare = |u: &mut Unstructured<'a>| u.ratio(1u8, 40);
        let filler = if rare(u)? { Some(bool::arbitrary(u)?) } else { None };
        let prefix = if u.ratio(1u8, 3)? {
            Some(u8::arbitrary(u)?)
        } else {
            None
        };
        let prefix_tokens = match prefix {
            // Declared at its first use; sometimes repeated, sometimes (wrongly) changed.
            Some(_) if !rare(u)? => Some(u.int_in_range(1..=48)?),
            _ if rare(u)? => Some(u8::arbitrary(u)?),
            _ => None,
        };
        let body = if rare(u)? {
            Body::arbitrary(u)?
        } else if bool::arbitrary(u)? {
            Body::Tokens(u.int_in_range(1..=64)?)
        } else {
            Body::Ids(Vec::arbitrary(u)?)
        };
        Ok(Self {
            filler,
            gap_ms: u8::arbitrary(u)?,
            earlier: rare(u)?,
            session: if bool::arbitrary(u)? {
                Some(u8::arbitrary(u)?)
            } else {
                None
            },
            prefix,
            prefix_tokens,
            body,
            output: if rare(u)? {
                Some(u8::arbitrary(u)?)
            } else {
                Some(u.int_in_range(1..=32)?)
            },
            unknown_field: rare(u)?,
        })
    }
}

/// What the parser must answer for a trace: per request its prompt and output lengths, or the
/// line of the first error (`0` for "no request at all").
fn model(lines: &[Line]) -> Result<Vec<(usize, usize)>, usize> {
    let mut prefixes: HashMap<u8, usize> = HashMap::new();
    let mut sessions: HashMap<u8, usize> = HashMap::new();
    let mut out = Vec::new();
    let mut arrival = 0i64;
    let mut last = 0i64;
    for (i, l) in lines.iter().enumerate() {
        let line = i + 1;
        if l.filler.is_some() {
            continue;
        }
        arrival += if l.earlier {
            -i64::from(l.gap_ms)
        } else {
            i64::from(l.gap_ms)
        };
        if l.unknown_field || arrival < 0 || arrival < last {
            return Err(line);
        }
        last = arrival;
        let fresh = match &l.body {
            Body::Both(..) => return Err(line),
            Body::None => 0,
            Body::Tokens(n) => usize::from(*n),
            Body::Ids(ids) => ids.len(),
        };
        let output = l.output.map_or(16, usize::from);
        if output == 0 {
            return Err(line);
        }
        let prefix = match (l.prefix, l.prefix_tokens) {
            (None, Some(_)) => return Err(line),
            (None, None) => 0,
            (Some(p), n) => match (prefixes.get(&p).copied(), n) {
                (None, None) | (None, Some(0)) => return Err(line),
                (None, Some(n)) => {
                    prefixes.insert(p, usize::from(n));
                    usize::from(n)
                }
                (Some(have), Some(n)) if have != usize::from(n) => return Err(line),
                (Some(have), _) => have,
            },
        };
        let history = l.session.and_then(|s| sessions.get(&s).copied()).unwrap_or(0);
        let prompt = if history > 0 { history } else { prefix } + fresh;
        if prompt == 0 {
            return Err(line);
        }
        if let Some(s) = l.session {
            sessions.insert(s, prompt + output);
        }
        out.push((prompt, output));
    }
    if out.is_empty() { Err(0) } else { Ok(out) }
}

fn render_trace(lines: &[Line]) -> String {
    let mut out = String::new();
    let mut arrival = 0i64;
    for l in lines {
        match l.filler {
            Some(true) => {
                out.push_str("# a comment\n");
                continue;
            }
            Some(false) => {
                out.push_str("   \n");
                continue;
            }
            None => {}
        }
        arrival += if l.earlier {
            -i64::from(l.gap_ms)
        } else {
            i64::from(l.gap_ms)
        };
        let mut rec = serde_json::Map::new();
        #[allow(clippy::cast_precision_loss)] // milliseconds of a short trace: exact in f64
        rec.insert("arrival".into(), serde_json::json!(arrival as f64 / 1000.0));
        if let Some(s) = l.session {
            rec.insert("session".into(), serde_json::json!(format!("s{}", s % 4)));
        }
        if let Some(p) = l.prefix {
            rec.insert("prefix".into(), serde_json::json!(format!("p{}", p % 3)));
        }
        if let Some(n) = l.prefix_tokens {
            rec.insert("prefix_tokens".into(), serde_json::json!(n));
        }
        match &l.body {
            Body::None => {}
            Body::Tokens(n) => {
                rec.insert("tokens".into(), serde_json::json!(n));
            }
            Body::Ids(ids) => {
                rec.insert("token_ids".into(), serde_json::json!(ids));
            }
            Body::Both(n, ids) => {
                rec.insert("tokens".into(), serde_json::json!(n));
                rec.insert("token_ids".into(), serde_json::json!(ids));
            }
        }
        if let Some(o) = l.output {
            rec.insert("output".into(), serde_json::json!(o));
        }
        if l.unknown_field {
            rec.insert("temperature".into(), serde_json::json!(0.7));
        }
        out.push_str(&serde_json::Value::Object(rec).to_string());
        out.push('\n');
    }
    out
}

/// Canonical names, so the model's keys match what is rendered.
fn canonical(mut lines: Vec<Line>) -> Vec<Line> {
    for l in &mut lines {
        l.session = l.session.map(|s| s % 4);
        l.prefix = l.prefix.map(|p| p % 3);
    }
    lines
}

/// One trace input: parse; unmutated, compare with the model.
fn trace_case(u: &mut Unstructured<'_>) -> arbitrary::Result<()> {
    let lines = canonical(Vec::<Line>::arbitrary(u)?);
    let text = render_trace(&lines);
    let mutation = Mutation::arbitrary(u)?;
    let unmutated = mutation.is_none();
    let input = mutate(text.into_bytes(), mutation, TRACE_TOKENS);
    let Ok(text) = String::from_utf8(input) else {
        // `load_trace` reads the file as UTF-8 before parsing.
        return Ok(());
    };
    let parsed = parse_trace(&text, Path::new("fuzz.jsonl"), 9);
    match &parsed {
        Err(SimError::TraceLine { path, line, reason }) => {
            assert_eq!(path, Path::new("fuzz.jsonl"));
            assert!(
                *line >= 1 && *line <= text.lines().count(),
                "line {line}: {reason}"
            );
            assert!(!reason.is_empty());
            REFUSED.fetch_add(1, Ordering::Relaxed);
        }
        Err(SimError::EmptyWorkload) => {}
        Ok(_) => {
            PARSED.fetch_add(1, Ordering::Relaxed);
        }
        Err(other) => panic!("unexpected trace error: {other}"),
    }
    if unmutated {
        MODEL_CHECKED.fetch_add(1, Ordering::Relaxed);
        match (model(&lines), parsed) {
            (Ok(want), Ok(reqs)) => {
                let got: Vec<(usize, usize)> =
                    reqs.iter().map(|r| (r.prompt.len(), r.output.len())).collect();
                assert_eq!(got, want, "{text}");
                assert!(reqs.windows(2).all(|w| w[0].arrival <= w[1].arrival));
            }
            (Err(0), Err(SimError::EmptyWorkload)) => {}
            (Err(want), Err(SimError::TraceLine { line, .. })) => assert_eq!(line, want, "{text}"),
            (want, got) => panic!("model {want:?}, parser {got:?}\n{text}"),
        }
    }
    Ok(())
}

/// Both targets in one test: the outcome counters are shared, so the runs must not overlap.
#[test]
fn fuzz_chain_resolver_and_trace_parser_short() {
    assert!(drive("chain", 3_000, 0x5eed_0c01, chain_case) > 0);
    assert!(
        outcomes("chain") > 0,
        "the chain budget no longer reaches every outcome"
    );
    assert!(drive("trace", 10_000, 0x5eed_0c02, trace_case) > 0);
    assert!(
        outcomes("trace") > 0,
        "the trace budget no longer reaches every outcome"
    );
}

#[test]
#[ignore = "long run: 10^6 inputs per target"]
fn fuzz_chain_resolver_and_trace_parser_long() {
    assert!(drive("chain", inputs(1_000_000), 0x10c5_0c01, chain_case) > 0);
    assert!(outcomes("chain") > 0);
    assert!(drive("trace", inputs(1_000_000), 0x10c5_0c02, trace_case) > 0);
    assert!(outcomes("trace") > 0);
}
