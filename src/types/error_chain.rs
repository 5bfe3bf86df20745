//! [`ErrorChain`]: an error and each of its sources, printed once each.
//!
//! tidepool's wrapper errors ([`AllocError::Device`](crate::AllocError::Device),
//! [`AllocError::Config`](crate::AllocError::Config), [`ConfigError::Env`](crate::ConfigError),
//! [`HostAllocError::Device`](crate::HostAllocError)…) say what failed at their own layer and
//! leave the inner error to [`source()`](std::error::Error::source), as the Rust API guidelines
//! ask, so `to_string()` alone drops the inner error. This adapter prints the whole chain, as
//! anyhow's `{:#}` does, for code that has no error-reporting crate (the CLI, examples, tests).

use std::error::Error;
use std::fmt;

/// Displays an error, then each [`source`](Error::source) in turn, joined by `: `.
///
/// ```
/// use tidepool::{ConfigError, ErrorChain};
/// let inner = ConfigError::UnknownKey("warp_speed".into());
/// let e = ConfigError::Env { var: "TIDEPOOL_ALLOC_CONF", error: Box::new(inner.clone()) };
/// assert_eq!(
///     ErrorChain(&e).to_string(),
///     format!("TIDEPOOL_ALLOC_CONF holds an invalid configuration: {inner}")
/// );
/// ```
#[derive(Clone, Copy)]
pub struct ErrorChain<'a>(pub &'a (dyn Error + 'a));

impl fmt::Display for ErrorChain<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}", self.0)?;
        let mut next = self.0.source();
        while let Some(inner) = next {
            write!(f, ": {inner}")?;
            next = inner.source();
        }
        Ok(())
    }
}

impl fmt::Debug for ErrorChain<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Display::fmt(self, f)
    }
}
