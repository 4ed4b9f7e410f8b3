//! Chain files: parsing, error locations, resolution and building with test-registered tiers.

use std::sync::Arc;
use std::time::Duration;

use parking_lot::Mutex;
use serde::Deserialize;

use super::*;
use tiering_core::TierError;
use tiering_core::options::{ByteSize, parse_options};
use tiering_core::registry::{PrimaryContext, Registry, SecondaryContext};
use tiering_core::testing::{MemoryPrimary, ScriptedTier, ScriptedTierHandle};
use tiering_core::{Locality, Medium};
use tiering_core::{PrimaryTier, SecondaryTier};

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct MemOpts {
    chunks: usize,
}

static PRIMARIES: Mutex<Vec<MemoryPrimary>> = Mutex::new(Vec::new());
static SCRIPTED: Mutex<Vec<(String, ScriptedTierHandle)>> = Mutex::new(Vec::new());

fn mem_primary(options: &toml::Table, ctx: &PrimaryContext) -> Result<Box<dyn PrimaryTier>, TierError> {
    let o: MemOpts = parse_options(options)?;
    let p = MemoryPrimary::new(o.chunks, ctx.chunk_bytes);
    PRIMARIES.lock().push(p.clone());
    Ok(Box::new(p))
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct ScriptOpts {
    name: String,
    #[serde(default)]
    capacity: Option<ByteSize>,
}

fn scripted(options: &toml::Table, _: &SecondaryContext) -> Result<Box<dyn SecondaryTier>, TierError> {
    let o: ScriptOpts = parse_options(options)?;
    let _ = o.capacity;
    let (t, h) = ScriptedTier::new(&o.name);
    SCRIPTED.lock().push((o.name, h));
    Ok(Box::new(t))
}

fn failing(options: &toml::Table, _: &SecondaryContext) -> Result<Box<dyn SecondaryTier>, TierError> {
    assert!(!options.contains_key("panic"), "deliberate factory panic");
    Err(TierError::Config("this tier always fails to start".into()))
}

tiering_core::register_tier!(primary "chain-test-memory" => mem_primary);
tiering_core::register_tier!(secondary "chain-test-scripted" => scripted);
tiering_core::register_tier!(secondary "chain-test-failing" => failing);

fn handle(name: &str) -> ScriptedTierHandle {
    SCRIPTED
        .lock()
        .iter()
        .rev()
        .find(|(n, _)| n == name)
        .map(|(_, h)| h.clone())
        .unwrap()
}

fn parse(text: &str) -> Result<ChainConfig, ChainError> {
    ChainConfig::parse("chain.toml", text)
}

fn build(text: &str) -> Result<tiering_core::TieringManager, ChainError> {
    parse(text)?.build(Registry::global().unwrap(), 128)
}

/// The build error (`TieringManager` is not `Debug`, so no `unwrap_err`).
fn build_err(text: &str) -> ChainError {
    match build(text) {
        Ok(_) => panic!("the chain unexpectedly built"),
        Err(e) => e,
    }
}

#[test]
fn a_full_chain_parses_with_positions_lines_and_control_plane() {
    let c = parse(
        r#"# comment
[primary]
type = "chain-test-memory"
chunks = 8

[[secondary]]
type = "chain-test-scripted"
name = "one"
capacity = "64GiB"

[[secondary]]
# the second secondary tier

type = "chain-test-scripted"
library = "x/liby.so"
same_build = true
name = "two"

[control_plane]
thread = false
off_step = true
reporters = 2
idle_wait = "250us"
tier_timeout = "3s"
worker_deadline = "750ms"
on_tier_failure = "fail"
"#,
    )
    .unwrap();
    assert_eq!(c.primary.position, TierPosition::Primary);
    assert_eq!(c.primary.line, 2);
    assert_eq!(
        c.primary.options.get("chunks").and_then(toml::Value::as_integer),
        Some(8)
    );
    assert!(!c.primary.options.contains_key("type"));
    assert_eq!(c.secondaries.len(), 2);
    assert_eq!(c.secondaries[0].position, TierPosition::Secondary(0));
    assert_eq!(c.secondaries[0].line, 6);
    assert_eq!(c.secondaries[0].key_line("capacity"), Some(9));
    assert_eq!(c.secondaries[1].line, 11, "the header line, above a comment");
    assert_eq!(
        c.secondaries[1].library.as_deref(),
        Some(std::path::Path::new("x/liby.so"))
    );
    assert!(c.secondaries[1].same_build);
    assert!(!c.secondaries[1].options.contains_key("library"));
    let mc = c.control_plane.manager_config();
    assert!(!mc.control_plane_thread);
    assert!(mc.off_step);
    assert_eq!(mc.idle_wait, Duration::from_micros(250));
    assert_eq!(mc.reporters, 2);
    assert_eq!(mc.tier_timeout, Duration::from_secs(3));
    assert_eq!(mc.worker_deadline, Duration::from_millis(750));
    assert_eq!(mc.on_tier_failure, tiering_core::OnTierFailure::Fail);
    assert_eq!(
        c.secondaries[1].describe(),
        "[[secondary]] #2 (type \"chain-test-scripted\")"
    );
}

#[test]
fn placeholders_expand_in_strings() {
    let c = parse("[primary]\ntype = \"m\"\npath = \"${tmpdir}/kv-${pid}\"\n").unwrap();
    let path = c.primary.options["path"].as_str().unwrap().to_owned();
    assert!(
        path.starts_with(&*std::env::temp_dir().to_string_lossy()),
        "{path}"
    );
    assert!(path.ends_with(&format!("kv-{}", std::process::id())), "{path}");
}

#[test]
fn malformed_toml_names_file_and_line() {
    let e = parse("[primary]\ntype = \"m\"\nchunks = = 3\n").unwrap_err();
    assert!(matches!(*e.kind, ChainErrorKind::Syntax(_)), "{e}");
    assert_eq!(e.line, Some(3));
    assert!(e.to_string().starts_with("chain.toml:3: invalid TOML"), "{e}");
}

#[test]
fn structural_errors_are_located() {
    let e = parse("[primary]\ntype = \"a\"\n[primary]\ntype = \"b\"\n").unwrap_err();
    assert!(e.to_string().contains("two [primary] sections"), "{e}");
    assert_eq!(e.line, Some(3));

    let e = parse("[[secondary]]\ntype = \"a\"\n").unwrap_err();
    assert!(e.to_string().contains("no [primary] section"), "{e}");

    let e = parse("[primary]\nchunks = 3\n").unwrap_err();
    assert!(e.to_string().contains("missing `type`"), "{e}");
    assert_eq!(e.line, Some(1));

    let e = parse("[primary]\ntype = \"a\"\n\n[control_plane]\nthread = true\nidle = \"1ms\"\n").unwrap_err();
    assert!(matches!(*e.kind, ChainErrorKind::UnknownKey { .. }), "{e}");
    assert_eq!(e.line, Some(6));
    assert_eq!(e.key.as_deref(), Some("idle"));
    assert!(
        e.to_string()
            .starts_with("chain.toml:6: [control_plane]: key `idle`: unknown key"),
        "{e}"
    );

    let e = parse("tiers = 3\n[primary]\ntype = \"a\"\n").unwrap_err();
    assert!(e.to_string().contains("unknown key `tiers`"), "{e}");

    let e = parse("[primary]\ntype = \"a\"\n[control_plane]\nidle_wait = \"fast\"\n").unwrap_err();
    assert!(
        e.to_string().contains("chain.toml:4") && e.to_string().contains("invalid duration `fast`"),
        "{e}"
    );

    let e = parse("[primary]\ntype = \"a\"\nlibrary = \"l.so\"\n").unwrap_err();
    assert!(e.to_string().contains("cannot come from a library"), "{e}");
}

#[test]
fn unknown_types_list_the_registered_ones() {
    let e = build_err(
        "[primary]\ntype = \"chain-test-memory\"\nchunks = 4\n\n[[secondary]]\ntype = \"nvme-magic\"\n",
    );
    let ChainErrorKind::UnknownType { tier_type, known } = &*e.kind else {
        panic!("{e}")
    };
    assert_eq!(tier_type, "nvme-magic");
    assert!(
        known.iter().any(|k| k == "chain-test-scripted (secondary)"),
        "{known:?}"
    );
    assert_eq!(e.line, Some(6));
    assert!(e.to_string().contains("[[secondary]] #1"), "{e}");

    let e = build_err("[primary]\ntype = \"chain-test-scripted\"\nname = \"x\"\n");
    assert!(
        e.to_string()
            .contains("is a secondary tier and cannot be used here"),
        "{e}"
    );
}

#[test]
fn option_errors_from_the_tier_point_at_the_key() {
    let e = build_err(
        "[primary]\ntype = \"chain-test-memory\"\nchunks = 4\n\n[[secondary]]\ntype = \"chain-test-scripted\"\nname = \"s\"\ncapasity = \"1GiB\"\n",
    );
    assert_eq!(e.line, Some(8), "{e}");
    assert_eq!(e.key.as_deref(), Some("capasity"));
    assert!(
        e.to_string()
            .starts_with("chain.toml:8: [[secondary]] #1 (type \"chain-test-scripted\"): key `capasity`"),
        "{e}"
    );

    let e = build_err(
        "[primary]\ntype = \"chain-test-memory\"\nchunks = 4\n\n[[secondary]]\ntype = \"chain-test-scripted\"\nname = \"s\"\ncapacity = \"12 parsecs\"\n",
    );
    assert_eq!(e.line, Some(8), "{e}");
    assert!(e.to_string().contains("invalid size `12 parsecs`"), "{e}");
}

#[test]
fn a_chain_builds_a_working_manager_with_one_waker() {
    let mut m = build(
        "[primary]\ntype = \"chain-test-memory\"\nchunks = 4\n[[secondary]]\ntype = \"chain-test-scripted\"\nname = \"built-a\"\n[[secondary]]\ntype = \"chain-test-scripted\"\nname = \"built-b\"\n[control_plane]\nthread = false\n",
    )
    .unwrap();
    let stats = m.stats().unwrap();
    let names: Vec<String> = stats.secondaries.iter().map(|s| s.name.clone()).collect();
    assert_eq!(names, ["built-a", "built-b"], "chain order is preserved");
    assert!(!m.control_thread_running());
    m.shutdown().unwrap();
    assert_eq!(handle("built-a").count("shutdown"), 1);
}

#[test]
fn a_failing_constructor_shuts_down_what_was_built_in_reverse_order() {
    let chain = "[primary]\ntype = \"chain-test-memory\"\nchunks = 4\n\
        [[secondary]]\ntype = \"chain-test-scripted\"\nname = \"rev-1\"\n\
        [[secondary]]\ntype = \"chain-test-scripted\"\nname = \"rev-2\"\n\
        [[secondary]]\ntype = \"chain-test-failing\"\n";
    let e = build_err(chain);
    assert!(e.to_string().contains("always fails to start"), "{e}");
    assert!(e.to_string().contains("[[secondary]] #3"), "{e}");
    let (h1, h2) = (handle("rev-1"), handle("rev-2"));
    let s1 = h1.calls_of("shutdown");
    let s2 = h2.calls_of("shutdown");
    assert_eq!((s1.len(), s2.len()), (1, 1));
    assert!(s2[0].seq < s1[0].seq, "the later tier is shut down first");
    // Nothing holds the arena but the test's own clone of the primary (its two references).
    let primary = PRIMARIES.lock().pop().unwrap();
    assert_eq!(
        Arc::strong_count(primary.arena()),
        2,
        "the built tiers were dropped"
    );

    let e = build_err(&format!("{chain}panic = true\n"));
    assert!(e.to_string().contains("the factory panicked"), "{e}");
}

#[test]
fn duplicate_tier_names_are_refused() {
    let e = build_err(
        "[primary]\ntype = \"chain-test-memory\"\nchunks = 4\n[[secondary]]\ntype = \"chain-test-scripted\"\nname = \"dup\"\n[[secondary]]\ntype = \"chain-test-scripted\"\nname = \"dup\"\n",
    );
    assert!(
        matches!(*e.kind, ChainErrorKind::DuplicateName(ref n) if n == "dup"),
        "{e}"
    );
    assert!(e.to_string().contains("[[secondary]] #2"), "{e}");
}

#[test]
#[cfg(feature = "libraries")]
fn library_errors_are_located_at_the_library_key() {
    let e = build_err(
        "[primary]\ntype = \"chain-test-memory\"\nchunks = 4\n[[secondary]]\ntype = \"x\"\nlibrary = \"/nonexistent/libx.so\"\n",
    );
    assert!(
        matches!(
            *e.kind,
            ChainErrorKind::Plugin(tiering_plugin::PluginError::NotFound { .. })
        ),
        "{e}"
    );
    assert_eq!(e.line, Some(6));
    assert!(
        e.to_string().contains("/nonexistent/libx.so does not exist"),
        "{e}"
    );
}

#[test]
#[cfg(not(feature = "libraries"))]
fn without_the_libraries_feature_a_library_tier_is_refused_at_its_key() {
    let text = "[primary]\ntype = \"chain-test-memory\"\nchunks = 4\n[[secondary]]\ntype = \"x\"\nlibrary = \"/nonexistent/libx.so\"\n";
    let e = build_err(text);
    assert!(matches!(*e.kind, ChainErrorKind::LibrariesDisabled), "{e}");
    assert_eq!(e.line, Some(6));
    assert_eq!(e.key.as_deref(), Some("library"));
    assert!(e.to_string().contains("without its `libraries` feature"), "{e}");
    // `kvtier check`'s path reports the same error.
    let errors = parse(text).unwrap().validate(Registry::global().unwrap());
    assert!(
        errors
            .iter()
            .any(|e| matches!(*e.kind, ChainErrorKind::LibrariesDisabled)),
        "{errors:?}"
    );
}

#[test]
fn resolved_chains_print_their_sources() {
    let c = parse("[primary]\ntype = \"chain-test-memory\"\nchunks = 4\n[[secondary]]\ntype = \"chain-test-scripted\"\nname = \"p\"\n").unwrap();
    let r = c.resolve(Registry::global().unwrap()).unwrap();
    let text = r.to_string();
    assert!(
        text.contains("[primary] type \"chain-test-memory\" — linked in (crate tiering-config)"),
        "{text}"
    );
    assert!(text.contains("name = \"p\""), "{text}");
}

#[test]
fn bad_control_plane_values_name_the_key() {
    for (text, key) in [
        (
            "[primary]\ntype = \"a\"\n[control_plane]\nreporters = 0\n",
            "reporters",
        ),
        (
            "[primary]\ntype = \"a\"\n[control_plane]\non_tier_failure = \"ignore\"\n",
            "on_tier_failure",
        ),
        (
            "[primary]\ntype = \"a\"\n[control_plane]\ntier_timeout = 5\n",
            "tier_timeout",
        ),
    ] {
        let e = parse(text).unwrap_err().to_string();
        assert!(e.contains(key) && e.contains(":4"), "{e}");
    }
}

#[test]
fn admission_and_backpressure_parse_in_every_form() {
    let c = parse(
        "[primary]\ntype = \"m\"\n\
         [[secondary]]\ntype = \"a\"\nadmission = \"tinylfu\"\nbackpressure = false\n\
         [[secondary]]\ntype = \"b\"\nadmission = { policy = \"store_threshold\", n = 3 }\n\
         backpressure = { high_water_per_mib = \"200ms\", low_water_per_mib = \"100ms\", alpha = 0.5, warmup = 1, probe_interval = \"1s\" }\n\
         [[secondary]]\ntype = \"c\"\n\
         [secondary.admission]\npolicy = \"after_first_reuse\"\nmax_tracked = 10\n",
    )
    .unwrap();
    let [a, b, c] = &c.secondaries[..] else {
        panic!("three secondaries expected");
    };
    assert_eq!(a.admission.as_ref().unwrap().policy(), "tinylfu");
    assert!(!a.backpressure.as_ref().unwrap().enabled);
    assert!(
        !a.options.contains_key("admission"),
        "gate keys are not tier options"
    );
    let adm = b.admission.as_ref().unwrap();
    assert_eq!(adm.to_string(), "store_threshold n=3");
    let bp = b.backpressure.as_ref().unwrap();
    assert_eq!(bp.high_water_per_mib, Duration::from_millis(200));
    assert_eq!(bp.low_water_per_mib, Duration::from_millis(100));
    assert!((bp.alpha - 0.5).abs() < f64::EPSILON);
    assert_eq!((bp.warmup, bp.probe_interval), (1, Duration::from_secs(1)));
    assert_eq!(
        c.admission.as_ref().unwrap().to_string(),
        "after_first_reuse max_tracked=10"
    );
    assert!(c.backpressure.is_none());
}

#[test]
fn bad_gate_values_name_file_line_and_key() {
    let cases = [
        // (text, line, key, message fragment)
        (
            "[primary]\ntype = \"m\"\nadmission = \"always\"\n",
            3,
            "admission",
            "the primary tier has none",
        ),
        (
            "[primary]\ntype = \"m\"\n[[secondary]]\ntype = \"s\"\nadmission = \"lfu\"\n",
            5,
            "admission",
            "registered policies: ",
        ),
        (
            "[primary]\ntype = \"m\"\n[[secondary]]\ntype = \"s\"\nadmission = { policy = \"store_threshold\",\n  m = 2 }\n",
            6,
            "admission.m",
            "unknown field `m`",
        ),
        (
            "[primary]\ntype = \"m\"\n[[secondary]]\ntype = \"s\"\n[secondary.admission]\npolicy = \"tinylfu\"\nwidth = 0\n",
            7,
            "admission.width",
            "`width` must be",
        ),
        (
            "[primary]\ntype = \"m\"\n[[secondary]]\ntype = \"s\"\nadmission = { n = 2 }\n",
            5,
            "admission",
            "names its policy",
        ),
        (
            "[primary]\ntype = \"m\"\n[[secondary]]\ntype = \"s\"\nadmission = 3\n",
            5,
            "admission",
            "policy name",
        ),
        (
            "[primary]\ntype = \"m\"\n[[secondary]]\ntype = \"s\"\nbackpressure = \"on\"\n",
            5,
            "backpressure",
            "true, false or a table",
        ),
        (
            "[primary]\ntype = \"m\"\n[[secondary]]\ntype = \"s\"\n[secondary.backpressure]\nalpha = 0.3\nhigh_water = \"1s\"\n",
            7,
            "backpressure.high_water",
            "unknown key `high_water`",
        ),
        (
            "[primary]\ntype = \"m\"\n[[secondary]]\ntype = \"s\"\n[secondary.backpressure]\nlow_water_per_mib = \"2s\"\n",
            6,
            "backpressure.low_water_per_mib",
            "must not exceed",
        ),
        (
            "[primary]\ntype = \"m\"\n[[secondary]]\ntype = \"s\"\nbackpressure = { probe_interval = \"soon\" }\n",
            5,
            "backpressure.probe_interval",
            "invalid duration `soon`",
        ),
        (
            "[primary]\ntype = \"m\"\n[[secondary]]\ntype = \"s\"\nbackpressure = { alpha = 1.5 }\n",
            5,
            "backpressure.alpha",
            "(0, 1]",
        ),
    ];
    for (text, line, key, fragment) in cases {
        let e = parse(text).unwrap_err();
        assert_eq!(e.file, "chain.toml");
        assert_eq!(e.line, Some(line), "{e}");
        assert_eq!(e.key.as_deref(), Some(key), "{e}");
        assert!(e.to_string().contains(fragment), "{e}");
    }
}

#[test]
fn a_built_chain_gates_local_storage_after_first_reuse_unless_told_otherwise() {
    let mut m = build(
        "[primary]\ntype = \"chain-test-memory\"\nchunks = 4\n\
         [[secondary]]\ntype = \"chain-test-scripted\"\nname = \"gate-default\"\n\
         [[secondary]]\ntype = \"chain-test-scripted\"\nname = \"gate-always\"\nadmission = \"always\"\nbackpressure = false\n\
         [control_plane]\nthread = false\n",
    )
    .unwrap();
    let gates = m.stats().unwrap().gates;
    let policies: Vec<(&str, &str)> = gates
        .iter()
        .map(|g| (g.tier.as_str(), g.admission.as_str()))
        .collect();
    assert_eq!(
        policies,
        [("gate-default", "after_first_reuse"), ("gate-always", "always")]
    );
    let config = m.config().tier_gates.clone();
    assert!(config["gate-default"].backpressure.enabled);
    assert!(!config["gate-always"].backpressure.enabled);
    m.shutdown().unwrap();
}

#[test]
fn promotion_backoff_is_a_control_plane_setting() {
    let d = parse("[primary]\ntype = \"a\"\n").unwrap().manager_config();
    assert_eq!(
        d.promotion_backoff,
        tiering_core::PromotionBackoffConfig::default()
    );
    let c = parse(
        "[primary]\ntype = \"a\"\n[control_plane]\npromotion_backoff = \"250ms\"\npromotion_backoff_max = \"5s\"\n",
    )
    .unwrap();
    let b = c.manager_config().promotion_backoff;
    assert_eq!(b.initial, std::time::Duration::from_millis(250));
    assert_eq!(b.max, std::time::Duration::from_secs(5));
    for (text, line, key) in [
        (
            "[primary]\ntype = \"a\"\n[control_plane]\npromotion_backoff = \"0s\"\n",
            4,
            "promotion_backoff",
        ),
        (
            "[primary]\ntype = \"a\"\n[control_plane]\nthread = false\npromotion_backoff_max = \"often\"\n",
            5,
            "promotion_backoff_max",
        ),
        (
            "[primary]\ntype = \"a\"\n[control_plane]\npromotion_backoff = \"10s\"\npromotion_backoff_max = \"2s\"\n",
            5,
            "promotion_backoff_max",
        ),
    ] {
        let e = parse(text).unwrap_err().to_string();
        assert!(
            e.starts_with(&format!("chain.toml:{line}: [control_plane]: key `{key}`")),
            "{e}"
        );
    }
}

#[test]
fn medium_and_locality_override_a_secondary_tiers_declaration() {
    let c = parse(
        "[primary]\ntype = \"a\"\n[[secondary]]\ntype = \"b\"\nmedium = \"cpu\"\nlocality = \"remote\"\n[[secondary]]\ntype = \"c\"\nlocality = \"LOCAL\"\n[[secondary]]\ntype = \"d\"\n",
    )
    .unwrap();
    let s = &c.secondaries;
    assert_eq!(
        (s[0].medium, s[0].locality),
        (Some(Medium::Cpu), Some(Locality::Remote))
    );
    assert_eq!((s[1].medium, s[1].locality), (None, Some(Locality::Local)));
    assert_eq!((s[2].medium, s[2].locality), (None, None));
    assert!(
        !s[0].options.contains_key("medium"),
        "not passed to the tier's factory"
    );
    for (text, line, key, what) in [
        (
            "[primary]\ntype = \"a\"\n[[secondary]]\ntype = \"b\"\nmedium = \"tape\"\n",
            5,
            "medium",
            "must be \"cpu\" or \"storage\"",
        ),
        (
            "[primary]\ntype = \"a\"\n[[secondary]]\ntype = \"b\"\n\nlocality = 1\n",
            6,
            "locality",
            "must be \"local\" or \"remote\"",
        ),
        (
            "[primary]\ntype = \"a\"\nmedium = \"cpu\"\n",
            3,
            "medium",
            "the primary tier is always CPU and local",
        ),
    ] {
        let e = parse(text).unwrap_err().to_string();
        assert!(e.starts_with(&format!("chain.toml:{line}: ")), "{e}");
        assert!(e.contains(&format!("key `{key}`")) && e.contains(what), "{e}");
    }
}

#[test]
fn a_built_chain_applies_the_overrides_to_lookups_and_filters() {
    use tiering_core::OffloadingManager;
    use tiering_core::{ReqContext, RequestId, TierFilter, TierInfo, TierMatcher};
    let mut m = build(
        "[primary]\ntype = \"chain-test-memory\"\nchunks = 4\n\
         [[secondary]]\ntype = \"chain-test-scripted\"\nname = \"described-a\"\nmedium = \"cpu\"\nlocality = \"remote\"\n\
         [[secondary]]\ntype = \"chain-test-scripted\"\nname = \"described-b\"\n\
         [control_plane]\nthread = false\n",
    )
    .unwrap();
    let infos = m.inspect(|s| s.secondary_infos());
    assert_eq!(
        infos,
        [
            TierInfo::new("described-a", Some(Medium::Cpu), Some(Locality::Remote)),
            TierInfo::new("described-b", Some(Medium::Storage), Some(Locality::Local)),
        ]
    );
    // Both tiers hold the key; a filter on CPU reaches only the overridden one.
    let k = tiering_core::OffloadKey::from_u64(7);
    handle("described-a").insert(k, vec![1; 128]);
    handle("described-b").insert(k, vec![2; 128]);
    let cpu_only = ReqContext::builder(RequestId::local("f"))
        .filter(TierFilter::Matchers(vec![TierMatcher {
            medium: Some(Medium::Cpu),
            locality: None,
        }]))
        .build();
    let mut step = m.step();
    step.on_new_request(&cpu_only).unwrap();
    assert_eq!(
        step.lookup(&k, &cpu_only).unwrap(),
        tiering_core::LookupResult::HitPending
    );
    drop(step);
    assert_eq!(handle("described-a").count("submit_load"), 1);
    assert_eq!(handle("described-b").count("lookup"), 0);
    m.shutdown().unwrap();
}
