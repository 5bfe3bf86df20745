//! The one place that imports synchronisation primitives.
//!
//! Everything the allocator shares between threads (atomics, `Mutex`, `Arc`, threads) comes from
//! here, from `std` normally and from `loom` under `--cfg loom`, as tokio and crossbeam do. Loom
//! models in `loom-tests/` then explore every interleaving of the real code.

#[cfg(not(loom))]
#[allow(unused_imports)]
pub(crate) use std::sync::{Arc, Condvar, Mutex, MutexGuard};
#[cfg(not(loom))]
#[allow(unused_imports)]
pub(crate) mod atomic {
    pub(crate) use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
}
#[cfg(not(loom))]
#[allow(unused_imports)]
pub(crate) use std::thread;

#[cfg(loom)]
#[allow(unused_imports)]
pub(crate) use loom::sync::{Arc, Condvar, Mutex, MutexGuard};
#[cfg(loom)]
#[allow(unused_imports)]
pub(crate) mod atomic {
    pub(crate) use loom::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
}
#[cfg(loom)]
#[allow(unused_imports)]
pub(crate) use loom::thread;

/// Locks a mutex, recovering the data if another thread panicked while holding it.
///
/// The allocator's state stays consistent across a panic in user code (no user code runs under
/// its lock), so a poisoned lock carries no broken invariant.
pub(crate) fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    match m.lock() {
        Ok(g) => g,
        Err(poisoned) => poisoned.into_inner(),
    }
}

/// Waits on `cv`, recovering the guard if another thread panicked while holding the lock.
pub(crate) fn wait<'a, T>(cv: &Condvar, guard: MutexGuard<'a, T>) -> MutexGuard<'a, T> {
    match cv.wait(guard) {
        Ok(g) => g,
        Err(poisoned) => poisoned.into_inner(),
    }
}
