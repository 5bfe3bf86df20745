//! What the input-sized searches cost, counted for the unit tests.
//!
//! A search whose length the input sets (the streams of a trace, the depth of its scopes) must
//! stay constant per event, or a hostile file takes minutes before its error. The tests show it
//! by counting the entries the searches look at on this thread, not by timing them; outside
//! tests [`looked_at`] compiles to nothing.

#[cfg(test)]
thread_local! {
    static LOOKED_AT: std::cell::Cell<u64> = const { std::cell::Cell::new(0) };
}

/// Counts `n` entries looked at (tests only).
#[inline(always)]
pub(crate) fn looked_at(n: usize) {
    #[cfg(test)]
    LOOKED_AT.with(|c| c.set(c.get() + n as u64));
    let _ = n;
}

/// The entries looked at on this thread since the last call (tests only).
#[cfg(test)]
pub(crate) fn take() -> u64 {
    LOOKED_AT.with(|c| c.replace(0))
}
