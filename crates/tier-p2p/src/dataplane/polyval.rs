//! POLYVAL (RFC 8452): the universal hash under the data plane's payload MAC.
//!
//! POLYVAL evaluates the message, in 16-byte blocks, as a polynomial in a secret key `H` over
//! GF(2^128). For two different messages of at most `L` blocks, the chance over `H` that they
//! hash alike is at most `L / 2^128`; it is a MAC only once its output is hidden behind a PRF
//! (see `frame::TransferMac`, which folds every piece's hash into a keyed BLAKE3, so no hash
//! value, and nothing about `H`, ever leaves the process).
//!
//! Two engines compute it. On x86_64 with AVX2 and VPCLMULQDQ, this module's own path hashes
//! 512 bytes per reduction with 256-bit carry-less multiplies and Karatsuba; everywhere else
//! RustCrypto's `polyval` crate does (PCLMULQDQ, ARMv8 PMULL, or its constant-time software
//! multiply). The own path exists for speed: the crate (0.7) multiplies with 128-bit PCLMULQDQ,
//! four blocks per reduction, and side by side on the same pieces (the bench's `mac` section
//! prints both) it runs at about a third of the wide path — about 6 against 17-18 GB/s of thread
//! CPU time — which cost the data plane its target (0.77 of raw loopback TCP instead of 1.04).
//! Both engines are tested against each other and against the bit-serial definition; every
//! multiply either one makes is a carry-less multiply instruction or the crate's constant-time
//! software, so neither branches on the key.

/// Bytes of a POLYVAL block (and of its output).
pub const BLOCK: usize = 16;

/// A POLYVAL key, ready to hash.
#[derive(Clone)]
pub struct Polyval {
    engine: Engine,
}

#[derive(Clone)]
enum Engine {
    /// AVX2 with VPCLMULQDQ: `powers[k]` is `H^(k+1)` (POLYVAL's product, little-endian field
    /// elements), for the 512-byte stride.
    #[cfg(target_arch = "x86_64")]
    Wide { powers: Box<[u128; x86::WIDE_BLOCKS]> },
    /// Every other machine: the crate's autodetected backend.
    Portable(polyval::Polyval),
}

impl Polyval {
    /// A hasher under key `h` (16 bytes, little-endian as in RFC 8452).
    #[must_use]
    pub fn new(h: [u8; BLOCK]) -> Self {
        #[cfg(target_arch = "x86_64")]
        if wide_available() {
            let h = u128::from_le_bytes(h);
            let mut powers = [h; x86::WIDE_BLOCKS];
            for k in 1..powers.len() {
                // SAFETY: `wide_available` checked PCLMULQDQ and SSE2, the target features
                // `x86::dot` is compiled for.
                powers[k] = unsafe { x86::dot(powers[k - 1], h) };
            }
            return Self {
                engine: Engine::Wide {
                    powers: Box::new(powers),
                },
            };
        }
        Self::portable(h)
    }

    /// A hasher that uses the crate whatever the machine has (tests compare the engines).
    fn portable(h: [u8; BLOCK]) -> Self {
        Self {
            engine: Engine::Portable(polyval::Polyval::new(&h.into())),
        }
    }

    /// POLYVAL of `data`, its last block padded with zeros (the caller binds the length
    /// elsewhere when it matters).
    #[must_use]
    pub fn hash(&self, data: &[u8]) -> [u8; BLOCK] {
        match &self.engine {
            #[cfg(target_arch = "x86_64")]
            Engine::Wide { powers } => {
                let (whole, rest) = data.split_at(data.len() / x86::WIDE_BYTES * x86::WIDE_BYTES);
                // SAFETY: `Engine::Wide` is only built when the CPU reports AVX2, PCLMULQDQ and
                // VPCLMULQDQ (`wide_available`), the target features `wide` and `dot` are
                // compiled for.
                let mut s = unsafe { x86::wide(powers, 0, whole) };
                for block in rest.chunks(BLOCK) {
                    let mut x = [0u8; BLOCK];
                    x[..block.len()].copy_from_slice(block);
                    // SAFETY: as above.
                    s = unsafe { x86::dot(s ^ u128::from_le_bytes(x), powers[0]) };
                }
                s.to_le_bytes()
            }
            Engine::Portable(hasher) => {
                use polyval::universal_hash::UniversalHash;
                let mut hasher = hasher.clone();
                hasher.update_padded(data);
                hasher.finalize().into()
            }
        }
    }
}

