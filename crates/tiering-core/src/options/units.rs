//! Human-readable sizes (`"64GiB"`) and durations (`"1ms"`) for chain files and tier options.

use std::fmt;
use std::str::FromStr;
use std::time::Duration;

use serde::de::{self, Deserializer, Visitor};
use serde::{Deserialize, Serialize, Serializer};

/// A size in bytes, written in a chain file as an integer (bytes) or a string with a unit:
/// `B`, `KiB`/`MiB`/`GiB`/`TiB` (powers of 1024), `KB`/`MB`/`GB`/`TB` (powers of 1000), or the
/// short forms `K`/`M`/`G`/`T` (powers of 1024). A decimal number is allowed (`"1.5GiB"`) and
/// rounded down to whole bytes. Whitespace between number and unit is allowed.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct ByteSize(pub u64);

impl ByteSize {
    /// The size in bytes.
    #[must_use]
    pub fn bytes(self) -> u64 {
        self.0
    }

    /// The size in bytes as a `usize` (saturating on 32-bit targets).
    #[must_use]
    pub fn as_usize(self) -> usize {
        usize::try_from(self.0).unwrap_or(usize::MAX)
    }
}

/// Why a size or a duration could not be parsed.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("invalid {what} `{input}`: {reason}")]
pub struct UnitError {
    /// `"size"` or `"duration"`.
    pub what: &'static str,
    /// The text as written.
    pub input: String,
    /// What is wrong with it.
    pub reason: String,
}

/// Splits `"1.5 GiB"` into the number and the unit.
fn split_number(s: &str) -> (&str, &str) {
    let s = s.trim();
    let end = s
        .find(|c: char| !(c.is_ascii_digit() || c == '.' || c == '_'))
        .unwrap_or(s.len());
    (s[..end].trim(), s[end..].trim())
}

/// Parses the numeric part into an integer part and a fraction in `[0, 1)`.
fn parse_number(num: &str) -> Option<(u64, f64)> {
    let cleaned: String = num.chars().filter(|&c| c != '_').collect();
    if cleaned.is_empty() || cleaned.starts_with('.') || cleaned.ends_with('.') {
        return None;
    }
    match cleaned.split_once('.') {
        None => Some((cleaned.parse().ok()?, 0.0)),
        Some((int, frac)) => {
            let whole: u64 = int.parse().ok()?;
            let frac: f64 = format!("0.{frac}").parse().ok()?;
            Some((whole, frac))
        }
    }
}

/// `whole + frac` times `unit`, rounded down; `None` on overflow.
fn scale(whole: u64, frac: f64, unit: u64) -> Option<u64> {
    let base = whole.checked_mul(unit)?;
    // The fraction contributes less than one `unit`, so f64 precision loss is below a byte for
    // every realistic unit.
    #[allow(
        clippy::cast_possible_truncation,
        clippy::cast_sign_loss,
        clippy::cast_precision_loss
    )]
    let extra = (frac * unit as f64) as u64;
    base.checked_add(extra)
}

impl FromStr for ByteSize {
    type Err = UnitError;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let err = |reason: &str| UnitError {
            what: "size",
            input: s.to_owned(),
            reason: reason.to_owned(),
        };
        let (num, unit) = split_number(s);
        let (whole, frac) =
            parse_number(num).ok_or_else(|| err("expected a number followed by a unit, like \"64GiB\""))?;
        let mult: u64 = match unit {
            "" | "B" | "b" => 1,
            "K" | "k" | "KiB" | "Ki" => 1 << 10,
            "M" | "MiB" | "Mi" => 1 << 20,
            "G" | "GiB" | "Gi" => 1 << 30,
            "T" | "TiB" | "Ti" => 1 << 40,
            "KB" | "kB" => 1_000,
            "MB" => 1_000_000,
            "GB" => 1_000_000_000,
            "TB" => 1_000_000_000_000,
            _ => {
                return Err(err("unknown unit (use B, KiB, MiB, GiB, TiB, or KB, MB, GB, TB)"));
            }
        };
        if mult == 1 && frac != 0.0 {
            return Err(err("a size in bytes must be a whole number"));
        }
        scale(whole, frac, mult)
            .map(ByteSize)
            .ok_or_else(|| err("too large"))
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

impl Serialize for ByteSize {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.collect_str(self)
    }
}

impl<'de> Deserialize<'de> for ByteSize {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V;
        impl Visitor<'_> for V {
            type Value = ByteSize;

            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("a size like \"64GiB\" or a number of bytes")
            }

            fn visit_u64<E: de::Error>(self, v: u64) -> Result<ByteSize, E> {
                Ok(ByteSize(v))
            }

            fn visit_i64<E: de::Error>(self, v: i64) -> Result<ByteSize, E> {
                u64::try_from(v)
                    .map(ByteSize)
                    .map_err(|_| E::custom(format!("invalid size `{v}`: must not be negative")))
            }

            fn visit_str<E: de::Error>(self, v: &str) -> Result<ByteSize, E> {
                v.parse().map_err(E::custom)
            }
        }
        d.deserialize_any(V)
    }
}

