//! Typed options of the p2p tier (the `[[secondary]]` table of a tier chain with `type = "p2p"`).

use std::time::Duration;

use serde::{Deserialize, Serialize};

use crate::auth::SharedSecret;
use crate::error::P2pError;

/// Deadlines of the protocol, in milliseconds (all configurable).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct Deadlines {
    /// A session that has not finished its handshake (connect, registration, ack) by then dies.
    pub handshake_ms: u64,
    /// A consumer lookup that the producer has not answered by then falls back to `Miss`.
    pub lookup_ms: u64,
    /// A producer-side key still pending (write in flight, promotion) by then is answered `Miss`.
    pub straggler_ms: u64,
    /// A consumer fetch not completed by then is aborted. On the producer, also the longest a
    /// hand-off fetch (`remote_prefiller`) waits, from its arrival, for chunks not stored yet;
    /// keys still missing then fail and the rest are reported per key.
    pub load_ms: u64,
    /// An aborted fetch whose `abort_ack` has not come by then is torn down (the data connection
    /// is closed first, so the rows are quiescent before they are released).
    pub abort_ms: u64,
    /// Producer-side chunks pinned for a consumer (answered in a lookup, or parked for a
    /// `remote_decoder` request) that no fetch binds by then are released.
    pub unbound_park_ms: u64,
    /// Socket read/write timeout of the data plane.
    pub data_io_ms: u64,
    /// How long `shutdown` and `drain_jobs` wait for transfers to become quiescent.
    pub drain_ms: u64,
}

impl Default for Deadlines {
    fn default() -> Self {
        Self {
            handshake_ms: 10_000,
            lookup_ms: 8_000,
            straggler_ms: 5_000,
            load_ms: 30_000,
            abort_ms: 10_000,
            unbound_park_ms: 60_000,
            data_io_ms: 30_000,
            drain_ms: 3_000,
        }
    }
}

impl Deadlines {
    /// `handshake_ms` as a duration.
    #[must_use]
    pub fn handshake(&self) -> Duration {
        Duration::from_millis(self.handshake_ms)
    }
    /// `lookup_ms` as a duration.
    #[must_use]
    pub fn lookup(&self) -> Duration {
        Duration::from_millis(self.lookup_ms)
    }
    /// `straggler_ms` as a duration.
    #[must_use]
    pub fn straggler(&self) -> Duration {
        Duration::from_millis(self.straggler_ms)
    }
    /// `load_ms` as a duration.
    #[must_use]
    pub fn load(&self) -> Duration {
        Duration::from_millis(self.load_ms)
    }
    /// `abort_ms` as a duration.
    #[must_use]
    pub fn abort(&self) -> Duration {
        Duration::from_millis(self.abort_ms)
    }
    /// `unbound_park_ms` as a duration.
    #[must_use]
    pub fn unbound_park(&self) -> Duration {
        Duration::from_millis(self.unbound_park_ms)
    }
    /// `data_io_ms` as a duration.
    #[must_use]
    pub fn data_io(&self) -> Duration {
        Duration::from_millis(self.data_io_ms)
    }
    /// `drain_ms` as a duration.
    #[must_use]
    pub fn drain(&self) -> Duration {
        Duration::from_millis(self.drain_ms)
    }
}

/// ZMTP heartbeat settings of every control socket, in milliseconds.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct Heartbeat {
    /// Interval between heartbeats.
    pub interval_ms: u32,
    /// How long without traffic before the connection is declared dead.
    pub timeout_ms: u32,
    /// The time-to-live the remote side is told to use.
    pub ttl_ms: u32,
}

impl Default for Heartbeat {
    fn default() -> Self {
        Self {
            interval_ms: 2_000,
            timeout_ms: 10_000,
            ttl_ms: 10_000,
        }
    }
}

/// Limits on what peers can make this node receive and hold.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct Inbound {
    /// Largest control message accepted (ZeroMQ `maxmsgsize`): libzmq drops the connection of
    /// a peer that announces a larger one, before allocating it.
    pub max_message_bytes: i64,
    /// Control messages of one peer decoded but not handled yet. A peer past it is flooding:
    /// its messages are dropped, its session is closed and counted, and it is ignored for
    /// `flood_ban_ms`. Other peers are unaffected.
    pub per_peer_budget: u32,
    /// Decoded control messages of all peers waiting to be handled (read by the I/O thread
    /// while the manager lock was held). When full, the I/O thread stops reading (the socket's
    /// receive high-water mark then pushes back on the senders). Also the most messages one
    /// pump reads straight from the socket.
    pub queue_capacity: usize,
    /// How long a flooding peer is ignored.
    pub flood_ban_ms: u64,
}