/// Whether this CPU runs the wide path (AVX2, PCLMULQDQ and VPCLMULQDQ).
#[cfg(target_arch = "x86_64")]
fn wide_available() -> bool {
    std::arch::is_x86_feature_detected!("sse2")
        && std::arch::is_x86_feature_detected!("pclmulqdq")
        && std::arch::is_x86_feature_detected!("avx2")
        && std::arch::is_x86_feature_detected!("vpclmulqdq")
}

#[cfg(target_arch = "x86_64")]
mod x86 {
    use std::arch::x86_64::{
        __m128i, __m256i, _mm_clmulepi64_si128, _mm_loadu_si128, _mm_set_epi64x, _mm_shuffle_epi32,
        _mm_slli_si128, _mm_srli_si128, _mm_storeu_si128, _mm_xor_si128, _mm256_castsi256_si128,
        _mm256_clmulepi64_epi128, _mm256_extracti128_si256, _mm256_loadu_si256, _mm256_set_m128i,
        _mm256_setzero_si256, _mm256_shuffle_epi32, _mm256_xor_si256, _mm256_zextsi128_si256,
    };

    /// Blocks hashed per reduction by [`wide`]: thirty-two, in sixteen 256-bit lanes.
    pub(super) const WIDE_BLOCKS: usize = 32;

    /// Bytes hashed per reduction by [`wide`].
    pub(super) const WIDE_BYTES: usize = WIDE_BLOCKS * 16;

    /// 256-bit lanes per stride (two blocks each).
    const LANES: usize = WIDE_BLOCKS / 2;

    fn load(v: u128) -> __m128i {
        let b = v.to_le_bytes();
        // SAFETY: `b` is 16 readable bytes; the load is unaligned.
        unsafe { _mm_loadu_si128(b.as_ptr().cast()) }
    }

    fn store(v: __m128i) -> u128 {
        let mut b = [0u8; 16];
        // SAFETY: `b` is 16 writable bytes; the store is unaligned.
        unsafe { _mm_storeu_si128(b.as_mut_ptr().cast(), v) };
        u128::from_le_bytes(b)
    }

    /// Reduces the 256-bit product `hi:lo` to POLYVAL's product (a Montgomery reduction by
    /// x^128: two folds by the modulus's low terms).
    #[target_feature(enable = "pclmulqdq,sse2")]
    fn reduce(lo: __m128i, hi: __m128i) -> __m128i {
        // x^127 + x^126 + x^121 (as the high word 0xc2 << 56) and 1.
        let poly = _mm_set_epi64x(0xc200_0000_0000_0000_u64.cast_signed(), 1);
        let t = _mm_clmulepi64_si128::<0x10>(lo, poly);
        let lo = _mm_xor_si128(_mm_shuffle_epi32::<78>(lo), t);
        let t = _mm_clmulepi64_si128::<0x10>(lo, poly);
        let lo = _mm_xor_si128(_mm_shuffle_epi32::<78>(lo), t);
        _mm_xor_si128(lo, hi)
    }

    /// Splits the middle term of a schoolbook or Karatsuba product over `lo` and `hi`.
    #[target_feature(enable = "sse2")]
    fn fold_middle(lo: __m128i, mid: __m128i, hi: __m128i) -> (__m128i, __m128i) {
        (
            _mm_xor_si128(lo, _mm_slli_si128::<8>(mid)),
            _mm_xor_si128(hi, _mm_srli_si128::<8>(mid)),
        )
    }

    /// POLYVAL's product of two field elements.
    #[target_feature(enable = "pclmulqdq,sse2")]
    pub(super) fn dot(a: u128, b: u128) -> u128 {
        let (a, b) = (load(a), load(b));
        let lo = _mm_clmulepi64_si128::<0x00>(a, b);
        let hi = _mm_clmulepi64_si128::<0x11>(a, b);
        let mid = _mm_xor_si128(
            _mm_clmulepi64_si128::<0x01>(a, b),
            _mm_clmulepi64_si128::<0x10>(a, b),
        );
        let (lo, hi) = fold_middle(lo, mid, hi);
        store(reduce(lo, hi))
    }

