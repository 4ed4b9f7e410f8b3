//! Chain-file queries for processes that open what a manager elsewhere built (vLLM's worker
//! processes): read with the same parser the manager uses, so both sides agree on every path.

use std::path::PathBuf;

use pyo3::prelude::*;
use tiering_config::ChainConfig;

use crate::errors::config_err;

/// The arena file a chain's primary tier shares (`[primary] shared_memory`, with `${tmpdir}`
/// expanded as the manager expands it), or `None` when the arena is private to the manager.
///
/// Raises `ConfigError` for a chain the manager would refuse, and for a `shared_memory` that
/// uses `${pid}`: that names a different file in every process, so no other process could open
/// the manager's arena by it.
#[pyfunction]
#[allow(clippy::needless_pass_by_value, reason = "pyo3 extracts an owned path")]
pub(crate) fn chain_arena_path(py: Python<'_>, path: PathBuf) -> PyResult<Option<String>> {
    let config = py.detach(|| ChainConfig::load(&path)).map_err(config_err)?;
    let Some(value) = config.primary.options.get("shared_memory") else {
        return Ok(None);
    };
    let Some(expanded) = value.as_str() else {
        return Err(config_err(format!(
            "{}: [primary] shared_memory must be a path string",
            path.display()
        )));
    };
    // The parser has expanded `${pid}` already: look at the written value.
    let raw = std::fs::read_to_string(&path)
        .ok()
        .and_then(|text| text.parse::<toml::Table>().ok())
        .and_then(|doc| {
            doc.get("primary")?
                .get("shared_memory")?
                .as_str()
                .map(str::to_owned)
        });
    if raw.is_some_and(|r| r.contains("${pid}")) {
        return Err(config_err(format!(
            "{}: [primary] shared_memory uses ${{pid}}, which names a different file in every \
             process: worker processes could not open the manager's arena; use a fixed path",
            path.display()
        )));
    }
    Ok(Some(expanded.to_owned()))
}
