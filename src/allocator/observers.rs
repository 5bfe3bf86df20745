//! What runs when memory runs out, before the error reaches the caller: out-of-memory observers
//! (PyTorch's `_cuda_attach_out_of_memory_observer`: called with the report, for logging or a
//! snapshot) and one failure callback (RMM's `failure_callback_resource_adaptor`: it may free
//! memory — drop caches of its own, call `empty_cache` elsewhere — and ask for another attempt).
//!
//! ```text
//!  alloc ─▶ OOM ladder exhausted ─▶ observers(report) ─▶ callback(report, attempt) ─┬─ true: retry
//!                                                                                 └─ false: Err
//! ```
//!
//! Both run on the allocating thread with no allocator lock held, so they may call the allocator.

use super::*;

// User callbacks are no part of a loom model, and loom's `Arc` cannot hold a `dyn Fn`: std's.
/// An out-of-memory observer ([`Allocator::attach_oom_observer`]).
type Observer = std::sync::Arc<dyn Fn(&OomReport) + Send + Sync>;
/// The failure callback ([`Allocator::set_failure_callback`]).
type Callback = std::sync::Arc<dyn Fn(&OomReport, u32) -> bool + Send + Sync>;

#[derive(Default)]
pub(crate) struct Observers {
    observers: Mutex<Vec<Observer>>,
    callback: Mutex<Option<Callback>>,
}

impl Observers {
    /// Calls every observer, then the callback; whether to try the allocation again. Attempts
    /// count from 1.
    pub fn out_of_memory(&self, report: &OomReport, attempt: u32) -> bool {
        // Copies, so no lock is held while user code runs (it may attach more observers).
        let observers: Vec<Observer> = lock(&self.observers).clone();
        for o in &observers {
            o(report);
        }
        let callback = lock(&self.callback).clone();
        callback.is_some_and(|c| c(report, attempt))
    }
}

impl<D: Device> Allocator<D> {
    /// Registers `observer`, called with the report of every out-of-memory error before the
    /// error returns (after the allocator's own ladder: events waited for, caches released).
    ///
    /// ```
    /// use std::sync::{Arc, Mutex};
    /// use tidepool::{Allocator, Config, SimDevice, StreamId};
    ///
    /// let alloc = Allocator::new(Arc::new(SimDevice::new(64 << 20)), Config::default()).unwrap();
    /// let seen = Arc::new(Mutex::new(Vec::new()));
    /// let log = seen.clone();
    /// alloc.attach_oom_observer(move |report| log.lock().unwrap().push(report.requested));
    /// assert!(alloc.alloc(1 << 30, StreamId::DEFAULT).is_err());
    /// assert_eq!(*seen.lock().unwrap(), vec![1 << 30]);
    /// ```
    pub fn attach_oom_observer(&self, observer: impl Fn(&OomReport) + Send + Sync + 'static) {
        lock(&self.shared.observers.observers).push(std::sync::Arc::new(observer));
    }

    /// Sets the failure callback (replacing any earlier one): called after the observers with
    /// the report and the attempt number (1, 2, …); `true` retries the allocation, `false` lets
    /// the error return. A callback that frees nothing and keeps answering `true` retries for
    /// ever: count attempts. Each attempt is a whole allocation (RMM's
    /// `failure_callback_resource_adaptor` calls its callback the same way): one that fails
    /// climbs the out-of-memory ladder, counts in `num_ooms` and `num_alloc_retries`, and is
    /// reported to the observers, so a request retried once and then given up counts 2.
    pub fn set_failure_callback(
        &self,
        callback: impl Fn(&OomReport, u32) -> bool + Send + Sync + 'static,
    ) {
        *lock(&self.shared.observers.callback) = Some(std::sync::Arc::new(callback));
    }

    /// Removes the failure callback.
    pub fn clear_failure_callback(&self) {
        *lock(&self.shared.observers.callback) = None;
    }
}
