//! `Eager`: the eager layer's root — an [`Allocator`] and a [`Backend`] over the same device,
//! counters, a pool of events for cross-stream waits, and the optional trace [`Recorder`].
//!
//! ```text
//!   Eager<B> ── Arc<Inner> { alloc, backend, recorder: OnceLock<Recorder>, counters, events }
//!     ├─ Tensor::parameter(&eager, …)   Persistent, through the allocator
//!     ├─ eager.ctx(stream)  ─▶ Ctx<'static>   outputs: Transient, through the allocator
//!     └─ eager.step(name, stream) ─▶ Step ─▶ step.ctx() ─▶ Ctx<'step>   outputs: the step's scope
//! ```
//!
//! Cloning an `Eager` clones a handle; every tensor holds one (for `to_host` and its trace row).

use super::backend::Backend;
use super::error::{EagerError, Result};
use super::host::HostBackend;
use super::record::Recorder;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, OnceLock};
use tidepool::Allocator;
use tidepool::Config;
use tidepool::device::{Device, EventId, SimDevice, StreamId};

/// What the eager layer has done so far (all counts since the `Eager` was made).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct EagerStats {
    /// Kernels launched (ops, optimizer updates; copies not counted).
    pub kernels: u64,
    /// Host-to-device copies.
    pub uploads: u64,
    /// Device-to-host copies (each a host sync).
    pub downloads: u64,
    /// Tensors allocated through a step's scope.
    pub scoped_allocs: u64,
    /// Transient tensors allocated through the allocator, outside any scope (gradients, inputs).
    pub unscoped_allocs: u64,
    /// Persistent tensors (parameters, optimizer state).
    pub persistent_allocs: u64,
    /// Steps opened.
    pub steps: u64,
}

#[derive(Default)]
pub(crate) struct Counters {
    pub kernels: AtomicU64,
    pub uploads: AtomicU64,
    pub downloads: AtomicU64,
    pub scoped_allocs: AtomicU64,
    pub unscoped_allocs: AtomicU64,
    pub persistent_allocs: AtomicU64,
    pub steps: AtomicU64,
}

pub(crate) struct Inner<B: Backend> {
    pub alloc: Allocator<B::Device>,
    pub backend: B,
    pub recorder: OnceLock<Recorder>,
    pub counters: Counters,
    events: Mutex<Vec<EventId>>,
}

/// The eager layer over one device: see the module docs.
pub struct Eager<B: Backend> {
    pub(crate) inner: Arc<Inner<B>>,
}

impl<B: Backend> Clone for Eager<B> {
    fn clone(&self) -> Self {
        Eager { inner: self.inner.clone() }
    }
}

/// The eager layer on a [`SimDevice`] with host kernels.
pub type SimEager = Eager<HostBackend<SimDevice>>;

impl Eager<HostBackend<SimDevice>> {
    /// A backed [`SimDevice`] of `capacity` bytes, an allocator with the default configuration
    /// and host kernels: the eager layer anywhere.
    pub fn sim(capacity: u64) -> Result<SimEager> {
        let device = Arc::new(SimDevice::backed(capacity));
        Eager::new(HostBackend::new(device), Config::default())
    }
}

impl<B: Backend> Eager<B> {
    /// An eager layer running on `backend`, with a new allocator over its device.
    pub fn new(backend: B, config: Config) -> Result<Eager<B>> {
        let alloc = Allocator::new(backend.device().clone(), config)?;
        Self::with_allocator(backend, alloc)
    }

    /// An eager layer sharing `alloc`, which must allocate from `backend`'s device.
    pub fn with_allocator(backend: B, alloc: Allocator<B::Device>) -> Result<Eager<B>> {
        if !Arc::ptr_eq(alloc.device(), backend.device()) {
            return Err(EagerError::Backend(
                "the allocator and the back end are on different devices".into(),
            ));
        }
        Ok(Eager {
            inner: Arc::new(Inner {
                alloc,
                backend,
                recorder: OnceLock::new(),
                counters: Counters::default(),
                events: Mutex::new(Vec::new()),
            }),
        })
    }

    /// Starts recording the allocation trace (see [`Recorder`]); tensors made before are not in
    /// it. Call it before making parameters. Recording again is a no-op.
    pub fn start_trace(&self) -> &Recorder {
        self.inner.recorder.get_or_init(Recorder::new)
    }

    /// The trace recorder, once [`Eager::start_trace`] was called.
    pub fn recorder(&self) -> Option<&Recorder> {
        self.inner.recorder.get()
    }

    /// The allocator every tensor comes from.
    pub fn allocator(&self) -> &Allocator<B::Device> {
        &self.inner.alloc
    }

    /// The back end ops run on.
    pub fn backend(&self) -> &B {
        &self.inner.backend
    }

    /// The device.
    pub fn device(&self) -> &Arc<B::Device> {
        self.inner.backend.device()
    }

    /// Counters of what the layer has done.
    pub fn stats(&self) -> EagerStats {
        let c = &self.inner.counters;
        let get = |a: &AtomicU64| a.load(Ordering::Relaxed);
        EagerStats {
            kernels: get(&c.kernels),
            uploads: get(&c.uploads),
            downloads: get(&c.downloads),
            scoped_allocs: get(&c.scoped_allocs),
            unscoped_allocs: get(&c.unscoped_allocs),
            persistent_allocs: get(&c.persistent_allocs),
            steps: get(&c.steps),
        }
    }

    /// The index of the next step (counted in the engine's statistics).
    pub(crate) fn next_step_index(&self) -> u64 {
        self.inner.counters.steps.fetch_add(1, Ordering::Relaxed)
    }

    /// Blocks until every stream of the device is idle (a host sync).
    pub fn synchronize(&self) -> Result<()> {
        Ok(self.device().synchronize()?)
    }

    /// Makes `waiter`'s later work wait for the work enqueued on `on` so far, on the device.
    pub fn wait_stream(&self, waiter: StreamId, on: StreamId) -> Result<()> {
        if waiter == on {
            return Ok(());
        }
        let device = self.device();
        let event = match self.inner.events.lock().unwrap_or_else(|p| p.into_inner()).pop() {
            Some(e) => e,
            None => device.create_event()?,
        };
        let waited = device.record_event(event, on).and_then(|()| device.wait_event(waiter, event));
        // The wait captured the event's position: the event may be recorded again at once.
        self.inner.events.lock().unwrap_or_else(|p| p.into_inner()).push(event);
        Ok(waited?)
    }

    pub(crate) fn count(&self, which: impl Fn(&Counters) -> &AtomicU64) {
        which(&self.inner.counters).fetch_add(1, Ordering::Relaxed);
    }

    /// `done`, counted in `which` if it succeeded: an allocation that ran out of memory, or a
    /// launch or copy the device refused, did nothing to count.
    pub(crate) fn counted<T>(
        &self,
        which: impl Fn(&Counters) -> &AtomicU64,
        done: Result<T>,
    ) -> Result<T> {
        // BROKEN (`counts_refused`): counted whether it succeeded or not.
        if done.is_ok() || cfg!(tidepool_broken = "counts_refused") {
            self.count(which);
        }
        done
    }
}

impl<B: Backend> Drop for Inner<B> {
    fn drop(&mut self) {
        let device = self.backend.device();
        for e in self.events.get_mut().unwrap_or_else(|p| p.into_inner()).drain(..) {
            let _ = device.destroy_event(e);
        }
    }
}
