//! Checks a chain against the outside world before a run: can every peer a `p2p` tier is told
//! to dial be reached?
//!
//! Peers come and go, and a running engine treats a dead peer as a miss, so by default a peer
//! that cannot be reached at start is a warning and the run proceeds with that peer down (the
//! p2p tier keeps dialling it). A refused port, a black-holed address (no answer within
//! [`PEER_CONNECT_TIMEOUT`]) and a name that does not resolve are all treated alike.
//! `kvtier run --require-peers` turns each of them into an error that aborts the start. A
//! `peers` entry that is not a `host:port` string is a chain error either way.

use std::net::{TcpStream, ToSocketAddrs};
use std::time::Duration;

use tiering_config::ChainConfig;

use super::error::SimError;

/// How long one peer gets to accept a connection.
pub const PEER_CONNECT_TIMEOUT: Duration = Duration::from_secs(2);

/// A configured peer that did not accept a connection at start.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DownPeer {
    /// File, line, tier and key of the `peers` entry.
    pub location: String,
    /// The peer as written.
    pub peer: String,
    /// Why it is down: refused, timed out, does not resolve.
    pub reason: String,
}

impl std::fmt::Display for DownPeer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "{}: peer {} is down at start ({}); the run proceeds and counts it as a miss until it \
             answers (--require-peers makes this an error)",
            self.location, self.peer, self.reason
        )
    }
}

impl From<DownPeer> for SimError {
    fn from(d: DownPeer) -> Self {
        Self::UnreachablePeer {
            location: d.location,
            peer: d.peer,
            reason: d.reason,
        }
    }
}

/// Dials every configured peer once (each address it resolves to, `timeout` each) and returns
/// those that did not accept a connection.
///
/// # Errors
/// A `peers` entry that is not a `host:port` string; with `require`, the first peer that is
/// down (named with file, line and tier).
pub fn check_peers(chain: &ChainConfig, timeout: Duration, require: bool) -> Result<Vec<DownPeer>, SimError> {
    let mut down = Vec::new();
    for spec in chain.secondaries.iter().filter(|s| s.tier_type == "p2p") {
        let Some(peers) = spec.options.get("peers").and_then(toml::Value::as_array) else {
            continue;
        };
        let line = spec.key_line("peers").unwrap_or(spec.line);
        let location = format!("{}:{line}: {}: key `peers`", chain.source, spec.describe());
        for peer in peers {
            let Some(peer) = peer.as_str().filter(|p| has_port(p)) else {
                return Err(SimError::InvalidPeer {
                    location,
                    peer: peer.to_string(),
                });
            };
            if let Err(reason) = dial(peer, timeout) {
                let d = DownPeer {
                    location: location.clone(),
                    peer: peer.to_owned(),
                    reason,
                };
                if require {
                    return Err(d.into());
                }
                down.push(d);
            }
        }
    }
    Ok(down)
}

fn has_port(peer: &str) -> bool {
    peer.rsplit_once(':')
        .is_some_and(|(h, p)| !h.is_empty() && p.parse::<u16>().is_ok())
}

fn dial(peer: &str, timeout: Duration) -> Result<(), String> {
    let addrs: Vec<_> = peer
        .to_socket_addrs()
        .map_err(|e| format!("cannot resolve it: {e}"))?
        .collect();
    let mut last = String::from("it resolves to no address");
    for a in &addrs {
        match TcpStream::connect_timeout(a, timeout) {
            Ok(_) => return Ok(()),
            Err(e) => last = e.to_string(),
        }
    }
    Err(last)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn chain(peers: &str) -> ChainConfig {
        let text = format!(
            "[primary]\ntype = \"cpu\"\ncapacity = \"1MiB\"\n\n[[secondary]]\ntype = \"p2p\"\npeers = {peers}\nhash_seed = \"t\"\nlayout_fingerprint = \"t\"\ninsecure = true\n"
        );
        ChainConfig::parse("peers.toml", &text).unwrap()
    }

    #[test]
    fn a_listening_peer_passes_and_a_closed_port_is_down_or_an_error_when_required() {
        let live = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let closed = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let closed_addr = closed.local_addr().unwrap();
        drop(closed);
        let ok = chain(&format!("[\"{}\"]", live.local_addr().unwrap()));
        assert!(check_peers(&ok, PEER_CONNECT_TIMEOUT, true).unwrap().is_empty());
        let bad = chain(&format!(
            "[\"{}\", \"{closed_addr}\"]",
            live.local_addr().unwrap()
        ));
        let down = check_peers(&bad, PEER_CONNECT_TIMEOUT, false).unwrap();
        assert_eq!(down.len(), 1);
        assert_eq!(down[0].peer, closed_addr.to_string());
        let warning = down[0].to_string();
        assert!(
            warning.contains("peers.toml:7") && warning.contains("proceeds"),
            "{warning}"
        );
        let err = check_peers(&bad, PEER_CONNECT_TIMEOUT, true)
            .unwrap_err()
            .to_string();
        assert!(err.contains(&closed_addr.to_string()), "{err}");
        assert!(err.contains("peers.toml:7"), "{err}");
        assert!(err.contains("unreachable"), "{err}");
    }

    #[test]
    fn malformed_peer_entries_are_errors_and_unresolvable_names_are_down() {
        for entries in ["[42]", "[\"no-port\"]", "[\"host:port\"]"] {
            let err = check_peers(&chain(entries), PEER_CONNECT_TIMEOUT, false)
                .unwrap_err()
                .to_string();
            assert!(err.contains("host:port") && err.contains("peers.toml:7"), "{err}");
        }
        let down = check_peers(
            &chain("[\"no-such-host.invalid:1\"]"),
            PEER_CONNECT_TIMEOUT,
            false,
        )
        .unwrap();
        assert!(down[0].reason.contains("cannot resolve"), "{down:?}");
    }
}
