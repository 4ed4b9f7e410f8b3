//! Commands encoded straight into a reusable buffer of RESP bytes, for a standalone server.
//!
//! The `redis` crate's `Pipeline` copies every argument into its command, then every command
//! into the bytes it sends, allocating both anew for each pipeline. A chunk value is the bulk of
//! a pipeline, so a worker instead writes header and payload once, into a buffer it keeps from
//! batch to batch (no allocation or page faults once warm), and hands the bytes to the
//! connection as they are (a store sends them every few hundred KiB, so the server parses the
//! first values while the worker encodes the next). A cluster connection routes commands by
//! slot and needs them as separate commands, so cluster workers keep the crate's
//! `ClusterPipeline`.

use tiering_core::OffloadKey;

use crate::format::{HEADER_LEN, KeyScheme};

/// A buffer kept above this many bytes between batches is released (one unusually large
/// batch does not pin its size for the worker's lifetime).
const KEEP_BYTES: usize = 16 << 20;

/// RESP commands waiting to be sent as one pipeline.
#[derive(Default)]
pub(crate) struct PackedPipeline {
    bytes: Vec<u8>,
    commands: usize,
}

impl PackedPipeline {
    /// Empties the pipeline, keeping the buffer unless it grew unusually large.
    pub(crate) fn clear(&mut self) {
        if self.bytes.capacity() > KEEP_BYTES {
            self.bytes = Vec::new();
        }
        self.bytes.clear();
        self.commands = 0;
    }

    /// The encoded commands.
    pub(crate) fn bytes(&self) -> &[u8] {
        &self.bytes
    }

    /// How many commands (and so replies) the pipeline holds.
    pub(crate) fn commands(&self) -> usize {
        self.commands
    }

    /// Reserves room for `n` more commands of about `each` bytes.
    pub(crate) fn reserve(&mut self, n: usize, each: usize) {
        self.bytes.reserve(n.saturating_mul(each));
    }

    fn array(&mut self, items: usize) {
        self.length_line(b'*', items);
        self.commands += 1;
    }

    /// `<kind><n in decimal>\r\n`, formatted without allocating.
    fn length_line(&mut self, kind: u8, n: usize) {
        let mut digits = [0u8; 20];
        let mut at = digits.len();
        let mut rest = n;
        loop {
            at -= 1;
            digits[at] = b'0' + (rest % 10) as u8;
            rest /= 10;
            if rest == 0 {
                break;
            }
        }
        self.bytes.push(kind);
        self.bytes.extend_from_slice(&digits[at..]);
        self.bytes.extend_from_slice(b"\r\n");
    }

    fn bulk(&mut self, data: &[u8]) {
        self.length_line(b'$', data.len());
        self.bytes.extend_from_slice(data);
        self.bytes.extend_from_slice(b"\r\n");
    }

    fn key(&mut self, scheme: &KeyScheme, key: &OffloadKey) {
        self.length_line(b'$', scheme.name_len());
        scheme.write_name(key, &mut self.bytes);
        self.bytes.extend_from_slice(b"\r\n");
    }

    /// Bytes one `SET` of a chunk of `scheme` takes, about.
    pub(crate) fn set_len(scheme: &KeyScheme) -> usize {
        scheme.name_len() + HEADER_LEN + scheme.chunk_bytes() + 48
    }

    /// `SET <name of key> <header + payload>`.
    pub(crate) fn set(&mut self, scheme: &KeyScheme, key: &OffloadKey, payload: &[u8]) {
        self.array(3);
        self.bulk(b"SET");
        self.key(scheme, key);
        self.length_line(b'$', HEADER_LEN + payload.len());
        scheme.write_value(key, payload, &mut self.bytes);
        self.bytes.extend_from_slice(b"\r\n");
    }

    /// A command of one key argument (`GET`, `EXISTS`, `UNLINK`).
    pub(crate) fn keyed(&mut self, command: &[u8], scheme: &KeyScheme, key: &OffloadKey) {
        self.array(2);
        self.bulk(command);
        self.key(scheme, key);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Encodes the same commands with the `redis` crate.
    fn reference(cmds: &[redis::Cmd]) -> Vec<u8> {
        let mut p = redis::pipe();
        for c in cmds {
            p.add_command(c.clone());
        }
        p.get_packed_pipeline()
    }

    #[test]
    fn commands_encode_as_the_client_library_encodes_them() {
        let scheme = KeyScheme::new("ns", 100, "fp");
        let (a, b) = (OffloadKey::from_u64(1), OffloadKey::from_u64(2));
        let payload: Vec<u8> = (0..100u8).collect();
        let mut p = PackedPipeline::default();
        p.reserve(4, PackedPipeline::set_len(&scheme));
        p.set(&scheme, &a, &payload);
        p.keyed(b"GET", &scheme, &b);
        p.keyed(b"EXISTS", &scheme, &a);
        assert_eq!(p.commands(), 3);

        let mut set = redis::cmd("SET");
        set.arg(scheme.name(&a)).arg(scheme.encode(&a, &payload));
        let mut get = redis::cmd("GET");
        get.arg(scheme.name(&b));
        let mut exists = redis::cmd("EXISTS");
        exists.arg(scheme.name(&a));
        assert_eq!(p.bytes(), reference(&[set, get, exists]).as_slice());

        p.clear();
        assert_eq!((p.bytes().len(), p.commands()), (0, 0));
    }

    #[test]
    fn lengths_are_written_in_decimal() {
        let mut p = PackedPipeline::default();
        for n in [0, 9, 10, 65_624, usize::MAX] {
            p.clear();
            p.length_line(b'$', n);
            assert_eq!(p.bytes(), format!("${n}\r\n").as_bytes());
        }
    }
}
