//! The chain keys that gate cascades to a secondary tier: `admission` and `backpressure`
//! (`docs/ARCHITECTURE.md`, "Admission and backpressure").
//!
//! ```toml
//! [[secondary]]
//! type = "disk"
//! admission = "tinylfu"                                  # a policy with its defaults, or
//! # admission = { policy = "store_threshold", n = 2 }    # a policy with options
//! backpressure = { high_water_per_mib = "200ms", low_water_per_mib = "100ms" }
//! # backpressure = false                                 # never drop cascades
//! ```

use std::time::Duration;

use super::error::ChainErrorKind;
use tiering_core::admission::{AdmissionConfig, BackpressureConfig};
use tiering_core::options::HumanDuration;

const BACKPRESSURE_KEYS: &str =
    "enabled, alpha, high_water_per_mib, low_water_per_mib, warmup, probe_interval";

/// The `admission` value: a policy name, or a table with `policy` and the policy's options.
pub(crate) fn admission(value: toml::Value) -> Result<AdmissionConfig, ChainErrorKind> {
    let invalid = |m: String| ChainErrorKind::Invalid(m);
    match value {
        toml::Value::String(policy) => {
            AdmissionConfig::new(&policy, toml::Table::new()).map_err(|e| invalid(e.to_string()))
        }
        toml::Value::Table(mut options) => {
            let policy = match options.remove("policy") {
                Some(toml::Value::String(p)) => p,
                Some(other) => {
                    return Err(invalid(format!("`policy` must be a policy name, found {other}")));
                }
                None => {
                    return Err(invalid(
                        "an `admission` table names its policy: `policy = \"store_threshold\"`".into(),
                    ));
                }
            };
            AdmissionConfig::new(&policy, options).map_err(|e| invalid(e.to_string()))
        }
        other => Err(invalid(format!(
            "`admission` must be a policy name or a table with `policy`, found {}",
            other.type_str()
        ))),
    }
}

/// The `backpressure` value: `true`/`false`, or a table of settings.
pub(crate) fn backpressure(value: toml::Value) -> Result<BackpressureConfig, ChainErrorKind> {
    let invalid = |m: String| ChainErrorKind::Invalid(m);
    let table = match value {
        toml::Value::Boolean(true) => return Ok(BackpressureConfig::default()),
        toml::Value::Boolean(false) => return Ok(BackpressureConfig::disabled()),
        toml::Value::Table(t) => t,
        other => {
            return Err(invalid(format!(
                "`backpressure` must be true, false or a table, found {}",
                other.type_str()
            )));
        }
    };
    let mut config = BackpressureConfig::default();
    for (key, v) in table {
        let duration = |v: &toml::Value| -> Result<Duration, ChainErrorKind> {
            match v {
                toml::Value::String(s) => s
                    .parse::<HumanDuration>()
                    .map(HumanDuration::get)
                    .map_err(|e| invalid(format!("`{key}`: {e}"))),
                other => Err(invalid(format!(
                    "`{key}` must be a duration like \"500ms\", found {}",
                    other.type_str()
                ))),
            }
        };
        match key.as_str() {
            "enabled" => {
                config.enabled = v
                    .as_bool()
                    .ok_or_else(|| invalid("`enabled` must be true or false".into()))?;
            }
            "alpha" => {
                #[allow(clippy::cast_precision_loss)]
                let a = match v {
                    toml::Value::Float(f) => f,
                    toml::Value::Integer(i) => i as f64,
                    other => {
                        return Err(invalid(format!(
                            "`alpha` must be a number, found {}",
                            other.type_str()
                        )));
                    }
                };
                config.alpha = a;
            }
            "high_water_per_mib" => config.high_water_per_mib = duration(&v)?,
            "low_water_per_mib" => config.low_water_per_mib = duration(&v)?,
            "probe_interval" => config.probe_interval = duration(&v)?,
            "warmup" => {
                config.warmup = v
                    .as_integer()
                    .and_then(|n| u32::try_from(n).ok())
                    .ok_or_else(|| invalid(format!("`warmup` must be a count of samples, found {v}")))?;
            }
            other => {
                return Err(ChainErrorKind::UnknownKey {
                    key: other.to_owned(),
                    expected: BACKPRESSURE_KEYS,
                });
            }
        }
    }
    config.validate().map_err(invalid)?;
    Ok(config)
}
