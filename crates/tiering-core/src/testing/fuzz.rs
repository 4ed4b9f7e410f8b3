//! A stable-toolchain fuzz driver shared by the crates' fuzz targets: a fixed-seed generator
//! feeds `arbitrary` (so a failure names the seed and input number that reproduce it), a
//! target builds a structured input from those bytes, and generic mutations (bytes flipped,
//! inserted, removed, truncated, overwritten with a length prefix or a token of the format,
//! or replaced by raw bytes) turn well-formed encodings into the near-misses parsers meet.

use arbitrary::{Arbitrary, Unstructured};

/// A small deterministic generator (splitmix64): reproducible inputs without a corpus.
#[derive(Clone, Debug)]
pub struct FuzzRng(u64);

impl FuzzRng {
    /// A generator from `seed`.
    #[must_use]
    pub fn new(seed: u64) -> Self {
        Self(seed)
    }

    /// The next 64 pseudo-random bits.
    pub fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }

    /// Refills `buf` with between 0 and `max` pseudo-random bytes.
    pub fn fill(&mut self, buf: &mut Vec<u8>, max: usize) {
        let n = usize::try_from(self.next_u64() % (max as u64 + 1)).unwrap_or(max);
        buf.clear();
        while buf.len() < n {
            buf.extend_from_slice(&self.next_u64().to_le_bytes());
        }
        buf.truncate(n);
    }
}

/// One mutation of an encoded input.
#[derive(Arbitrary, Debug)]
pub enum Mutation {
    /// Leave the input as generated (the target may then assert it round-trips).
    None,
    /// XOR one byte with a non-zero mask.
    Flip(usize, u8),
    /// Insert bytes.
    Insert(usize, Vec<u8>),
    /// Remove up to 255 bytes.
    Remove(usize, u8),
    /// Cut the input short.
    Truncate(usize),
    /// Overwrite with a plausible length prefix (msgpack `bin32`/`array32`/`map32`/`str32`
    /// marker and a big-endian u32, or a bare little-endian u32): the shape of a
    /// length-based allocation attack.
    Length(usize, u8, u32),
    /// Insert one token of the target's format (its dictionary), e.g. a TOML header or a
    /// JSON key, so text formats get structurally meaningful damage.
    Token(usize, u16),
    /// Replace the input with raw bytes.
    Raw(Vec<u8>),
}

impl Mutation {
    /// Whether the input is left unmutated.
    #[must_use]
    pub fn is_none(&self) -> bool {
        matches!(self, Self::None)
    }
}

/// Applies `m` to `bytes`; [`Mutation::Token`] draws from `dictionary` (no-op when empty).
#[must_use]
pub fn mutate(mut bytes: Vec<u8>, m: Mutation, dictionary: &[&[u8]]) -> Vec<u8> {
    let at = |i: usize, len: usize| if len == 0 { 0 } else { i % len };
    match m {
        Mutation::None => {}
        Mutation::Flip(i, x) => {
            if !bytes.is_empty() {
                let i = at(i, bytes.len());
                bytes[i] ^= x.max(1);
            }
        }
        Mutation::Insert(i, more) => {
            let i = at(i, bytes.len() + 1);
            bytes.splice(i..i, more);
        }
        Mutation::Remove(i, n) => {
            let i = at(i, bytes.len() + 1);
            let end = (i + usize::from(n)).min(bytes.len());
            bytes.drain(i..end);
        }
        Mutation::Truncate(n) => bytes.truncate(at(n, bytes.len() + 1)),
        Mutation::Length(i, marker, len) => {
            let i = at(i, bytes.len() + 1);
            let patch = if marker >= 128 {
                len.to_le_bytes().to_vec()
            } else {
                let mut p = vec![[0xc6, 0xdd, 0xdf, 0xdb][usize::from(marker % 4)]];
                p.extend_from_slice(&len.to_be_bytes());
                p
            };
            let end = (i + patch.len()).min(bytes.len());
            bytes.splice(i..end, patch);
        }
        Mutation::Token(i, t) => {
            if !dictionary.is_empty() {
                let i = at(i, bytes.len() + 1);
                let token = dictionary[usize::from(t) % dictionary.len()];
                bytes.splice(i..i, token.iter().copied());
            }
        }
        Mutation::Raw(raw) => bytes = raw,
    }
    bytes
}

/// Runs `target` on `n` inputs drawn from `seed` and returns how many built a complete
/// structured input (the rest ran out of entropy early, which is a valid input too).
///
/// # Panics
/// When `target` panics (an assertion about the parser failed, or the parser itself
/// panicked): the message names the target, the seed and the input number.
pub fn drive(
    name: &str,
    n: u64,
    seed: u64,
    target: fn(&mut Unstructured<'_>) -> arbitrary::Result<()>,
) -> u64 {
    let mut rng = FuzzRng::new(seed);
    let mut raw = Vec::with_capacity(8192);
    let mut structured = 0;
    for i in 0..n {
        rng.fill(&mut raw, 4096);
        let mut u = Unstructured::new(&raw);
        let outcome = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| target(&mut u)));
        match outcome {
            Ok(Ok(())) => structured += 1,
            Ok(Err(_)) => {}
            Err(_) => panic!(
                "fuzz {name}: input {i} of seed {seed:#x} crashed ({} raw bytes)",
                raw.len()
            ),
        }
    }
    eprintln!("fuzz {name}: {n} inputs, {structured} fully structured, 0 crashes");
    structured
}

/// The input count for a run: `KVTIER_FUZZ_INPUTS` when set, else `default`.
#[must_use]
pub fn inputs(default: u64) -> u64 {
    std::env::var("KVTIER_FUZZ_INPUTS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_generator_is_reproducible_and_bounded() {
        let (mut a, mut b) = (FuzzRng::new(7), FuzzRng::new(7));
        let (mut x, mut y) = (Vec::new(), Vec::new());
        for _ in 0..100 {
            a.fill(&mut x, 300);
            b.fill(&mut y, 300);
            assert_eq!(x, y);
            assert!(x.len() <= 300);
        }
    }

    #[test]
    fn mutations_stay_in_bounds_and_tokens_come_from_the_dictionary() {
        let base = b"abcdef".to_vec();
        assert_eq!(mutate(base.clone(), Mutation::None, &[]), base);
        assert_eq!(mutate(base.clone(), Mutation::Truncate(3), &[]), b"abc");
        assert_eq!(mutate(base.clone(), Mutation::Remove(4, 200), &[]), b"abcd");
        assert_eq!(
            mutate(base.clone(), Mutation::Token(2, 1), &[b"X", b"[[y]]"]),
            b"ab[[y]]cdef"
        );
        assert_eq!(mutate(Vec::new(), Mutation::Flip(9, 0), &[]), b"");
        let l = mutate(base, Mutation::Length(1, 0, 0x0102_0304), &[]);
        assert_eq!(l, [b'a', 0xc6, 1, 2, 3, 4]);
    }

    #[test]
    #[should_panic(expected = "fuzz boom: input 0 of seed 0x1 crashed")]
    fn a_crashing_target_names_the_input_that_reproduces_it() {
        drive("boom", 3, 1, |_| panic!("found one"));
    }
}
