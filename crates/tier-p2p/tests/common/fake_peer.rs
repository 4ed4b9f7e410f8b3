//! A scripted producer peer speaking the wire protocol by hand: it completes the handshake
//! (with whatever secret it is given), receives the node's `fetch`, and lets the test decide
//! exactly which data-plane bytes reach the node.

use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::time::{Duration, Instant};

use tier_p2p::SharedSecret;
use tier_p2p::auth::DataKey;
use tier_p2p::dataplane::frame::{self, Begin, ChunkHeader, ChunkStatus, Hello};
use tier_p2p::wire::NONCE_BYTES;
use tier_p2p::wire::{Bin, Connect, Message, WIRE_VERSION, decode_keys};
use tiering_core::OffloadKey;

use super::{CHUNK, P2pHandle, PATIENCE, ROWS, pattern};

/// One fetch the node sent.
pub struct SeenFetch {
    pub kv: String,
    pub round: u64,
    pub keys: Vec<OffloadKey>,
    pub rows: Vec<u32>,
}

pub struct FakePeer {
    _ctx: zmq::Context,
    router: zmq::Socket,
    dealer: zmq::Socket,
    _data: TcpListener,
    pub id: String,
    pub instance: u64,
    secret: SharedSecret,
    ours: Connect,
    node_connect: Option<Connect>,
}

impl FakePeer {
    /// Binds a control ROUTER (the peer's identity is its address) and a data listener, and
    /// opens a DEALER toward `node`.
    pub fn new(node: &P2pHandle, secret: SharedSecret, instance: u64) -> Self {
        let ctx = zmq::Context::new();
        let router = ctx.socket(zmq::ROUTER).unwrap();
        router.set_linger(0).unwrap();
        // The node's next session reconnects under the same identity.
        router.set_router_handover(true).unwrap();
        router.bind("tcp://127.0.0.1:*").unwrap();
        let ep = router.get_last_endpoint().unwrap().unwrap();
        let id = ep.trim_start_matches("tcp://").to_owned();
        let data = TcpListener::bind("127.0.0.1:0").unwrap();
        data.set_nonblocking(true).unwrap();
        let dealer = ctx.socket(zmq::DEALER).unwrap();
        dealer.set_identity(id.as_bytes()).unwrap();
        dealer.set_linger(0).unwrap();
        dealer.connect(&format!("tcp://{}", node.local_id())).unwrap();
        let ours = Self::connect_msg(&id, instance, &data, &secret, 1);
        Self {
            _ctx: ctx,
            router,
            dealer,
            id,
            instance,
            _data: data,
            secret,
            ours,
            node_connect: None,
        }
    }

    fn connect_msg(id: &str, instance: u64, data: &TcpListener, secret: &SharedSecret, nonce: u8) -> Connect {
        let mut c = Connect {
            wire_version: WIRE_VERSION,
            peer_id: id.to_owned(),
            instance,
            nonce: Bin(vec![nonce; NONCE_BYTES]),
            data_addr: data.local_addr().unwrap().to_string(),
            chunk_bytes: CHUNK as u64,
            num_chunks: ROWS as u64,
            layout_fingerprint: "layout".into(),
            hash_seed: "seed".into(),
            auth: Bin::default(),
        };
        c.auth = Bin(secret.connect_tag(&c).as_bytes().to_vec());
        c
    }

    /// The host and port the node dials.
    pub fn host_port(&self) -> (String, u16) {
        let (h, p) = self.id.rsplit_once(':').unwrap();
        (h.to_owned(), p.parse().unwrap())
    }

    /// The next message the node sent us (`None` after `PATIENCE`).
    pub fn recv(&self, within: Duration) -> Option<Message> {
        let start = Instant::now();
        while start.elapsed() < within {
            if self.router.poll(zmq::POLLIN, 10).unwrap() > 0 {
                let frames = self.router.recv_multipart(0).unwrap();
                return Some(Message::decode(&frames[1]).unwrap());
            }
        }
        None
    }

    /// Sends raw bytes without blocking (`false` when the send queue is full).
    pub fn send_raw(&self, bytes: &[u8]) -> bool {
        self.dealer.send(bytes, zmq::DONTWAIT).is_ok()
    }

    pub fn send(&self, m: &Message) {
        self.dealer.send(m.encode(), 0).unwrap();
    }