    /// Continues the hash `s` over `data` (a multiple of [`WIDE_BYTES`]): per 512 bytes,
    /// `s' = (s + X1)·H^32 + X2·H^31 + … + X32·H`, the thirty-two products summed unreduced
    /// (Karatsuba, two blocks per 256-bit lane) and reduced once. One reduction per 512 bytes
    /// rather than per 256 takes the running hash's multiply and reduction (the loop's only
    /// dependency chain) off the critical path: 18.1 against 17.3 GB/s of thread CPU time in the
    /// bench's `mac` section on this machine's Zen 4, whose carry-less multiplies (three per
    /// block, the least Karatsuba needs) now bound the loop.
    #[target_feature(enable = "avx2,pclmulqdq,vpclmulqdq,sse2")]
    pub(super) fn wide(powers: &[u128; WIDE_BLOCKS], s: u128, data: &[u8]) -> u128 {
        debug_assert_eq!(data.len() % WIDE_BYTES, 0);
        // Lane j holds blocks 2j and 2j+1, so it is multiplied by H^(32-2j) and H^(31-2j);
        // `karatsuba[j]` holds each power's two halves added, for the middle products.
        let key: [__m256i; LANES] = std::array::from_fn(|j| {
            _mm256_set_m128i(
                load(powers[WIDE_BLOCKS - 2 - 2 * j]),
                load(powers[WIDE_BLOCKS - 1 - 2 * j]),
            )
        });
        let karatsuba = key.map(|k| _mm256_xor_si256(k, _mm256_shuffle_epi32::<78>(k)));
        let mut s = load(s);
        for chunk in data.chunks_exact(WIDE_BYTES) {
            let p = chunk.as_ptr();
            let (mut lo, mut mid, mut hi) = (
                _mm256_setzero_si256(),
                _mm256_setzero_si256(),
                _mm256_setzero_si256(),
            );
            // Lane 0 carries the running hash: added last, so the other lanes' multiplies do
            // not wait for the previous stride's reduction.
            for j in (0..LANES).rev() {
                // SAFETY: `chunk` holds `WIDE_BYTES` = LANES × 32 bytes, so bytes 32j..32j+32
                // are in it; the load is unaligned.
                let mut x = unsafe { _mm256_loadu_si256(p.add(32 * j).cast()) };
                if j == 0 {
                    x = _mm256_xor_si256(x, _mm256_zextsi128_si256(s));
                }
                lo = _mm256_xor_si256(lo, _mm256_clmulepi64_epi128::<0x00>(x, key[j]));
                hi = _mm256_xor_si256(hi, _mm256_clmulepi64_epi128::<0x11>(x, key[j]));
                let halves = _mm256_xor_si256(x, _mm256_shuffle_epi32::<78>(x));
                mid = _mm256_xor_si256(mid, _mm256_clmulepi64_epi128::<0x00>(halves, karatsuba[j]));
            }
            // Karatsuba's middle term: (a0+a1)(b0+b1) - a0·b0 - a1·b1, summed over the lanes.
            let mid = _mm256_xor_si256(mid, _mm256_xor_si256(lo, hi));
            let lanes =
                |v: __m256i| _mm_xor_si128(_mm256_castsi256_si128(v), _mm256_extracti128_si256::<1>(v));
            let (lo, hi) = fold_middle(lanes(lo), lanes(mid), lanes(hi));
            s = reduce(lo, hi);
        }
        store(s)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The product by its definition, one bit at a time: the reference both engines are
    /// tested against.
    fn dot_bitwise(a: u128, b: u128) -> u128 {
        // The 256-bit carry-less product (hi:lo).
        let (mut lo, mut hi) = (0u128, 0u128);
        for i in 0..128 {
            if (b >> i) & 1 == 1 {
                lo ^= a << i;
                if i > 0 {
                    hi ^= a >> (128 - i);
                }
            }
        }
        // Times x^-1, 128 times: make the value divisible by x by adding the modulus, then shift.
        const MODULUS_LOW: u128 = (1 << 127) | (1 << 126) | (1 << 121) | 1;
        for _ in 0..128 {
            if lo & 1 == 1 {
                lo ^= MODULUS_LOW;
                hi ^= 1;
            }
            lo = (lo >> 1) | ((hi & 1) << 127);
            hi >>= 1;
        }
        lo
    }

    fn hex(s: &str) -> [u8; 16] {
        std::array::from_fn(|i| u8::from_str_radix(&s[2 * i..2 * i + 2], 16).unwrap())
    }

    fn reference(h: [u8; 16], data: &[u8]) -> [u8; 16] {
        let h = u128::from_le_bytes(h);
        let mut s = 0u128;
        for block in data.chunks(BLOCK) {
            let mut x = [0u8; BLOCK];
            x[..block.len()].copy_from_slice(block);
            s = dot_bitwise(s ^ u128::from_le_bytes(x), h);
        }
        s.to_le_bytes()
    }

    /// RFC 8452, appendix A: POLYVAL(H, X_1, X_2).
    #[test]
    fn the_rfc_8452_example_hashes_as_published() {
        let h = hex("25629347589242761d31f826ba4b757b");
        let mut x = hex("4f4f95668c83dfb6401762bb2d01a262").to_vec();
        x.extend_from_slice(&hex("d1a24ddd2721d006bbe45f20d3c9f362"));
        let expected = hex("f7a3b47b846119fae5b7866cf5e5b77e");
        assert_eq!(reference(h, &x), expected);
        assert_eq!(Polyval::new(h).hash(&x), expected);
    }

    /// The machine's path (wide, narrow or bit-serial) agrees with the definition over lengths
    /// around every block and reduction boundary, and for several keys.
    #[test]
    fn the_fast_paths_agree_with_the_definition() {
        for (k, h) in [
            hex("25629347589242761d31f826ba4b757b"),
            [0xff; 16],
            [1; 16],
            std::array::from_fn(|i| (i as u8).wrapping_mul(97) ^ 0x3c),
        ]
        .into_iter()
        .enumerate()
        {
            let p = Polyval::new(h);
            for len in [
                0,
                1,
                15,
                16,
                17,
                255,
                256,
                257,
                511,
                512,
                513,
                1000,
                1023,
                1024,
                1025,
                4096,
                4096 + 240,
            ] {
                let data: Vec<u8> = (0..len).map(|i| (i * 31 + k * 7 + 5) as u8).collect();
                assert_eq!(p.hash(&data), reference(h, &data), "key {k}, {len} bytes");
            }
        }
    }

    /// Bytes of one wide stride (of a typical stride where the wide path does not exist).
    fn x86_stride() -> usize {
        #[cfg(target_arch = "x86_64")]
        return x86::WIDE_BYTES;
        #[cfg(not(target_arch = "x86_64"))]
        512
    }

    /// The machine's path agrees with RustCrypto's `polyval`, an independent implementation,
    /// over every length to just past two wide strides and a few long ones, under several keys.
    #[test]
    fn the_fast_paths_agree_with_rustcrypto_polyval() {
        use polyval::universal_hash::UniversalHash;
        for k in 0..4u8 {
            let h: [u8; 16] =
                std::array::from_fn(|i| (i as u8).wrapping_mul(61).wrapping_add(k.wrapping_mul(89)) ^ 0xa5);
            let ours = Polyval::new(h);
            let theirs = polyval::Polyval::new(&h.into());
            let data: Vec<u8> = (0..70_000usize)
                .map(|i| (i * 167 + usize::from(k) + i / 509) as u8)
                .collect();
            // Two wide strides and more, then a few long ones.
            for len in (0..=2 * x86_stride() + 17).chain([4096 + 48, 65_536 + 3, 70_000]) {
                let mut t = theirs.clone();
                t.update_padded(&data[..len]);
                assert_eq!(
                    ours.hash(&data[..len]),
                    <[u8; 16]>::from(t.finalize()),
                    "key {k}, {len} bytes"
                );
            }
        }
    }

    /// The engine a machine without VPCLMULQDQ takes (the crate), whatever this machine has.
    #[test]
    fn the_portable_engine_agrees_with_the_definition() {
        let h = hex("25629347589242761d31f826ba4b757b");
        let data: Vec<u8> = (0..700).map(|i| (i * 13 + 1) as u8).collect();
        for len in [0, 1, 16, 17, 256, 257, 700] {
            assert_eq!(
                Polyval::portable(h).hash(&data[..len]),
                reference(h, &data[..len])
            );
        }
    }
}
