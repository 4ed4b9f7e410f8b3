//! Typed options of the p2p tier (the `[[secondary]]` table of a tier chain with `type = "p2p"`).

use std::time::Duration;

use serde::{Deserialize, Serialize};

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
    /// Send high-water mark (messages) of each outbound control socket; a peer whose queue is
    /// full is marked dead instead of blocking.
    pub send_hwm: i32,
    /// ZMTP heartbeats.
    pub heartbeat: Heartbeat,
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
            send_hwm: 1000,
            heartbeat: Heartbeat::default(),
            deadlines: Deadlines::default(),
        }
    }
}

impl P2pTierOptions {
    /// Options binding both planes on 127.0.0.1 with ephemeral ports (tests, benches).
    #[must_use]
    pub fn loopback() -> Self {
        Self {
            bind: "127.0.0.1:0".to_owned(),
            ..Self::default()
        }
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
    fn host_port_split() {
        assert_eq!(split_host_port("127.0.0.1:80"), Some(("127.0.0.1", 80)));
        assert_eq!(split_host_port("h:x"), None);
        assert_eq!(split_host_port(":1"), None);
    }
}
