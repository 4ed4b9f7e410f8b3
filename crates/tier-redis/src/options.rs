//! The Redis tier's options table (`[[secondary]] type = "redis"`) and its checks.

use std::time::Duration;

use serde::Deserialize;
use tiering_core::options::HumanDuration;

use crate::error::RedisTierError;

fn default_name() -> String {
    "redis".to_owned()
}

fn default_namespace() -> String {
    "default".to_owned()
}

const fn default_workers() -> usize {
    4
}

const fn default_max_queued_jobs() -> usize {
    256
}

const fn default_max_lookup_batch() -> usize {
    1024
}

fn ms(n: u64) -> HumanDuration {
    HumanDuration(Duration::from_millis(n))
}

fn default_connect_timeout() -> HumanDuration {
    ms(1000)
}

fn default_io_timeout() -> HumanDuration {
    ms(2000)
}

fn default_lookup_timeout() -> HumanDuration {
    ms(1000)
}

fn default_presence_ttl() -> HumanDuration {
    ms(2000)
}

fn default_backoff_min() -> HumanDuration {
    ms(100)
}

fn default_backoff_max() -> HumanDuration {
    ms(5000)
}

fn default_info_interval() -> HumanDuration {
    ms(5000)
}

const fn default_pipeline_bytes() -> u64 {
    16 << 20
}

/// Options of a [`RedisTier`](crate::RedisTier), as read from its TOML table.
///
/// ```toml
/// [[secondary]]
/// type = "redis"
/// url = "redis://127.0.0.1:6379"      # or urls = ["redis://a:7000", ...] with cluster = true
/// namespace = "llama-3-8b"            # keys: kvtier:<namespace>:<layout>:<key hex>
/// layout_fingerprint = "bf16-tp1"     # model/dtype identity; part of the layout id
/// password_env = "KVTIER_REDIS_PASSWORD"
/// workers = 4
/// io_timeout = "2s"
/// ```
#[derive(Clone, Debug, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RedisTierOptions {
    /// One server (`redis://host:port[/db]`, or `rediss://` with the `tls` feature).
    #[serde(default)]
    pub url: Option<String>,
    /// Several seed servers (cluster mode), or one. Exactly one of `url` and `urls` is set.
    #[serde(default)]
    pub urls: Vec<String>,
    /// Talk to a Redis Cluster (slot routing, redirections) instead of one server.
    #[serde(default)]
    pub cluster: bool,
    /// Separates caches sharing a server (two models, two deployments): letters, digits, `_`,
    /// `-` and `.`.
    #[serde(default = "default_namespace")]
    pub namespace: String,
    /// The identity of the KV layout beyond the chunk size (model, dtype, parallelism); chunks
    /// of different fingerprints never mix.
    #[serde(default)]
    pub layout_fingerprint: String,
    /// The name of an environment variable holding the password (never the password itself).
    #[serde(default)]
    pub password_env: Option<String>,
    /// The ACL user name (with `password_env`).
    #[serde(default)]
    pub username: Option<String>,
    /// Worker threads, each with its own connection (1 to 64).
    #[serde(default = "default_workers")]
    pub workers: usize,
    /// Store and load jobs queued per worker before new ones are refused (failed at once,
    /// counted); the queue counts batches, and a job takes one per worker it is spread over.
    #[serde(default = "default_max_queued_jobs")]
    pub max_queued_jobs: usize,
    /// Presence checks sent in one pipelined `EXISTS` batch.
    #[serde(default = "default_max_lookup_batch")]
    pub max_lookup_batch: usize,
    /// Most value bytes per pipelined round trip. A job is spread over the workers (one batch
    /// each, none smaller than 512 KiB) and never sends more than this in one batch.
    #[serde(default = "default_pipeline_bytes")]
    pub pipeline_bytes: u64,
    /// Connecting to a server gives up after this long.
    #[serde(default = "default_connect_timeout")]
    pub connect_timeout: HumanDuration,
    /// A read or write on an open connection gives up after this long.
    #[serde(default = "default_io_timeout")]
    pub io_timeout: HumanDuration,
    /// A lookup still unanswered after this long is a `Miss` (so a slow server cannot keep the
    /// scheduler retrying).
    #[serde(default = "default_lookup_timeout")]
    pub lookup_timeout: HumanDuration,
    /// How long a presence answer is reused before the server is asked again.
    #[serde(default = "default_presence_ttl")]
    pub presence_ttl: HumanDuration,
    /// The first reconnection delay after a failure; doubles up to `reconnect_backoff_max`.
    #[serde(default = "default_backoff_min")]
    pub reconnect_backoff: HumanDuration,
    /// The longest reconnection delay.
    #[serde(default = "default_backoff_max")]
    pub reconnect_backoff_max: HumanDuration,
    /// How often the server's `INFO` (memory, evictions) is refreshed for the stats.
    #[serde(default = "default_info_interval")]
    pub info_interval: HumanDuration,
    /// The tier's name in stats, events and logs.
    #[serde(default = "default_name")]
    pub name: String,
}

