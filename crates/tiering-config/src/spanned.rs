//! Values out of the spanned TOML parse tree: the chain and `[cost]` parsers keep the tree (its
//! spans give errors their file:line) and turn one entry at a time into a plain TOML value.

use serde::Deserialize;
use toml::Spanned;
use toml::de::{DeValue, ValueDeserializer};

/// The plain TOML value of one spanned entry; `Err` carries the parser's message.
pub(super) fn to_value(v: &Spanned<DeValue<'_>>) -> Result<toml::Value, String> {
    toml::Value::deserialize(ValueDeserializer::from(v.clone())).map_err(|e| e.message().to_owned())
}