/// A duration, written in a chain file as a string with a unit: `ns`, `us` (or `µs`), `ms`, `s`,
/// `m` (minutes), `h`. A decimal number is allowed (`"1.5s"`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct HumanDuration(pub Duration);

impl HumanDuration {
    /// The duration.
    #[must_use]
    pub fn get(self) -> Duration {
        self.0
    }
}

impl FromStr for HumanDuration {
    type Err = UnitError;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let err = |reason: &str| UnitError {
            what: "duration",
            input: s.to_owned(),
            reason: reason.to_owned(),
        };
        let (num, unit) = split_number(s);
        let (whole, frac) =
            parse_number(num).ok_or_else(|| err("expected a number followed by a unit, like \"1ms\""))?;
        let nanos_per: u64 = match unit {
            "ns" => 1,
            "us" | "µs" => 1_000,
            "ms" => 1_000_000,
            "s" => 1_000_000_000,
            "m" | "min" => 60_000_000_000,
            "h" => 3_600_000_000_000,
            "" => return Err(err("a unit is required (ns, us, ms, s, m, h)")),
            _ => return Err(err("unknown unit (use ns, us, ms, s, m, h)")),
        };
        scale(whole, frac, nanos_per)
            .map(|n| HumanDuration(Duration::from_nanos(n)))
            .ok_or_else(|| err("too large"))
    }
}

impl fmt::Display for HumanDuration {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let n = self.0.as_nanos();
        const UNITS: [(&str, u128); 4] = [("s", 1_000_000_000), ("ms", 1_000_000), ("us", 1_000), ("ns", 1)];
        for (name, size) in UNITS {
            if n >= size && n % size == 0 {
                return write!(f, "{}{name}", n / size);
            }
        }
        f.write_str("0s")
    }
}

impl Serialize for HumanDuration {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.collect_str(self)
    }
}

impl<'de> Deserialize<'de> for HumanDuration {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V;
        impl Visitor<'_> for V {
            type Value = HumanDuration;

            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("a duration like \"1ms\"")
            }

            fn visit_str<E: de::Error>(self, v: &str) -> Result<HumanDuration, E> {
                v.parse().map_err(E::custom)
            }
        }
        d.deserialize_str(V)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes_parse_with_binary_and_decimal_units() {
        let p = |s: &str| s.parse::<ByteSize>().map(ByteSize::bytes);
        assert_eq!(p("64GiB"), Ok(64 << 30));
        assert_eq!(p("2 GiB"), Ok(2 << 30));
        assert_eq!(p("512MiB"), Ok(512 << 20));
        assert_eq!(p("4K"), Ok(4096));
        assert_eq!(p("1GB"), Ok(1_000_000_000));
        assert_eq!(p("1.5KiB"), Ok(1536));
        assert_eq!(p("1_024"), Ok(1024));
        assert_eq!(p("0"), Ok(0));
        for bad in [
            "",
            "GiB",
            "64 gigs",
            "1.5",
            "-1GiB",
            "1..5GiB",
            "99999999999TiB",
            "1.GiB",
        ] {
            let e = p(bad).unwrap_err();
            assert_eq!(e.what, "size");
            assert!(e.to_string().contains(&format!("`{bad}`")), "{e}");
        }
    }

    #[test]
    fn durations_parse_with_units() {
        let p = |s: &str| s.parse::<HumanDuration>().map(HumanDuration::get);
        assert_eq!(p("1ms"), Ok(Duration::from_millis(1)));
        assert_eq!(p("250us"), Ok(Duration::from_micros(250)));
        assert_eq!(p("1.5s"), Ok(Duration::from_millis(1500)));
        assert_eq!(p("2m"), Ok(Duration::from_secs(120)));
        assert_eq!(p("10 ns"), Ok(Duration::from_nanos(10)));
        for bad in ["1", "ms", "1 fortnight", "-1ms"] {
            assert_eq!(p(bad).unwrap_err().what, "duration", "{bad}");
        }
    }

    #[test]
    fn display_round_trips() {
        for s in ["64GiB", "3MiB", "1000B", "1KiB"] {
            assert_eq!(s.parse::<ByteSize>().unwrap().to_string(), s);
        }
        for s in ["1ms", "250us", "3s", "7ns"] {
            assert_eq!(s.parse::<HumanDuration>().unwrap().to_string(), s);
        }
    }

    #[test]
    fn deserialize_from_toml_values() {
        #[derive(Deserialize)]
        struct T {
            a: ByteSize,
            b: ByteSize,
            d: HumanDuration,
        }
        let t: T = toml::from_str("a = 4096\nb = \"1MiB\"\nd = \"5ms\"").unwrap();
        assert_eq!((t.a.0, t.b.0, t.d.0), (4096, 1 << 20, Duration::from_millis(5)));
        let e = toml::from_str::<T>("a = -4\nb = \"1MiB\"\nd = \"5ms\"")
            .err()
            .unwrap();
        assert!(e.to_string().contains("negative"), "{e}");
    }
}
