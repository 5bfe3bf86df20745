//! The one place that imports synchronisation primitives.
//!
//! Everything the allocator shares between threads (atomics, fences, `Mutex`, `Arc`, threads and
//! the swappable configuration cell) comes from here, from `std` normally and from `loom` under
//! `--cfg loom`, as tokio and crossbeam do. Loom models in `loom-tests/` then explore every
//! interleaving of the real code.
//!
//! `arc-swap` cannot be modelled by loom (it uses its own std atomics and thread-locals), so
//! [`ArcCell`] is `ArcSwap` under `std` and a `Mutex<Arc<T>>` under loom, behind one interface.

#[cfg(not(loom))]
#[allow(unused_imports)]
pub(crate) use std::sync::{Arc, Condvar, Mutex, MutexGuard};
#[cfg(not(loom))]
#[allow(unused_imports)]
pub(crate) mod atomic {
    pub(crate) use std::sync::atomic::{
        AtomicBool, AtomicU8, AtomicU32, AtomicU64, AtomicUsize, Ordering, fence,
    };
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
    pub(crate) use loom::sync::atomic::{
        AtomicBool, AtomicU8, AtomicU32, AtomicU64, AtomicUsize, Ordering, fence,
    };
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

/// `m`'s guard if no one holds it (recovered from a holder that panicked), else `None`.
pub(crate) fn try_lock<T>(m: &Mutex<T>) -> Option<MutexGuard<'_, T>> {
    match m.try_lock() {
        Ok(g) => Some(g),
        Err(std::sync::TryLockError::Poisoned(p)) => Some(p.into_inner()),
        Err(std::sync::TryLockError::WouldBlock) => None,
    }
}

/// The value of `arc` if this was the last hold on it. Of several threads letting go of clones
/// at once, exactly one gets it (`Arc::into_inner`; loom's `Arc` has only `try_unwrap`, which
/// the models do not race).
pub(crate) fn arc_into_inner<T>(arc: Arc<T>) -> Option<T> {
    #[cfg(not(loom))]
    return Arc::into_inner(arc);
    #[cfg(loom)]
    return Arc::try_unwrap(arc).ok();
}

/// Waits on `cv`, recovering the guard if another thread panicked while holding the lock.
pub(crate) fn wait<'a, T>(cv: &Condvar, guard: MutexGuard<'a, T>) -> MutexGuard<'a, T> {
    match cv.wait(guard) {
        Ok(g) => g,
        Err(poisoned) => poisoned.into_inner(),
    }
}

/// A shared value replaced as a whole: readers get the old or the new one, never a mix.
///
/// `ArcSwap` under `std` (a load is a few instructions, no lock); a `Mutex<Arc<T>>` under loom.
pub struct ArcCell<T> {
    #[cfg(not(loom))]
    inner: arc_swap::ArcSwap<T>,
    #[cfg(loom)]
    inner: Mutex<Arc<T>>,
}

/// What [`ArcCell::load`] returns: dereferences to the value that was current at the load.
#[cfg(not(loom))]
pub type ArcRef<T> = arc_swap::Guard<Arc<T>>;
/// What [`ArcCell::load`] returns: dereferences to the value that was current at the load.
#[cfg(loom)]
pub type ArcRef<T> = Arc<T>;

impl<T> ArcCell<T> {
    /// A cell holding `value`.
    pub fn new(value: T) -> ArcCell<T> {
        ArcCell::from_arc(Arc::new(value))
    }

    /// A cell holding `value`.
    pub fn from_arc(value: Arc<T>) -> ArcCell<T> {
        #[cfg(not(loom))]
        let inner = arc_swap::ArcSwap::new(value);
        #[cfg(loom)]
        let inner = Mutex::new(value);
        ArcCell { inner }
    }

    /// The current value. Hold the result for as long as one consistent view is needed.
    pub fn load(&self) -> ArcRef<T> {
        #[cfg(not(loom))]
        return self.inner.load();
        #[cfg(loom)]
        return lock(&self.inner).clone();
    }

    /// The current value as an owned `Arc`.
    pub fn load_full(&self) -> Arc<T> {
        #[cfg(not(loom))]
        return self.inner.load_full();
        #[cfg(loom)]
        return lock(&self.inner).clone();
    }

    /// Replaces the value; loads already made keep the old one.
    pub fn store(&self, value: Arc<T>) {
        #[cfg(not(loom))]
        self.inner.store(value);
        #[cfg(loom)]
        {
            *lock(&self.inner) = value;
        }
    }
}

/// A slot set at most once, then read without a lock: `OnceLock` under `std` (a read is one
/// `Acquire` load), a `Mutex<Option<T>>` under loom (a read clones the value out).
pub struct OnceSlot<T> {
    #[cfg(not(loom))]
    inner: std::sync::OnceLock<T>,
    #[cfg(loom)]
    inner: Mutex<Option<T>>,
}

/// What [`OnceSlot::get`] returns: a reference under `std`, a clone under loom.
#[cfg(not(loom))]
pub type SlotRef<'a, T> = &'a T;
/// What [`OnceSlot::get`] returns: a reference under `std`, a clone under loom.
#[cfg(loom)]
pub type SlotRef<'a, T> = T;

impl<T: Clone> Default for OnceSlot<T> {
    fn default() -> Self {
        OnceSlot::new()
    }
}

impl<T: Clone> OnceSlot<T> {
    /// An empty slot.
    pub fn new() -> OnceSlot<T> {
        #[cfg(not(loom))]
        let inner = std::sync::OnceLock::new();
        #[cfg(loom)]
        let inner = Mutex::new(None);
        OnceSlot { inner }
    }

    /// The value, once set.
    #[inline]
    pub fn get(&self) -> Option<SlotRef<'_, T>> {
        #[cfg(not(loom))]
        return self.inner.get();
        #[cfg(loom)]
        return lock(&self.inner).clone();
    }

    /// Sets the value if the slot is empty (else drops `value`).
    pub fn set(&self, value: T) {
        #[cfg(not(loom))]
        let _ = self.inner.set(value);
        #[cfg(loom)]
        {
            let mut g = lock(&self.inner);
            if g.is_none() {
                *g = Some(value);
            }
        }
    }
}