    /// Sends our `connect` and acknowledges the node's (waiting for it, calling `pump` so the
    /// node gets to process ours).
    pub fn handshake(&mut self, mut pump: impl FnMut()) {
        self.send(&Message::Connect(self.ours.clone()));
        let start = Instant::now();
        while self.node_connect.is_none() {
            assert!(start.elapsed() < PATIENCE, "no connect from the node");
            pump();
            if let Some(Message::Connect(c)) = self.recv(Duration::from_millis(50)) {
                self.node_connect = Some(c);
            }
        }
        self.send(&Message::ConnectAck {
            peer_id: self.id.clone(),
        });
    }

    /// A new session of the same incarnation: a goodbye, then a fresh nonce and handshake.
    pub fn new_session(&mut self, node: &P2pHandle, nonce: u8, pump: impl FnMut()) {
        self.send(&Message::Disconnect {
            reason: "test".into(),
        });
        std::thread::sleep(Duration::from_millis(100));
        while self.recv(Duration::from_millis(20)).is_some() {}
        self.dealer = self._ctx.socket(zmq::DEALER).unwrap();
        self.dealer.set_identity(self.id.as_bytes()).unwrap();
        self.dealer.set_linger(0).unwrap();
        self.dealer
            .connect(&format!("tcp://{}", node.local_id()))
            .unwrap();
        self.ours = Self::connect_msg(&self.id, self.instance, &self._data, &self.secret, nonce);
        self.node_connect = None;
        self.handshake(pump);
    }

    /// The node's next non-empty `fetch` if one comes within `within` (other messages are
    /// dropped).
    pub fn poll_fetch(&self, within: Duration) -> Option<SeenFetch> {
        let start = Instant::now();
        while start.elapsed() < within {
            if let Some(Message::Fetch {
                kv_request_id,
                round_seq,
                keys,
                block_indexes,
                ..
            }) = self.recv(Duration::from_millis(1))
                && !keys.is_empty()
            {
                return Some(SeenFetch {
                    kv: kv_request_id,
                    round: round_seq,
                    keys: decode_keys(&keys).unwrap(),
                    rows: block_indexes,
                });
            }
        }
        None
    }

    /// Answers a fetch's round as the producer would once the node acknowledged the data.
    pub fn transfer_done(&self, f: &SeenFetch, ok: bool) {
        self.send(&Message::TransferDone {
            kv_request_id: f.kv.clone(),
            round_seq: f.round,
            success: ok,
            key_ok: vec![ok; f.keys.len()],
        });
    }

    /// The key of this session's data toward the node (what an honest producer uses).
    pub fn data_key(&self) -> DataKey {
        self.secret
            .data_key(&self.ours, self.node_connect.as_ref().expect("handshake first"))
    }

    /// The data-plane bytes of one transfer answering `f` under `key` (HELLO excluded).
    pub fn transfer_bytes(&self, key: &DataKey, f: &SeenFetch, transfer_id: u64) -> Vec<u8> {
        let begin = Begin {
            transfer_id,
            kv_request_id: f.kv.clone(),
            round: f.round,
            count: f.keys.len() as u32,
        };
        let mut buf = Vec::new();
        frame::write_begin(&mut buf, key, &begin).unwrap();
        for (i, (k, row)) in f.keys.iter().zip(&f.rows).enumerate() {
            let h = ChunkHeader {
                index: i as u32,
                dst_row: *row,
                key: *k,
                len: CHUNK as u32,
            };
            frame::write_chunk(&mut buf, key, &begin, &h, &pattern(k), |t| t).unwrap();
        }
        frame::write_end(&mut buf, f.keys.len() as u32).unwrap();
        buf
    }

    /// Opens a data connection to the node greeting as this peer (or as `instance`).
    pub fn data_conn(&self, instance: u64) -> TcpStream {
        let addr = &self.node_connect.as_ref().expect("handshake first").data_addr;
        let mut s = TcpStream::connect(addr).unwrap();
        s.set_read_timeout(Some(PATIENCE)).unwrap();
        frame::write_hello(
            &mut s,
            &Hello {
                peer_id: self.id.clone(),
                instance,
            },
        )
        .unwrap();
        s
    }
}

/// Writes `bytes` and reads the node's answer: its ACK, or `None` when it cut the connection.
pub fn push(s: &mut TcpStream, bytes: &[u8]) -> Option<Vec<ChunkStatus>> {
    // The node may cut the connection mid-write; that is an answer too.
    if s.write_all(bytes).and_then(|()| s.flush()).is_err() {
        return None;
    }
    match frame::read_ack(s) {
        Ok((_, statuses)) => Some(statuses),
        Err(_) => {
            let mut rest = Vec::new();
            let _ = s.read_to_end(&mut rest);
            None
        }
    }
}
