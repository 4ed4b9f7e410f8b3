//! The helpers tier factories use to read their options: [`parse_options`] turns a tier's TOML
//! table into a typed struct with errors that name the offending key, and [`ByteSize`] /
//! [`HumanDuration`] read sizes (`"64GiB"`) and durations (`"500ms"`). Chain files themselves
//! are the `tiering-config` crate's.

mod units;

pub use units::{ByteSize, HumanDuration, UnitError};

use serde::de::DeserializeOwned;

use crate::error::TierError;

/// Deserialises a tier's options table into `T` (declare `T` with
/// `#[serde(deny_unknown_fields)]`). The error is a [`TierError::Config`] whose message names
/// the offending key in backquotes (serde names unknown and missing keys itself; for a bad value
/// the key is found by its value, or by parsing the table without each key in turn, and
/// prefixed), which the chain builder uses to point at the key's line.
///
/// A value of the wrong type is reported as what was expected and what was found, the found
/// value described from the table (`expected u16, found a string "two"`). For an enum-typed
/// option (a `#[derive(Deserialize)]` enum of unit variants, which TOML reads from a string)
/// the expected side lists the names the enum accepts, found by asking the enum about a name it
/// cannot know: `expected a string ("never", "batch" or "always"), found an integer 3`. A type
/// with its own `Deserialize` gets the same wording by saying `a string ("a", "b" or "c")` in its
/// visitor's `expecting`.
///
/// # Errors
/// An unknown key, a missing key, or a value of the wrong type or format.
pub fn parse_options<T: DeserializeOwned>(options: &toml::Table) -> Result<T, TierError> {
    options.clone().try_into().map_err(|e: toml::de::Error| {
        let message = e.message().trim().to_owned();
        if quoted_words(&message).any(|w| options.contains_key(w)) {
            return TierError::Config(message);
        }
        let key = key_by_value(options, &message).or_else(|| culprit_by_removal::<T>(options));
        let message = match key {
            Some(key) => format!("`{key}`: {}", reword_type_error::<T>(options, key, message)),
            None => message,
        };
        TierError::Config(message)
    })
}

/// The key whose removal makes `options` parse (or only miss that key): the one a message that
/// names no key is about (serde's "invalid type: string \"two\", expected u16" does not).
fn culprit_by_removal<T: DeserializeOwned>(options: &toml::Table) -> Option<&str> {
    options.keys().map(String::as_str).find(|&key| {
        let mut without = options.clone();
        without.remove(key);
        match without.try_into::<T>() {
            Ok(_) => true,
            Err(e) => e.message().contains(&format!("missing field `{key}`")),
        }
    })
}

/// The backquoted words of an error message.
pub fn quoted_words(message: &str) -> impl Iterator<Item = &str> {
    message.split('`').skip(1).step_by(2)
}

/// The key whose value the message quotes (serde quotes a bad value, not its key).
fn key_by_value<'a>(options: &'a toml::Table, message: &str) -> Option<&'a str> {
    quoted_words(message).find_map(|word| {
        options.iter().find_map(|(key, value)| {
            let rendered = match value {
                toml::Value::String(s) => s.clone(),
                other => other.to_string(),
            };
            (rendered == word).then_some(key.as_str())
        })
    })
}

/// Rewords serde's "invalid type: U, expected E" about `key` as "expected E, found V", V being
/// the table's value described plainly. TOML's message for an enum given a non-string ("invalid
/// type: unit variant, expected string only") names neither side truly: it becomes "expected a
/// string (the enum's names), found …". Any other message is returned as it is.
fn reword_type_error<T: DeserializeOwned>(options: &toml::Table, key: &str, message: String) -> String {
    let Some((unexpected, expected)) = message
        .strip_prefix("invalid type: ")
        .and_then(|rest| rest.split_once(", expected "))
    else {
        return message;
    };
    let Some(value) = options.get(key) else {
        return message;
    };
    let enum_shaped = unexpected == "unit variant" || expected == "string only";
    if enum_shaped {
        if matches!(value, toml::Value::String(_) | toml::Value::Table(_)) {
            // A string or table reaches the enum itself: this message is about something else.
            return message;
        }
        match enum_names::<T>(options, key) {
            Some(names) => format!("expected a string ({names}), found {}", describe(value)),
            None => format!("expected a string, found {}", describe(value)),
        }
    } else if same_kind(unexpected, value) {
        format!("expected {expected}, found {}", describe(value))
    } else {
        // The value is a table or array and the error is about something inside it.
        message
    }
}

