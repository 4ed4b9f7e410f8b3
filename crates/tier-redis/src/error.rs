//! Errors of the Redis tier.

use tiering_core::TierError;

/// Why the tier could not be built, or why an operation on the server failed.
#[derive(Debug, thiserror::Error)]
pub enum RedisTierError {
    /// An option is missing, out of range or inconsistent. The message quotes the key in
    /// backquotes so chain errors point at its line.
    #[error("{0}")]
    InvalidOptions(String),
    /// `password_env` names an environment variable that is not set (or not valid UTF-8).
    #[error("`password_env`: environment variable `{var}` is not set; export the Redis password in it")]
    MissingPassword {
        /// The variable's name.
        var: String,
    },
    /// The server refused the credentials.
    #[error("cannot authenticate to Redis at {url}: {source}")]
    Auth {
        /// Where (the URL, without its password).
        url: String,
        /// The server's answer.
        source: redis::RedisError,
    },
    /// The server could not be reached or answered with an error.
    #[error("Redis at {url}: {what}: {source}")]
    Server {
        /// Where (the URL, without its password).
        url: String,
        /// What the tier was doing.
        what: &'static str,
        /// The client's error.
        source: redis::RedisError,
    },
    /// A thread could not be started.
    #[error("cannot start the Redis tier's threads: {0}")]
    Thread(#[from] std::io::Error),
}

impl From<RedisTierError> for TierError {
    fn from(e: RedisTierError) -> Self {
        match e {
            RedisTierError::InvalidOptions(_) | RedisTierError::MissingPassword { .. } => {
                TierError::Config(e.to_string())
            }
            RedisTierError::Thread(io) => TierError::Io(io),
            other => TierError::Other(other.to_string()),
        }
    }
}
