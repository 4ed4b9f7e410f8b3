//! Naming peers and telling their failures apart, as a consumer sees them.

mod common;

use common::*;
use tier_p2p::PeerFailure;
use tiering_core::{LookupResult, ManagerConfig};

#[test]
fn a_peer_named_by_host_name_is_pulled_from() {
    init_tracing();
    let mut a = Node::new(opts(), ManagerConfig::default());
    let mut b = Node::new(opts(), ManagerConfig::default());
    let ks = keys(0, 3);
    a.store("a-req", &ks);
    let ctx = b.pull_ctx_to("b-req", "localhost", a.p2p.port());
    b.mgr.on_new_request(&ctx).unwrap();
    let trace = b.pull_until_settled(&ctx, &ks);
    assert!(
        trace.iter().all(|t| t.last() == Some(&LookupResult::Hit)),
        "{trace:?}"
    );
    for (k, got) in ks.iter().zip(b.read_hits(&ctx, &ks)) {
        assert_eq!(got, pattern(k));
    }
    b.finish(&ctx);
    b.wait_clean();
    a.wait_clean();
    assert_eq!(
        tier_p2p::canonical_peer(&format!("localhost:{}", a.p2p.port())).unwrap(),
        a.p2p.local_id()
    );
}

/// Pulls `keys(0, 2)` from `host:port` until settled; every key must miss.
fn pull_misses(b: &mut Node, host: &str, port: u16) {
    let ctx = b.pull_ctx_to(&format!("to-{host}-{port}"), host, port);
    b.mgr.on_new_request(&ctx).unwrap();
    let trace = b.pull_until_settled(&ctx, &keys(0, 2));
    assert!(
        trace.iter().all(|t| t.last() == Some(&LookupResult::Miss)),
        "{trace:?}"
    );
    b.finish(&ctx);
}

#[test]
fn refused_black_holed_and_unresolvable_peers_are_unreachable() {
    init_tracing();
    let mut o = opts();
    o.deadlines.handshake_ms = 300;
    o.deadlines.lookup_ms = 5_000;
    let mut b = Node::new(o, ManagerConfig::default());
    // Refused: nothing listens on the port.
    let refused = {
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        l.local_addr().unwrap().port()
    };
    // Black-holed: the TCP connection is accepted by the kernel, nothing ever answers.
    let hole = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let hole_port = hole.local_addr().unwrap().port();
    for port in [refused, hole_port] {
        pull_misses(&mut b, "127.0.0.1", port);
        let peer = format!("127.0.0.1:{port}");
        match b.p2p.peer_failure(&peer) {
            Some(PeerFailure::Unreachable { reason, .. }) => {
                assert!(reason.contains("handshake"), "{reason}");
            }
            other => panic!("{peer}: {other:?}"),
        }
    }
    pull_misses(&mut b, "no-such-host.invalid", 7100);
    match b.p2p.peer_failure("no-such-host.invalid:7100") {
        Some(PeerFailure::Unreachable { reason, .. }) => assert!(reason.contains("resolve"), "{reason}"),
        other => panic!("{other:?}"),
    }
    b.wait_clean();
    drop(hole);
}

#[test]
fn a_refused_handshake_says_why_on_the_consumer() {
    init_tracing();
    let mut other = opts();
    other.layout_fingerprint = "another-layout".into();
    let mut a = Node::new(other, ManagerConfig::default());
    // A producer that has run an engine step (its control thread serves from then on).
    a.store("a-req", &keys(0, 2));
    let mut b = Node::new(opts(), ManagerConfig::default());
    pull_misses(&mut b, a.p2p.host(), a.p2p.port());
    wait_for("the refusal to be recorded", || {
        matches!(
            b.p2p.peer_failure(a.p2p.local_id()),
            Some(PeerFailure::HandshakeRefused { .. })
        )
    });
    let f = b.p2p.peer_failure(a.p2p.local_id()).unwrap();
    assert!(f.to_string().contains("layout fingerprint"), "{f}");
    b.wait_clean();
}
