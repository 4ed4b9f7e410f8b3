//! Checks a chain against the outside world before a run: every peer a `p2p` tier is told to
//! dial must accept a connection. A running engine treats a dead peer as a miss (it must keep
//! serving), but an operator starting `kvtier run` with a peer that cannot be reached at all has
//! almost certainly mistyped an address, and should hear so up front instead of reading a report
//! with no peer hits.

use std::net::{TcpStream, ToSocketAddrs};
use std::time::Duration;

use tiering_core::config::ChainConfig;

use super::error::SimError;

/// How long one peer gets to accept a connection.
pub const PEER_CONNECT_TIMEOUT: Duration = Duration::from_secs(2);

/// Fails with an error naming the file, line, tier and address of the first configured peer
/// that does not accept a TCP connection within `timeout`.
///
/// # Errors
/// A `peers` entry that is not a `host:port` string, does not resolve, or refuses or ignores the
/// connection.
pub fn check_peers(chain: &ChainConfig, timeout: Duration) -> Result<(), SimError> {
    for spec in chain.secondaries.iter().filter(|s| s.tier_type == "p2p") {
        let Some(peers) = spec.options.get("peers").and_then(toml::Value::as_array) else {
            continue;
        };
        let line = spec.key_line("peers").unwrap_or(spec.line);
        let fail = |peer: &str, reason: String| SimError::UnreachablePeer {
            location: format!("{}:{line}: {}: key `peers`", chain.source, spec.describe()),
            peer: peer.to_owned(),
            reason,
        };
        for peer in peers {
            let Some(peer) = peer.as_str() else {
                return Err(fail(&peer.to_string(), "not a \"host:port\" string".into()));
            };
            let addrs: Vec<_> = peer
                .to_socket_addrs()
                .map_err(|e| fail(peer, format!("cannot resolve it ({e})")))?
                .collect();
            let mut last = String::from("it resolves to no address");
            let reachable = addrs
                .iter()
                .any(|a| match TcpStream::connect_timeout(a, timeout) {
                    Ok(_) => true,
                    Err(e) => {
                        last = e.to_string();
                        false
                    }
                });
            if !reachable {
                return Err(fail(peer, last));
            }
        }
    }
    Ok(())
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
    fn a_listening_peer_passes_and_a_closed_port_is_named() {
        let live = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let closed = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let closed_addr = closed.local_addr().unwrap();
        drop(closed);
        let ok = chain(&format!("[\"{}\"]", live.local_addr().unwrap()));
        check_peers(&ok, PEER_CONNECT_TIMEOUT).unwrap();
        let bad = chain(&format!(
            "[\"{}\", \"{closed_addr}\"]",
            live.local_addr().unwrap()
        ));
        let err = check_peers(&bad, PEER_CONNECT_TIMEOUT).unwrap_err().to_string();
        assert!(err.contains(&closed_addr.to_string()), "{err}");
        assert!(err.contains("peers.toml:7"), "{err}");
        assert!(err.contains("unreachable"), "{err}");
    }

    #[test]
    fn malformed_peer_entries_are_errors() {
        let err = check_peers(&chain("[42]"), PEER_CONNECT_TIMEOUT)
            .unwrap_err()
            .to_string();
        assert!(err.contains("host:port"), "{err}");
        let err = check_peers(&chain("[\"no-port\"]"), PEER_CONNECT_TIMEOUT)
            .unwrap_err()
            .to_string();
        assert!(err.contains("cannot resolve"), "{err}");
    }
}