impl Default for Inbound {
    fn default() -> Self {
        Self {
            max_message_bytes: 16 << 20,
            per_peer_budget: 4096,
            queue_capacity: 16_384,
            flood_ban_ms: 10_000,
        }
    }
}

/// Options of a [`P2pTier`](crate::P2pTier).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct P2pTierOptions {
    /// Tier name in stats and logs.
    pub name: String,
    /// Control-plane bind address `host:port`; port 0 picks an ephemeral port.
    pub bind: String,
    /// The host other peers dial (the node's identity is `advertise:port`); defaults to the
    /// bind host. Must be routable and identical to what peers put in their requests.
    pub advertise: Option<String>,
    /// Data-plane (TCP) bind address `host:port`; port 0 picks an ephemeral port. Defaults to
    /// the control bind host with an ephemeral port.
    pub data_bind: Option<String>,
    /// Peers to connect to at start (`host:port` of their control sockets). Peers not listed
    /// here are reached on demand, from request parameters.
    pub peers: Vec<String>,
    /// Must be equal on every peer: block hashes chain from it, so a mismatch would make every
    /// lookup miss silently. Checked at handshake.
    pub hash_seed: String,
    /// Fingerprint of the KV layout (model, dtype, block geometry); must be equal on every
    /// peer. Checked at handshake (strictly: an empty value only matches an empty value).
    pub layout_fingerprint: String,
    /// The name of an environment variable holding the deployment's shared secret (for
    /// example `"KVTIER_P2P_SECRET"`). Peers must share it: it authenticates the handshake and
    /// keys the data plane's MACs. Without it the tier refuses to start unless `insecure`.
    pub secret_env: Option<String>,
    /// Run without a shared secret (a well-known key every insecure node shares): anyone who
    /// can reach the sockets can push chunks into reserved rows. Loopback demos and tests only.
    pub insecure: bool,
    /// The shared secret given programmatically (never read from or written to a chain file);
    /// takes precedence over `secret_env`.
    #[serde(skip)]
    pub secret: Option<SharedSecret>,
    /// Send high-water mark (messages) of each outbound control socket; a peer whose queue is
    /// full is marked dead instead of blocking.
    pub send_hwm: i32,
    /// ZMTP heartbeats.
    pub heartbeat: Heartbeat,
    /// Inbound limits (message size, per-peer budget, queue).
    pub inbound: Inbound,
    /// Protocol deadlines.
    pub deadlines: Deadlines,
}

impl Default for P2pTierOptions {
    fn default() -> Self {
        Self {
            name: "p2p".to_owned(),
            bind: "127.0.0.1:5710".to_owned(),
            advertise: None,
            data_bind: None,
            peers: Vec::new(),
            hash_seed: String::new(),
            layout_fingerprint: String::new(),
            secret_env: None,
            insecure: false,
            secret: None,
            send_hwm: 1000,
            heartbeat: Heartbeat::default(),
            inbound: Inbound::default(),
            deadlines: Deadlines::default(),
        }
    }
}

impl P2pTierOptions {
    /// Options binding both planes on 127.0.0.1 with ephemeral ports, for tests and benches:
    /// `insecure` is set (give a `secret` to test authentication); `hash_seed` and
    /// `layout_fingerprint` are still empty and must be filled.
    #[must_use]
    pub fn loopback() -> Self {
        Self {
            bind: "127.0.0.1:0".to_owned(),
            insecure: true,
            ..Self::default()
        }
    }