impl RedisTierOptions {
    /// Options with defaults for everything but the server.
    #[must_use]
    pub fn new(url: impl Into<String>) -> Self {
        Self {
            url: Some(url.into()),
            urls: Vec::new(),
            cluster: false,
            namespace: default_namespace(),
            layout_fingerprint: String::new(),
            password_env: None,
            username: None,
            workers: default_workers(),
            max_queued_jobs: default_max_queued_jobs(),
            max_lookup_batch: default_max_lookup_batch(),
            pipeline_bytes: default_pipeline_bytes(),
            connect_timeout: default_connect_timeout(),
            io_timeout: default_io_timeout(),
            lookup_timeout: default_lookup_timeout(),
            presence_ttl: default_presence_ttl(),
            reconnect_backoff: default_backoff_min(),
            reconnect_backoff_max: default_backoff_max(),
            info_interval: default_info_interval(),
            name: default_name(),
        }
    }

    /// Options for a cluster reached through `urls`.
    #[must_use]
    pub fn cluster(urls: Vec<String>) -> Self {
        Self {
            url: None,
            urls,
            cluster: true,
            ..Self::new(String::new())
        }
    }

    /// The server URLs, from `url` or `urls`.
    ///
    /// # Errors
    /// Neither or both are set, or `urls` is empty.
    pub fn server_urls(&self) -> Result<Vec<String>, RedisTierError> {
        match (&self.url, self.urls.is_empty()) {
            (Some(_), false) => Err(invalid("`urls`: set either `url` or `urls`, not both")),
            (Some(u), true) => Ok(vec![u.clone()]),
            (None, false) => Ok(self.urls.clone()),
            (None, true) => Err(invalid("`url`: missing; set `url` (or `urls` for a cluster)")),
        }
    }

    /// The password named by `password_env`, if any.
    ///
    /// # Errors
    /// The variable is not set.
    pub fn password(&self) -> Result<Option<String>, RedisTierError> {
        let Some(var) = &self.password_env else {
            return Ok(None);
        };
        match std::env::var(var) {
            Ok(p) => Ok(Some(p)),
            Err(_) => Err(RedisTierError::MissingPassword { var: var.clone() }),
        }
    }

