//! [`ConfigError`]: a key or value `Config::parse` refuses, or a configuration `validate` refuses.

use super::{ENV_VAR, KEYS, NO_EFFECT_KEYS};
use std::fmt;

/// A configuration string that could not be applied.
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum ConfigError {
    /// A key that is not in [`KEYS`] nor in [`NO_EFFECT_KEYS`]; its message lists both.
    UnknownKey(String),
    /// A known key with a value it does not accept.
    BadValue {
        /// The key.
        key: String,
        /// The value as written.
        value: String,
        /// What the key accepts.
        expected: String,
    },
    /// An entry without a `:` separating key and value.
    Malformed(String),
    /// Values that are fine alone but contradict each other.
    Inconsistent(String),
    /// [`Config::from_env`]: the environment variable `var` holds a configuration that `error`
    /// refuses. The other variants do not name where the string came from ([`Config::parse`],
    /// the setters, a command line), so they name no variable. Its `Display` names the
    /// variable only; `error` is its [`source`](std::error::Error::source), printed after it by
    /// whatever prints the chain.
    ///
    /// [`Config::from_env`]: super::Config::from_env
    /// [`Config::parse`]: super::Config::parse
    Env {
        /// The variable ([`ENV_VAR`]).
        var: &'static str,
        /// What is wrong with its value.
        error: Box<ConfigError>,
    },
}

impl fmt::Display for ConfigError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        // Where the string came from is the caller's to say (`Env` for `Config::from_env`).
        // BROKEN (`config_errors_blame_env`): every error said `in TIDEPOOL_ALLOC_CONF`, also
        // for `Config::parse`, a `--config` flag and the setters.
        let at = if cfg!(tidepool_broken = "config_errors_blame_env") {
            format!(" in {ENV_VAR}")
        } else {
            String::new()
        };
        match self {
            ConfigError::UnknownKey(k) => {
                let keys: Vec<&str> = KEYS.iter().map(|(k, _)| *k).collect();
                write!(f, "unknown key `{k}`{at}; valid keys: {}", keys.join(", "))?;
                // PyTorch's keys that are accepted with no effect are valid too: a user who
                // reads the list for one of them would think it refused.
                // BROKEN (`unknown_key_hides_no_effect`): not listed.
                if cfg!(tidepool_broken = "unknown_key_hides_no_effect") {
                    return Ok(());
                }
                let ignored: Vec<&str> = NO_EFFECT_KEYS.iter().map(|(k, _)| *k).collect();
                write!(f, "; accepted with no effect (PyTorch's): {}", ignored.join(", "))
            }
            ConfigError::BadValue { key, value, expected } => {
                write!(f, "bad value `{value}` for `{key}`{at}: expected {expected}")
            }
            ConfigError::Malformed(entry) => {
                write!(f, "malformed entry `{entry}`{at}: expected key:value")
            }
            ConfigError::Inconsistent(why) if at.is_empty() => {
                write!(f, "inconsistent configuration: {why}")
            }
            ConfigError::Inconsistent(why) => write!(f, "inconsistent {ENV_VAR}: {why}"),
            // The variable only: what is wrong with its value is `source()`'s to say, once.
            // BROKEN (`error_text_doubled`): the inner message again.
            ConfigError::Env { var, error } if cfg!(tidepool_broken = "error_text_doubled") => {
                write!(f, "{var} holds an invalid configuration: {error}")
            }
            ConfigError::Env { var, .. } => write!(f, "{var} holds an invalid configuration"),
        }
    }
}

impl std::error::Error for ConfigError {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        match self {
            ConfigError::Env { error, .. } => Some(&**error),
            _ => None,
        }
    }
}
