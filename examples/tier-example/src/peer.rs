//! A tiny peer protocol over Unix datagram sockets, so the example can show
//! `serve_external_requests`: a peer sends "which of these keys do you have (and send me the
//! ones in memory)"; the tier answers from the whole node through the `ParentManager`.
//!
//! Request:  `b"KVXQ"`, version `1`, fetch flag (u8), id length (u16), id, key count (u16),
//!           keys (36 bytes each: `OffloadKey::to_bytes`).
//! Response: `b"KVXR"`, version `1`, id length (u16), id, verdict count (u16), verdicts (u8:
//!           0 hit, 1 hit pending, 2 retry, 3 miss), fetched count (u16), fetched chunks (key,
//!           length u32, bytes), error length (u16), error text.
//! Integers are little endian. One datagram each way, so a response is limited to what the
//! socket accepts (about 200 KiB by default on Linux): enough for an example.

use std::io;
use std::os::unix::net::UnixDatagram;
use std::path::{Path, PathBuf};
use std::time::Duration;

use tiering_core::KEY_BYTES;
use tiering_core::{LookupResult, OffloadKey};

const REQUEST_MAGIC: &[u8; 4] = b"KVXQ";
const RESPONSE_MAGIC: &[u8; 4] = b"KVXR";
const VERSION: u8 = 1;

/// A peer's question.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PeerQuery {
    /// The peer's own request id.
    pub id: String,
    /// The keys it asks about.
    pub keys: Vec<OffloadKey>,
    /// Whether to send the bytes of keys that are ready in memory.
    pub fetch: bool,
}

/// The answer.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PeerAnswer {
    /// The request id.
    pub id: String,
    /// One verdict per asked key.
    pub verdicts: Vec<LookupResult>,
    /// The fetched chunks.
    pub fetched: Vec<(OffloadKey, Vec<u8>)>,
    /// What failed, if anything.
    pub error: Option<String>,
}

fn put_str(out: &mut Vec<u8>, s: &str) {
    let b = &s.as_bytes()[..s.len().min(usize::from(u16::MAX))];
    out.extend_from_slice(&(b.len() as u16).to_le_bytes());
    out.extend_from_slice(b);
}

fn put_count(out: &mut Vec<u8>, n: usize) -> io::Result<()> {
    let n = u16::try_from(n).map_err(|_| io::Error::other("too many items for one datagram"))?;
    out.extend_from_slice(&n.to_le_bytes());
    Ok(())
}

/// A cursor over a received datagram.
struct Reader<'a>(&'a [u8]);

impl<'a> Reader<'a> {
    fn take(&mut self, n: usize) -> io::Result<&'a [u8]> {
        if self.0.len() < n {
            return Err(io::Error::new(io::ErrorKind::InvalidData, "truncated message"));
        }
        let (a, b) = self.0.split_at(n);
        self.0 = b;
        Ok(a)
    }

    fn u8(&mut self) -> io::Result<u8> {
        Ok(self.take(1)?[0])
    }

    fn u16(&mut self) -> io::Result<usize> {
        let b = self.take(2)?;
        Ok(usize::from(u16::from_le_bytes([b[0], b[1]])))
    }

    fn u32(&mut self) -> io::Result<usize> {
        let b = self.take(4)?;
        usize::try_from(u32::from_le_bytes([b[0], b[1], b[2], b[3]])).map_err(io::Error::other)
    }

    fn string(&mut self) -> io::Result<String> {
        let n = self.u16()?;
        String::from_utf8(self.take(n)?.to_vec())
            .map_err(|_| io::Error::new(io::ErrorKind::InvalidData, "bad text"))
    }

    fn key(&mut self) -> io::Result<OffloadKey> {
        OffloadKey::from_bytes(self.take(KEY_BYTES)?)
            .ok_or_else(|| io::Error::new(io::ErrorKind::InvalidData, "bad key"))
    }

    fn header(&mut self, magic: &[u8; 4]) -> io::Result<()> {
        if self.take(4)? != magic || self.u8()? != VERSION {
            return Err(io::Error::new(
                io::ErrorKind::InvalidData,
                "not a kvtier example message",
            ));
        }
        Ok(())
    }
}

impl PeerQuery {
    /// Encodes the query.
    ///
    /// # Errors
    /// More than 65535 keys.
    pub fn encode(&self) -> io::Result<Vec<u8>> {
        let mut out = Vec::with_capacity(16 + self.id.len() + self.keys.len() * KEY_BYTES);
        out.extend_from_slice(REQUEST_MAGIC);
        out.push(VERSION);
        out.push(u8::from(self.fetch));
        put_str(&mut out, &self.id);
        put_count(&mut out, self.keys.len())?;
        for k in &self.keys {
            out.extend_from_slice(&k.to_bytes());
        }
        Ok(out)
    }