    /// Checks ranges and names (not the URLs: connecting checks those).
    ///
    /// # Errors
    /// The first invalid option, named in backquotes.
    pub fn validate(&self) -> Result<(), RedisTierError> {
        let urls = self.server_urls()?;
        if !self.cluster && urls.len() > 1 {
            return Err(invalid(
                "`urls`: several servers need `cluster = true` (sharding across standalone servers is not supported)",
            ));
        }
        validate_namespace(&self.namespace)?;
        if !(1..=64).contains(&self.workers) {
            return Err(invalid(&format!(
                "`workers`: must be between 1 and 64, not {}",
                self.workers
            )));
        }
        if self.max_queued_jobs == 0 {
            return Err(invalid("`max_queued_jobs`: must be at least 1"));
        }
        if self.max_lookup_batch == 0 {
            return Err(invalid("`max_lookup_batch`: must be at least 1"));
        }
        if self.pipeline_bytes == 0 {
            return Err(invalid("`pipeline_bytes`: must be at least 1 byte"));
        }
        for (key, d) in [
            ("connect_timeout", self.connect_timeout),
            ("io_timeout", self.io_timeout),
            ("lookup_timeout", self.lookup_timeout),
            ("reconnect_backoff", self.reconnect_backoff),
            ("reconnect_backoff_max", self.reconnect_backoff_max),
        ] {
            if d.get().is_zero() {
                return Err(invalid(&format!("`{key}`: must be greater than zero")));
            }
        }
        if self.name.is_empty() {
            return Err(invalid("`name`: must not be empty"));
        }
        if matches!(&self.password_env, Some(v) if v.is_empty()) {
            return Err(invalid("`password_env`: must name an environment variable"));
        }
        Ok(())
    }
}

/// Checks that `namespace` is usable in a key and as a `SCAN` pattern without escaping.
///
/// # Errors
/// Empty, or a character other than letters, digits, `_`, `-` and `.`.
pub fn validate_namespace(namespace: &str) -> Result<(), RedisTierError> {
    let ok = !namespace.is_empty()
        && namespace.len() <= 128
        && namespace
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'_' | b'-' | b'.'));
    if ok {
        Ok(())
    } else {
        Err(invalid(&format!(
            "`namespace`: `{namespace}` must be 1 to 128 letters, digits, `_`, `-` or `.`"
        )))
    }
}

fn invalid(message: &str) -> RedisTierError {
    RedisTierError::InvalidOptions(message.to_owned())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(s: &str) -> RedisTierOptions {
        toml::from_str(s).unwrap()
    }

    #[test]
    fn defaults_and_a_full_table() {
        let o = parse("url = \"redis://127.0.0.1:6379\"");
        assert_eq!(o, RedisTierOptions::new("redis://127.0.0.1:6379"));
        o.validate().unwrap();
        let o = parse(
            r#"
            urls = ["redis://a:7000", "redis://b:7001"]
            cluster = true
            namespace = "llama.3-8b_v2"
            layout_fingerprint = "bf16"
            password_env = "PW"
            workers = 8
            io_timeout = "250ms"
            "#,
        );
        o.validate().unwrap();
        assert_eq!(o.server_urls().unwrap().len(), 2);
        assert_eq!(o.io_timeout.get(), Duration::from_millis(250));
        assert_eq!(o.workers, 8);
    }

    #[test]
    fn invalid_tables_are_refused_naming_the_key() {
        let err = |s: &str| parse(s).validate().unwrap_err().to_string();
        assert!(err("namespace = \"x\"").contains("`url`"));
        assert!(err("url = \"redis://a\"\nurls = [\"redis://b\"]").contains("`urls`"));
        assert!(err("urls = [\"redis://a\", \"redis://b\"]").contains("cluster = true"));
        assert!(err("url = \"redis://a\"\nnamespace = \"a:b\"").contains("`namespace`"));
        assert!(err("url = \"redis://a\"\nnamespace = \"*\"").contains("`namespace`"));
        assert!(err("url = \"redis://a\"\nworkers = 0").contains("`workers`"));
        assert!(err("url = \"redis://a\"\nio_timeout = \"0s\"").contains("`io_timeout`"));
        assert!(toml::from_str::<RedisTierOptions>("url = \"redis://a\"\npassword = \"x\"").is_err());
    }

    #[test]
    fn a_missing_password_variable_is_named() {
        let mut o = RedisTierOptions::new("redis://a");
        o.password_env = Some("KVTIER_TEST_SURELY_UNSET_VARIABLE".into());
        let e = o.password().unwrap_err().to_string();
        assert!(e.contains("KVTIER_TEST_SURELY_UNSET_VARIABLE"), "{e}");
        assert!(e.contains("`password_env`"), "{e}");
    }
}