/// The names an enum-typed option accepts, as `"a", "b" or "c"`: serde's own list, from the
/// error for a name no enum has.
fn enum_names<T: DeserializeOwned>(options: &toml::Table, key: &str) -> Option<String> {
    const PROBE: &str = "\u{1}kvtier: not a variant";
    let mut probe = options.clone();
    probe.insert(key.to_owned(), toml::Value::String(PROBE.to_owned()));
    let e = probe.try_into::<T>().err()?;
    let rest = e
        .message()
        .strip_prefix(&format!("unknown variant `{PROBE}`, expected "))?
        .to_owned();
    let names: Vec<String> = quoted_words(&rest).map(|n| format!("{n:?}")).collect();
    match names.as_slice() {
        [] => None,
        [one] => Some(one.clone()),
        [init @ .., last] => Some(format!("{} or {last}", init.join(", "))),
    }
}

/// Whether serde's description of an unexpected value (`integer \`3\``, `string "x"`, …) is of
/// the same kind as `value`.
fn same_kind(unexpected: &str, value: &toml::Value) -> bool {
    let kind = match value {
        toml::Value::String(_) => "string",
        toml::Value::Integer(_) => "integer",
        toml::Value::Float(_) => "floating point",
        toml::Value::Boolean(_) => "boolean",
        toml::Value::Array(_) => "sequence",
        toml::Value::Table(_) => "map",
        toml::Value::Datetime(_) => return false,
    };
    unexpected.starts_with(kind)
}

/// A TOML value as an error message names it: its type, then the value when it is short.
fn describe(value: &toml::Value) -> String {
    match value {
        toml::Value::String(s) => format!("a string {s:?}"),
        toml::Value::Integer(i) => format!("an integer {i}"),
        toml::Value::Float(f) => format!("a float {f}"),
        toml::Value::Boolean(b) => format!("a boolean {b}"),
        toml::Value::Datetime(d) => format!("a date-time {d}"),
        toml::Value::Array(_) => "an array".to_owned(),
        toml::Value::Table(_) => "a table".to_owned(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[derive(Debug, serde::Deserialize)]
    #[serde(deny_unknown_fields)]
    #[allow(dead_code)]
    struct Opts {
        capacity: ByteSize,
        #[serde(default)]
        eviction: Option<String>,
        #[serde(default)]
        wait: Option<HumanDuration>,
        #[serde(default)]
        workers: Option<u16>,
        #[serde(default)]
        sync: Option<Sync>,
    }

    #[derive(Debug, serde::Deserialize)]
    #[serde(rename_all = "lowercase")]
    enum Sync {
        Never,
        Batch,
        Always,
    }

    fn table(s: &str) -> toml::Table {
        s.parse().unwrap()
    }

    #[test]
    fn errors_name_the_offending_key() {
        let err = |s: &str| match parse_options::<Opts>(&table(s)) {
            Err(TierError::Config(m)) => m,
            other => panic!("expected a config error, got {other:?}"),
        };
        let m = err("capacity = \"1GiB\"\ncapasity = 3");
        assert!(m.contains("unknown field `capasity`"), "{m}");
        assert!(err("eviction = \"x\"").contains("missing field `capacity`"));
        let m = err("capacity = \"1 gigs\"");
        assert!(m.starts_with("`capacity`: invalid size `1 gigs`"), "{m}");
        let m = err("capacity = true");
        assert!(m.starts_with("`capacity`: expected "), "{m}");
        assert!(m.ends_with(", found a boolean true"), "{m}");
        let m = err("capacity = 1\nworkers = \"two\"");
        assert_eq!(m, "`workers`: expected u16, found a string \"two\"");
        let m = err("capacity = 1\nwait = \"3\"");
        assert!(m.starts_with("`wait`: invalid duration `3`"), "{m}");
    }

    #[test]
    fn an_enum_value_of_the_wrong_type_is_named_with_the_enums_names() {
        let err = |s: &str| match parse_options::<Opts>(&table(s)) {
            Err(TierError::Config(m)) => m,
            other => panic!("expected a config error, got {other:?}"),
        };
        assert_eq!(
            err("capacity = 1\nsync = 3"),
            "`sync`: expected a string (\"never\", \"batch\" or \"always\"), found an integer 3"
        );
        assert_eq!(
            err("capacity = 1\nsync = true"),
            "`sync`: expected a string (\"never\", \"batch\" or \"always\"), found a boolean true"
        );
        assert_eq!(
            err("capacity = 1\nsync = [\"never\"]"),
            "`sync`: expected a string (\"never\", \"batch\" or \"always\"), found an array"
        );
        // A string that names no variant keeps serde's message, which lists them.
        let m = err("capacity = 1\nsync = \"sometimes\"");
        assert!(
            m.contains("unknown variant `sometimes`, expected one of `never`"),
            "{m}"
        );
        assert!(m.starts_with("`sync`: "), "{m}");
    }

    #[test]
    fn valid_options_parse() {
        let o: Opts = parse_options(&table("capacity = \"2GiB\"\nwait = \"1ms\"")).unwrap();
        assert_eq!(o.capacity, ByteSize(2 << 30));
        assert_eq!(o.wait, Some(HumanDuration(std::time::Duration::from_millis(1))));
    }
}