    /// The shared secret the tier runs with: `secret`, else the variable named by
    /// `secret_env`, else the insecure key if `insecure` is set.
    ///
    /// # Errors
    /// No secret and not `insecure`; `secret_env` names a variable that is unset or empty.
    pub fn resolve_secret(&self) -> Result<SharedSecret, P2pError> {
        if let Some(s) = &self.secret {
            return Ok(s.clone());
        }
        if let Some(var) = &self.secret_env {
            return match std::env::var_os(var) {
                Some(v) if !v.is_empty() => Ok(SharedSecret::new(v.as_encoded_bytes())),
                _ => Err(P2pError::Config(format!(
                    "secret_env = {var:?}: that environment variable is unset or empty; \
                     every peer needs the same shared secret in it"
                ))),
            };
        }
        if self.insecure {
            tracing::warn!(
                tier = %self.name,
                "p2p tier running with insecure = true: peers and data are not authenticated"
            );
            return Ok(SharedSecret::insecure());
        }
        Err(P2pError::Config(
            "a p2p tier needs a shared secret: set secret_env = \"KVTIER_P2P_SECRET\" (the name of an \
             environment variable holding it), or insecure = true for a loopback demo"
                .into(),
        ))
    }

    /// Checks what the handshake relies on: a non-empty `hash_seed` and `layout_fingerprint`
    /// (an empty value would match another misconfigured node's empty value).
    ///
    /// # Errors
    /// The first empty one, by its key.
    pub fn check_identity(&self) -> Result<(), P2pError> {
        for (key, v) in [
            ("hash_seed", &self.hash_seed),
            ("layout_fingerprint", &self.layout_fingerprint),
        ] {
            if v.trim().is_empty() {
                return Err(P2pError::Config(format!(
                    "{key} is empty; set it to the same non-empty value on every peer"
                )));
            }
        }
        Ok(())
    }
}

/// Splits `host:port` (the port must be numeric).
pub(crate) fn split_host_port(addr: &str) -> Option<(&str, u16)> {
    let (host, port) = addr.rsplit_once(':')?;
    let port = port.parse().ok()?;
    (!host.is_empty()).then_some((host, port))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn unknown_fields_are_rejected_and_defaults_fill_the_rest() {
        let o: P2pTierOptions =
            serde_json::from_str(r#"{"bind":"127.0.0.1:0","deadlines":{"lookup_ms":5}}"#).unwrap();
        assert_eq!(o.deadlines.lookup(), Duration::from_millis(5));
        assert_eq!(o.deadlines.load_ms, 30_000);
        assert!(serde_json::from_str::<P2pTierOptions>(r#"{"bnd":"x"}"#).is_err());
        assert!(serde_json::from_str::<P2pTierOptions>(r#"{"deadlines":{"lookup":5}}"#).is_err());
    }

    #[test]
    fn a_secret_is_required_unless_insecure_is_explicit() {
        let mut o = P2pTierOptions::default();
        let e = o.resolve_secret().unwrap_err().to_string();
        assert!(e.contains("secret_env") && e.contains("insecure"), "{e}");
        o.secret_env = Some("KVTIER_P2P_TEST_SURELY_UNSET_VARIABLE".into());
        let e = o.resolve_secret().unwrap_err().to_string();
        assert!(e.contains("KVTIER_P2P_TEST_SURELY_UNSET_VARIABLE"), "{e}");
        // PATH is set in any test environment: its value serves as a secret here.
        o.secret_env = Some("PATH".into());
        assert!(!o.resolve_secret().unwrap().is_insecure());
        o.secret_env = None;
        o.insecure = true;
        assert!(o.resolve_secret().unwrap().is_insecure());
        o.secret = Some(SharedSecret::new(b"x"));
        assert_eq!(o.resolve_secret().unwrap(), SharedSecret::new(b"x"));
        let parsed: P2pTierOptions =
            serde_json::from_str(r#"{"secret_env":"KVTIER_P2P_SECRET","insecure":false}"#).unwrap();
        assert_eq!(parsed.secret_env.as_deref(), Some("KVTIER_P2P_SECRET"));
        assert!(serde_json::from_str::<P2pTierOptions>(r#"{"secret":"inline"}"#).is_err());
    }

    #[test]
    fn empty_seed_or_fingerprint_is_refused_by_key() {
        let mut o = P2pTierOptions::loopback();
        assert!(o.check_identity().unwrap_err().to_string().contains("hash_seed"));
        o.hash_seed = "s".into();
        assert!(
            o.check_identity()
                .unwrap_err()
                .to_string()
                .contains("layout_fingerprint")
        );
        o.layout_fingerprint = "f".into();
        o.check_identity().unwrap();
    }

    #[test]
    fn host_port_split() {
        assert_eq!(split_host_port("127.0.0.1:80"), Some(("127.0.0.1", 80)));
        assert_eq!(split_host_port("h:x"), None);
        assert_eq!(split_host_port(":1"), None);
    }
}
