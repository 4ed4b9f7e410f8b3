//! Byte sizes in configuration files: an integer number of bytes, or a string such as `"64GiB"`,
//! `"512 MiB"`, `"1.5GB"` or `"4096"`.

use std::fmt;
use std::str::FromStr;

use serde::Deserialize;
use serde::de::{self, Deserializer, Visitor};

/// A size in bytes that deserialises from an integer or from a string with a unit.
///
/// Units are case-insensitive: `B`; binary `K`/`KiB`, `M`/`MiB`, `G`/`GiB`, `T`/`TiB` (powers of
/// 1024); decimal `KB`, `MB`, `GB`, `TB` (powers of 1000). A fractional number is allowed with a
/// unit and rounded down to whole bytes.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct ByteSize(pub u64);

impl ByteSize {
    /// The number of bytes.
    #[must_use]
    pub const fn bytes(self) -> u64 {
        self.0
    }
}

/// Why a size string was refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("invalid size {input:?}: {reason} (expected bytes or a number with a unit such as \"64GiB\")")]
pub struct ParseSizeError {
    input: String,
    reason: &'static str,
}

fn unit_multiplier(unit: &str) -> Option<u64> {
    const KIB: u64 = 1 << 10;
    let m = match unit.to_ascii_lowercase().as_str() {
        "" | "b" => 1,
        "k" | "kib" => KIB,
        "m" | "mib" => KIB * KIB,
        "g" | "gib" => KIB * KIB * KIB,
        "t" | "tib" => KIB * KIB * KIB * KIB,
        "kb" => 1_000,
        "mb" => 1_000_000,
        "gb" => 1_000_000_000,
        "tb" => 1_000_000_000_000,
        _ => return None,
    };
    Some(m)
}

impl FromStr for ByteSize {
    type Err = ParseSizeError;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let err = |reason| ParseSizeError {
            input: s.to_owned(),
            reason,
        };
        let trimmed = s.trim();
        let split = trimmed
            .find(|c: char| !(c.is_ascii_digit() || c == '.' || c == '_'))
            .unwrap_or(trimmed.len());
        let (number, unit) = trimmed.split_at(split);
        let number: String = number.chars().filter(|&c| c != '_').collect();
        if number.is_empty() {
            return Err(err("no number"));
        }
        let mult = unit_multiplier(unit.trim()).ok_or_else(|| err("unknown unit"))?;
        if let Ok(whole) = number.parse::<u64>() {
            return whole
                .checked_mul(mult)
                .map(ByteSize)
                .ok_or_else(|| err("too large"));
        }
        let value: f64 = number.parse().map_err(|_| err("not a number"))?;
        let bytes = value * mult as f64;
        if !bytes.is_finite() || bytes < 0.0 || bytes >= u64::MAX as f64 {
            return Err(err("too large"));
        }
        // Truncation is the documented rounding (down to whole bytes).
        #[allow(clippy::cast_possible_truncation, clippy::cast_sign_loss)]
        Ok(ByteSize(bytes as u64))
    }
}

impl fmt::Display for ByteSize {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        const UNITS: [(&str, u64); 4] = [
            ("TiB", 1 << 40),
            ("GiB", 1 << 30),
            ("MiB", 1 << 20),
            ("KiB", 1 << 10),
        ];
        for (name, size) in UNITS {
            if self.0 >= size && self.0 % size == 0 {
                return write!(f, "{}{name}", self.0 / size);
            }
        }
        write!(f, "{}B", self.0)
    }
}

impl<'de> Deserialize<'de> for ByteSize {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        struct SizeVisitor;

        impl Visitor<'_> for SizeVisitor {
            type Value = ByteSize;

            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("a byte count or a size string such as \"64GiB\"")
            }

            fn visit_u64<E: de::Error>(self, v: u64) -> Result<ByteSize, E> {
                Ok(ByteSize(v))
            }

            fn visit_i64<E: de::Error>(self, v: i64) -> Result<ByteSize, E> {
                u64::try_from(v)
                    .map(ByteSize)
                    .map_err(|_| E::custom("a size cannot be negative"))
            }

            fn visit_str<E: de::Error>(self, v: &str) -> Result<ByteSize, E> {
                v.parse().map_err(E::custom)
            }
        }

        deserializer.deserialize_any(SizeVisitor)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_binary_decimal_and_plain_sizes() {
        let cases = [
            ("64GiB", 64u64 << 30),
            ("64 gib", 64 << 30),
            ("2M", 2 << 20),
            ("1.5KiB", 1536),
            ("1GB", 1_000_000_000),
            ("4096", 4096),
            ("1_000B", 1000),
            ("0", 0),
        ];
        for (input, want) in cases {
            assert_eq!(input.parse::<ByteSize>(), Ok(ByteSize(want)), "{input}");
        }
    }

    #[test]
    fn refuses_garbage_units_and_overflow() {
        for bad in ["", "GiB", "12 parsecs", "1.2.3G", "99999999999TiB", "-5"] {
            assert!(bad.parse::<ByteSize>().is_err(), "{bad} should be refused");
        }
    }

    #[test]
    fn displays_the_largest_exact_unit() {
        assert_eq!(ByteSize(64 << 30).to_string(), "64GiB");
        assert_eq!(ByteSize(1536).to_string(), "1536B");
        assert_eq!(ByteSize(3 << 20).to_string(), "3MiB");
    }
}
