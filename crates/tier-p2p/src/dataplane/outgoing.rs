//! A transfer laid out for the wire ahead of writing, so it can be written in steps: the
//! producer's control thread writes what the socket takes without blocking, and the sender
//! thread writes the rest (if any) where the control thread stopped.
//!
//! The bytes are exactly those of the streaming writer (`BEGIN`, per chunk header, header tag,
//! payload and payload MAC, `END`); the payloads are not copied, they are written straight
//! from the pinned rows.

use std::io::{self, ErrorKind, Write};
use std::net::TcpStream;
use std::ops::Range;

use tiering_core::KEY_BYTES;

use super::frame::{self, Begin, ChunkHeader, TransferMac};
use crate::auth::{DataKey, TAG_BYTES, Tag};

/// One piece of the wire image.
enum Part {
    /// A range of the frame bytes.
    Frames(Range<usize>),
    /// The payload of item `i` (its source row).
    Payload(usize),
}

/// A transfer's wire image and how much of it was written.
pub(crate) struct Outgoing {
    frames: Vec<u8>,
    parts: Vec<Part>,
    /// The part being written and the offset in it.
    part: usize,
    offset: usize,
    /// Whether `write_on`'s `before_last` ran.
    last_announced: bool,
}

impl Outgoing {
    /// Lays out `begin` and one chunk per payload (`headers[i]` describes `payloads[i]`).
    /// `tamper` is applied to each payload MAC (fault injection; identity otherwise).
    pub(crate) fn new<'a>(
        key: &DataKey,
        begin: &Begin,
        chunks: impl ExactSizeIterator<Item = (ChunkHeader, &'a [u8])>,
        mut tamper: impl FnMut(&ChunkHeader, Tag) -> Tag,
    ) -> io::Result<Self> {
        let n = chunks.len();
        let per_chunk = 1 + 4 + 4 + KEY_BYTES + 4 + 2 * TAG_BYTES;
        let mut frames = Vec::with_capacity(64 + begin.kv_request_id.len() + n * per_chunk + 5);
        frame::write_begin(&mut frames, key, begin)?;
        let macs = TransferMac::new(key, begin);
        let mut parts = Vec::with_capacity(3 * n + 2);
        let mut start = 0;
        for (i, (h, payload)) in chunks.enumerate() {
            frame::put_chunk_header(&mut frames, &macs, &h);
            parts.push(Part::Frames(start..frames.len()));
            parts.push(Part::Payload(i));
            let mac = macs.payload(&h).tag_of(payload)?;
            start = frames.len();
            frames.extend_from_slice(tamper(&h, mac).as_bytes());
        }
        frame::write_end(
            &mut frames,
            u32::try_from(n).map_err(|_| io::Error::other("transfer too large"))?,
        )?;
        parts.push(Part::Frames(start..frames.len()));
        Ok(Self {
            frames,
            parts,
            part: 0,
            offset: 0,
            last_announced: false,
        })
    }

    /// Whether every byte was written.
    #[cfg(test)]
    fn done(&self) -> bool {
        self.part >= self.parts.len()
    }

    /// Writes on from where the last call stopped, until done or until the socket would block
    /// (a non-blocking socket; `Ok(false)`). `payload(i)` is item `i`'s source row.
    /// `before_last` runs once, before the last part (the last payload MAC and `END`) is
    /// written: what it counts is counted before the consumer can verify the last chunk.
    pub(crate) fn write_on<'a>(
        &mut self,
        mut w: &TcpStream,
        payload: impl Fn(usize) -> &'a [u8],
        before_last: &mut dyn FnMut(),
    ) -> io::Result<bool> {
        while let Some(part) = self.parts.get(self.part) {
            if !self.last_announced && self.part + 1 == self.parts.len() {
                self.last_announced = true;
                before_last();
            }
            let bytes = match part {
                Part::Frames(r) => &self.frames[r.clone()],
                Part::Payload(i) => payload(*i),
            };
            let rest = bytes.get(self.offset..).unwrap_or_default();
            if rest.is_empty() {
                self.part += 1;
                self.offset = 0;
                continue;
            }
            match w.write(rest) {
                Ok(0) => return Err(io::Error::new(ErrorKind::WriteZero, "the data connection closed")),
                Ok(k) => self.offset += k,
                Err(e) if e.kind() == ErrorKind::Interrupted => {}
                Err(e) if e.kind() == ErrorKind::WouldBlock => return Ok(false),
                Err(e) => return Err(e),
            }
        }
        w.flush()?;
        Ok(true)
    }
}

#[cfg(test)]
mod tests {
    use std::io::Read;
    use std::net::TcpListener;

    use tiering_core::OffloadKey;

    use super::*;

    /// The wire image equals what the streaming writer produces, written in one go or resumed
    /// after the socket would block.
    #[test]
    fn the_wire_image_matches_the_streaming_writer() {
        let key = DataKey::from_bytes([7; 32]);
        let begin = Begin {
            transfer_id: 9,
            kv_request_id: "req".into(),
            round: 2,
            count: 3,
        };
        let payloads: Vec<Vec<u8>> = (0..3u8).map(|i| vec![i ^ 0x5a; 300_000]).collect();
        let headers: Vec<ChunkHeader> = (0..3u32)
            .map(|i| ChunkHeader {
                index: i,
                dst_row: 10 + i,
                key: OffloadKey::from_u64(u64::from(i) + 100),
                len: 300_000,
            })
            .collect();
        let mut expected = Vec::new();
        frame::write_begin(&mut expected, &key, &begin).unwrap();
        for (h, p) in headers.iter().zip(&payloads) {
            frame::write_chunk(&mut expected, &key, &begin, h, p, |t| t).unwrap();
        }
        frame::write_end(&mut expected, 3).unwrap();

        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let tx = TcpStream::connect(listener.local_addr().unwrap()).unwrap();
        let (mut rx, _) = listener.accept().unwrap();
        let len = expected.len();
        let reader = std::thread::spawn(move || {
            let mut got = vec![0u8; len];
            // Start reading late, so the non-blocking writes fill the socket first.
            std::thread::sleep(std::time::Duration::from_millis(50));
            rx.read_exact(&mut got).unwrap();
            got
        });
        let mut out = Outgoing::new(
            &key,
            &begin,
            headers.iter().cloned().zip(payloads.iter().map(Vec::as_slice)),
            |_, t| t,
        )
        .unwrap();
        tx.set_nonblocking(true).unwrap();
        let mut announced = 0;
        let first = out
            .write_on(&tx, |i| &payloads[i], &mut || announced += 1)
            .unwrap();
        tx.set_nonblocking(false).unwrap();
        if !first {
            assert!(!out.done());
            assert!(
                out.write_on(&tx, |i| &payloads[i], &mut || announced += 1)
                    .unwrap()
            );
        }
        assert_eq!(announced, 1, "the last part is announced once");
        assert!(out.done());
        assert!(
            reader.join().unwrap() == expected,
            "the bytes differ from the streaming writer's"
        );
    }
}
