//! Peer names: a request or a chain may name a peer by host name (`localhost:7100`), but a
//! node's identity on the wire is always `ip:port`. Names resolve to the first IPv4 address
//! (else IPv6, bracketed), on a helper thread so the scheduler never waits on DNS.

use std::collections::HashMap;
use std::net::{IpAddr, SocketAddr, ToSocketAddrs};
use std::sync::mpsc;

use crate::notify::Notifier;

/// Resolves `host:port` to the canonical `ip:port` (blocking). A literal address is returned
/// unchanged.
///
/// # Errors
/// The port is not a number, or the host does not resolve.
pub fn canonical_peer(name: &str) -> Result<String, String> {
    let (host, port) = name
        .rsplit_once(':')
        .ok_or_else(|| format!("{name:?} is not host:port"))?;
    let port: u16 = port
        .parse()
        .map_err(|_| format!("{name:?}: the port is not a number"))?;
    let bare = host.trim_start_matches('[').trim_end_matches(']');
    if bare.parse::<IpAddr>().is_ok() {
        return Ok(name.to_owned());
    }
    let addrs: Vec<SocketAddr> = (bare, port)
        .to_socket_addrs()
        .map_err(|e| format!("{host} does not resolve: {e}"))?
        .collect();
    let pick = addrs
        .iter()
        .find(|a| a.is_ipv4())
        .or_else(|| addrs.first())
        .ok_or_else(|| format!("{host} resolves to no address"))?;
    Ok(match pick {
        SocketAddr::V4(a) => format!("{}:{}", a.ip(), a.port()),
        SocketAddr::V6(a) => format!("[{}]:{}", a.ip(), a.port()),
    })
}

/// What is known of one name.
#[derive(Clone, Debug)]
pub(crate) enum Resolved {
    Pending,
    Done(Result<String, String>),
}

/// Cached, asynchronous resolution of peer names.
pub(crate) struct Resolver {
    cache: HashMap<String, Resolved>,
    tx: mpsc::Sender<(String, Result<String, String>)>,
    rx: mpsc::Receiver<(String, Result<String, String>)>,
    notifier: Notifier,
}

impl Resolver {
    pub(crate) fn new(notifier: Notifier) -> Self {
        let (tx, rx) = mpsc::channel();
        Self {
            cache: HashMap::new(),
            tx,
            rx,
            notifier,
        }
    }

    /// The canonical name of `name`: at once for a literal address, else from the cache, else
    /// `Pending` while a helper thread resolves it.
    pub(crate) fn resolve(&mut self, name: &str) -> Resolved {
        while let Ok((n, r)) = self.rx.try_recv() {
            self.cache.insert(n, Resolved::Done(r));
        }
        if let Some(r) = self.cache.get(name) {
            return r.clone();
        }
        let literal = name.rsplit_once(':').is_some_and(|(h, _)| {
            h.trim_start_matches('[')
                .trim_end_matches(']')
                .parse::<IpAddr>()
                .is_ok()
        });
        if literal {
            return Resolved::Done(Ok(name.to_owned()));
        }
        self.cache.insert(name.to_owned(), Resolved::Pending);
        let (tx, notifier, owned) = (self.tx.clone(), self.notifier.clone(), name.to_owned());
        let spawned = std::thread::Builder::new()
            .name("kvtier-p2p-resolve".into())
            .spawn(move || {
                let r = canonical_peer(&owned);
                let _ = tx.send((owned, r));
                notifier.wake();
            });
        if let Err(e) = spawned {
            let r = Resolved::Done(Err(format!("cannot start a resolver thread: {e}")));
            self.cache.insert(name.to_owned(), r.clone());
            return r;
        }
        Resolved::Pending
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_resolve_to_addresses_and_literals_stay() {
        assert_eq!(canonical_peer("127.0.0.1:7100").unwrap(), "127.0.0.1:7100");
        assert_eq!(canonical_peer("localhost:7100").unwrap(), "127.0.0.1:7100");
        assert!(canonical_peer("localhost:x").is_err());
        assert!(canonical_peer("no-such-host.invalid:1").is_err());
    }

    #[test]
    fn the_resolver_answers_later_and_caches() {
        let mut r = Resolver::new(Notifier::default());
        assert!(matches!(r.resolve("10.0.0.1:5"), Resolved::Done(Ok(ref s)) if s == "10.0.0.1:5"));
        let start = std::time::Instant::now();
        loop {
            match r.resolve("localhost:9") {
                Resolved::Done(Ok(s)) => {
                    assert_eq!(s, "127.0.0.1:9");
                    break;
                }
                Resolved::Done(Err(e)) => panic!("{e}"),
                Resolved::Pending => {
                    assert!(start.elapsed() < std::time::Duration::from_secs(30));
                    std::thread::sleep(std::time::Duration::from_millis(1));
                }
            }
        }
    }
}
