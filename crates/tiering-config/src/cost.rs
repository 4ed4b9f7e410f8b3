//! The `[cost]` section of a chain file: the engine's recompute cost and how long a promotion
//! may keep a request waiting (`docs/ARCHITECTURE.md`, "Cost model").
//!
//! ```toml
//! [cost]
//! recompute_per_token = "250ns"   # model time to prefill one token
//! tokens_per_chunk = 16           # tokens one chunk holds
//! deadline_slack = 2.0            # a promotion's deadline: expected completion × this
//! deadline_floor = "1ms"          # … but never sooner than this
//! ema_weight = 0.2                # weight of a new sample in each tier's measured cost
//! probe_interval = "1s"           # re-measure a tier whose hits are all declined ("0s": never)
//! ```
//!
//! Without `recompute_per_token` every secondary hit is promoted and waited for, as if the
//! section were absent.

use std::ops::Range;
use std::time::Duration;

use toml::de::DeTable;

use super::error::{ChainError, ChainErrorKind};
use tiering_core::options::HumanDuration;
use tiering_core::{CostConfig, RecomputeCost};

const KEYS: &str =
    "recompute_per_token, tokens_per_chunk, deadline_slack, deadline_floor, ema_weight, probe_interval";

/// Parses the `[cost]` table; `line_of` maps a key's span to its line.
pub(super) fn parse(
    source: &str,
    line_of: &dyn Fn(&Range<usize>) -> usize,
    header_line: usize,
    table: &DeTable<'_>,
) -> Result<CostConfig, ChainError> {
    let mut cfg = CostConfig::default();
    let mut per_token: Option<Duration> = None;
    let mut tokens: Option<u32> = None;
    for (key, value) in table {
        let name = key.get_ref().to_string();
        let err = |reason: String| {
            ChainError::file(source, ChainErrorKind::Invalid(reason))
                .at_line(Some(line_of(&key.span())))
                .in_tier("[cost]")
                .with_key(&name)
        };
        let v = super::spanned::to_value(value).map_err(&err)?;
        let number = |v: &toml::Value| -> Result<f64, ChainError> {
            match v {
                toml::Value::Float(f) => Ok(*f),
                #[allow(clippy::cast_precision_loss)] // small settings
                toml::Value::Integer(i) => Ok(*i as f64),
                other => Err(err(format!(
                    "`{name}` must be a number, found {}",
                    other.type_str()
                ))),
            }
        };
        let duration = |v: &toml::Value| -> Result<Duration, ChainError> {
            match v {
                toml::Value::String(s) => s
                    .parse::<HumanDuration>()
                    .map(HumanDuration::get)
                    .map_err(|e| err(e.to_string())),
                other => Err(err(format!(
                    "expected a duration like \"250ns\", found {}",
                    other.type_str()
                ))),
            }
        };
        match name.as_str() {
            "recompute_per_token" => per_token = Some(duration(&v)?),
            "tokens_per_chunk" => {
                tokens = Some(match v {
                    toml::Value::Integer(n) if n >= 1 => {
                        u32::try_from(n).map_err(|_| err(format!("{n} is too large")))?
                    }
                    other => {
                        return Err(err(format!(
                            "`tokens_per_chunk` must be an integer of at least 1, found {other}"
                        )));
                    }
                });
            }
            "deadline_slack" => cfg.deadline_slack = number(&v)?,
            "deadline_floor" => cfg.deadline_floor = duration(&v)?,
            "ema_weight" => cfg.ema_weight = number(&v)?,
            "probe_interval" => cfg.probe_interval = duration(&v)?,
            other => {
                return Err(ChainError::file(
                    source,
                    ChainErrorKind::UnknownKey {
                        key: other.to_owned(),
                        expected: KEYS,
                    },
                )
                .at_line(Some(line_of(&key.span())))
                .in_tier("[cost]")
                .with_key(other));
            }
        }
    }
    let section_err = |reason: String| {
        ChainError::file(source, ChainErrorKind::Invalid(reason))
            .at_line(Some(header_line))
            .in_tier("[cost]")
    };
    cfg.recompute = match (per_token, tokens) {
        (Some(p), Some(t)) => Some(RecomputeCost::new(p, t)),
        (None, None) => None,
        _ => {
            return Err(section_err(
                "`recompute_per_token` and `tokens_per_chunk` go together: give both or neither".into(),
            ));
        }
    };
    cfg.validate().map_err(section_err)?;
    Ok(cfg)
}

#[cfg(test)]
mod tests {
    use crate::ChainConfig;

    fn parse(text: &str) -> Result<ChainConfig, String> {
        ChainConfig::parse("chain.toml", text).map_err(|e| e.to_string())
    }

    #[test]
    fn the_cost_section_sets_the_managers_recompute_cost() {
        let c = parse(
            "[primary]\ntype = \"a\"\n[cost]\nrecompute_per_token = \"250ns\"\ntokens_per_chunk = 16\n\
             deadline_slack = 3\ndeadline_floor = \"2ms\"\nprobe_interval = \"0s\"\n",
        )
        .unwrap();
        let r = c.cost.recompute.unwrap();
        assert_eq!(r.per_chunk(), std::time::Duration::from_micros(4));
        assert!((c.cost.deadline_slack - 3.0).abs() < f64::EPSILON);
        assert_eq!(c.cost.deadline_floor, std::time::Duration::from_millis(2));
        assert!(c.cost.probe_interval.is_zero());
        assert_eq!(c.manager_config().cost, c.cost);
    }

    #[test]
    fn no_cost_section_means_no_recompute_cost() {
        let c = parse("[primary]\ntype = \"a\"\n").unwrap();
        assert_eq!(c.cost, tiering_core::CostConfig::default());
        assert!(c.manager_config().cost.recompute.is_none());
    }

    #[test]
    fn bad_cost_values_name_the_key_and_line() {
        let e =
            parse("[primary]\ntype = \"a\"\n[cost]\nrecompute_per_token = \"fast\"\ntokens_per_chunk = 16\n")
                .unwrap_err();
        assert!(
            e.starts_with("chain.toml:4: [cost]: key `recompute_per_token`"),
            "{e}"
        );
        let e = parse("[primary]\ntype = \"a\"\n[cost]\ntokens_per_chunk = 0\n").unwrap_err();
        assert!(e.contains("tokens_per_chunk"), "{e}");
        let e = parse("[primary]\ntype = \"a\"\n[cost]\ntokens_per_chunk = 16\n").unwrap_err();
        assert!(e.contains("go together"), "{e}");
        let e = parse("[primary]\ntype = \"a\"\n[cost]\ndeadline_slack = 0.5\n").unwrap_err();
        assert!(e.contains("deadline_slack"), "{e}");
        let e = parse("[primary]\ntype = \"a\"\n[cost]\nslack = 2\n").unwrap_err();
        assert!(e.contains("unknown key") && e.contains("deadline_slack"), "{e}");
    }
}