    /// Decodes a query.
    ///
    /// # Errors
    /// A malformed or truncated datagram.
    pub fn decode(bytes: &[u8]) -> io::Result<Self> {
        let mut r = Reader(bytes);
        r.header(REQUEST_MAGIC)?;
        let fetch = r.u8()? != 0;
        let id = r.string()?;
        let n = r.u16()?;
        let keys = (0..n).map(|_| r.key()).collect::<io::Result<_>>()?;
        Ok(Self { id, keys, fetch })
    }
}

fn verdict_code(v: LookupResult) -> u8 {
    match v {
        LookupResult::Hit => 0,
        LookupResult::HitPending => 1,
        LookupResult::Retry => 2,
        LookupResult::Miss => 3,
    }
}

fn verdict_from(c: u8) -> LookupResult {
    match c {
        0 => LookupResult::Hit,
        1 => LookupResult::HitPending,
        2 => LookupResult::Retry,
        _ => LookupResult::Miss,
    }
}

impl PeerAnswer {
    /// Encodes the answer.
    ///
    /// # Errors
    /// Too many items or a chunk too large for the format.
    pub fn encode(&self) -> io::Result<Vec<u8>> {
        let mut out = Vec::new();
        out.extend_from_slice(RESPONSE_MAGIC);
        out.push(VERSION);
        put_str(&mut out, &self.id);
        put_count(&mut out, self.verdicts.len())?;
        out.extend(self.verdicts.iter().map(|&v| verdict_code(v)));
        put_count(&mut out, self.fetched.len())?;
        for (k, bytes) in &self.fetched {
            out.extend_from_slice(&k.to_bytes());
            let n = u32::try_from(bytes.len()).map_err(io::Error::other)?;
            out.extend_from_slice(&n.to_le_bytes());
            out.extend_from_slice(bytes);
        }
        put_str(&mut out, self.error.as_deref().unwrap_or(""));
        Ok(out)
    }

    /// Decodes an answer.
    ///
    /// # Errors
    /// A malformed or truncated datagram.
    pub fn decode(bytes: &[u8]) -> io::Result<Self> {
        let mut r = Reader(bytes);
        r.header(RESPONSE_MAGIC)?;
        let id = r.string()?;
        let n = r.u16()?;
        let verdicts = r.take(n)?.iter().map(|&c| verdict_from(c)).collect();
        let m = r.u16()?;
        let mut fetched = Vec::with_capacity(m);
        for _ in 0..m {
            let k = r.key()?;
            let len = r.u32()?;
            fetched.push((k, r.take(len)?.to_vec()));
        }
        let error = r.string()?;
        Ok(Self {
            id,
            verdicts,
            fetched,
            error: (!error.is_empty()).then_some(error),
        })
    }
}

/// A peer's end of the protocol: a socket bound at its own path.
pub struct PeerClient {
    socket: UnixDatagram,
    path: PathBuf,
}

impl PeerClient {
    /// Binds a client socket at `path` (replacing a stale socket file).
    ///
    /// # Errors
    /// The socket cannot be bound.
    pub fn bind(path: &Path) -> io::Result<Self> {
        let _ = std::fs::remove_file(path);
        Ok(Self {
            socket: UnixDatagram::bind(path)?,
            path: path.to_path_buf(),
        })
    }

    /// Sends `query` to the tier listening at `inbox`.
    ///
    /// # Errors
    /// Encoding or sending failed.
    pub fn ask(&self, inbox: &Path, query: &PeerQuery) -> io::Result<()> {
        self.socket.send_to(&query.encode()?, inbox).map(|_| ())
    }

    /// Waits up to `timeout` for an answer.
    ///
    /// # Errors
    /// Timeout, or a malformed answer.
    pub fn answer(&self, timeout: Duration) -> io::Result<PeerAnswer> {
        self.socket.set_read_timeout(Some(timeout))?;
        let mut buf = vec![0u8; 256 * 1024];
        let n = self.socket.recv(&mut buf)?;
        PeerAnswer::decode(&buf[..n])
    }
}

impl Drop for PeerClient {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.path);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn messages_round_trip_and_garbage_is_refused() {
        let q = PeerQuery {
            id: "r1".into(),
            keys: vec![OffloadKey::from_u64(1), OffloadKey::from_u64(2).with_group(3)],
            fetch: true,
        };
        assert_eq!(PeerQuery::decode(&q.encode().unwrap()).unwrap(), q);
        let a = PeerAnswer {
            id: "r1".into(),
            verdicts: vec![LookupResult::Hit, LookupResult::Miss],
            fetched: vec![(OffloadKey::from_u64(1), vec![7; 10])],
            error: None,
        };
        assert_eq!(PeerAnswer::decode(&a.encode().unwrap()).unwrap(), a);
        assert!(PeerQuery::decode(b"KVXQ").is_err());
        assert!(PeerAnswer::decode(&q.encode().unwrap()).is_err());
        let enc = q.encode().unwrap();
        assert!(PeerQuery::decode(&enc[..enc.len() - 1]).is_err());
    }
}
