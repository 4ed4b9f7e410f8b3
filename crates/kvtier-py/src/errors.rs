//! Python exceptions: every Rust error becomes one of these, carrying the Rust message.

use pyo3::create_exception;
use pyo3::exceptions::PyException;
use pyo3::prelude::*;

create_exception!(
    kvtier,
    KvtierError,
    PyException,
    "An error reported by kvtier (a contract violation, a failed tier, a shut-down manager)."
);
create_exception!(
    kvtier,
    ConfigError,
    KvtierError,
    "A chain file or TOML text that cannot be parsed, resolved or built."
);
create_exception!(
    kvtier,
    StepError,
    KvtierError,
    "A step used wrongly: a second step on the same thread, a call on a released step, or a \
     handle call that would wait for the step this thread holds."
);

/// A [`KvtierError`] with the error's message.
pub(crate) fn kvtier_err(e: impl std::fmt::Display) -> PyErr {
    KvtierError::new_err(e.to_string())
}

/// A [`ConfigError`] with the error's message.
pub(crate) fn config_err(e: impl std::fmt::Display) -> PyErr {
    ConfigError::new_err(e.to_string())
}
