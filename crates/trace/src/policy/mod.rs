//! Replay policies: anything that can run a [`Trace`] and say how much memory it needed.
//!
//! A policy is a value implementing [`Policy`]; [`registry`] lists the policies the CLI runs
//! by default, [`named_only`] those it runs only when named. The baselines here need no
//! allocator:
//!
//! | name               | what it is                                                        |
//! |--------------------|-------------------------------------------------------------------|
//! | `caching`          | tidepool's allocator, default config, every block transient       |
//! | `residency`        | tidepool's allocator, `param` persistent and `act` transient      |
//! | `scoped`           | `residency` plus a named scope per trace scope, with learned plans |
//! | `expandable`       | `caching` with expandable segments (`expandable_segments:true`)    |
//! | `pytorch`          | `caching` without the stream caches: PyTorch's placement (named only) |
//! | `offset-allocator` | the offset-allocator crate as a fixed-heap sub-allocator          |
//! | `range-alloc`      | the range-alloc crate (best fit over a free list), fixed heap      |
//! | `planned`          | offline greedy-by-size packing with every lifetime known           |
//!
//! The lower bound (peak live requested bytes) is not a policy: every report carries it as
//! `peak_live_bytes`. Scope markers are no-ops for the baselines.

mod allocator;
mod fixed_heap;
mod offset_allocator;
mod planned;
mod range_alloc;
mod slots;

use std::fmt;

pub use allocator::{
    AllocStep, AllocatorPolicy, MAX_REPLAY_STREAMS, Mode, ReplayDevice, alloc_steps, replay_device,
    scope_family,
};
pub use fixed_heap::GRANULE;
pub use offset_allocator::OffsetAllocatorPolicy;
pub use planned::PlannedPolicy;
pub use range_alloc::RangeAllocPolicy;

use super::event::Trace;

/// Options shared by all policies of one replay.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ReplayOptions {
    /// Allocator configuration, `key:value,key:value` (as `TIDEPOOL_ALLOC_CONF`); carried
    /// verbatim to allocator policies, ignored by the baselines.
    pub config: Option<String>,
    /// How many times each policy is replayed; the median ns/op is reported.
    pub repeats: usize,
    /// Whether policies should record a reserved-bytes timeline (for `--svg`).
    pub timeline: bool,
}

impl Default for ReplayOptions {
    fn default() -> Self {
        ReplayOptions { config: None, repeats: 5, timeline: false }
    }
}

/// What one replay of one policy measured.
#[derive(Debug, Clone, PartialEq)]
pub struct PolicyResult {
    /// Policy name (as in [`Policy::name`]).
    pub name: String,
    /// Highest device memory the policy held (segments / heap high-water mark / region).
    pub peak_reserved_bytes: u64,
    /// Highest sum of bytes handed out to live buffers, as the policy rounds them.
    pub peak_allocated_bytes: u64,
    /// Device allocation calls (`cuMemAlloc`).
    pub device_mallocs: u64,
    /// Device free calls (`cuMemFree`) during the replay; what a policy still holds when it
    /// ends is not counted (the same in every row).
    pub device_frees: u64,
    /// Page mappings made (`cuMemMap`; expandable segments only).
    pub device_maps: u64,
    /// Page mappings removed (`cuMemUnmap`; expandable segments only).
    pub device_unmaps: u64,
    /// Times the host waited for the device.
    pub host_syncs: u64,
    /// Time of the replay loop divided by the number of events: the replaying thread's CPU
    /// time where the platform has it (every policy alike; see `clock.rs`), else wall time.
    pub ns_per_op: f64,
    /// Reserved bytes after each event (one entry per event), when asked for.
    pub reserved_timeline: Option<Vec<u64>>,
    /// Free-form notes for the text report (heap size, granularity, planning time, ...).
    pub extra: Vec<(String, String)>,
}

impl PolicyResult {
    /// `name`'s result with nothing held, called or timed (a trace with no allocation).
    pub(crate) fn nothing(name: &str) -> PolicyResult {
        PolicyResult {
            name: name.to_string(),
            peak_reserved_bytes: 0,
            peak_allocated_bytes: 0,
            device_mallocs: 0,
            device_frees: 0,
            device_maps: 0,
            device_unmaps: 0,
            host_syncs: 0,
            ns_per_op: 0.0,
            reserved_timeline: None,
            extra: Vec::new(),
        }
    }
}

/// Why a policy could not replay a trace.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ReplayError {
    /// The policy that failed.
    pub policy: String,
    /// What went wrong.
    pub message: String,
}

impl ReplayError {
    /// An error of policy `policy`.
    pub fn new(policy: &str, message: impl Into<String>) -> Self {
        ReplayError { policy: policy.to_string(), message: message.into() }
    }
}

impl fmt::Display for ReplayError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "policy {}: {}", self.policy, self.message)
    }
}

impl std::error::Error for ReplayError {}

/// A way of serving a trace's allocations.
pub trait Policy {
    /// Name used on the command line and in reports.
    fn name(&self) -> &'static str;

    /// Replays `trace` once from a fresh state. With `timeline`, the result carries
    /// [`PolicyResult::reserved_timeline`]. Must not panic on any valid trace.
    fn replay(&self, trace: &Trace, timeline: bool) -> Result<PolicyResult, ReplayError>;
}

/// All known policies, in report order. Allocator policies are built from `opts.config`.
pub fn registry(opts: &ReplayOptions) -> Result<Vec<Box<dyn Policy>>, ReplayError> {
    let config = opts.config.as_deref();
    let policies: Vec<Box<dyn Policy>> = vec![
        Box::new(AllocatorPolicy::from_config(Mode::Caching, config)?),
        Box::new(AllocatorPolicy::from_config(Mode::Residency, config)?),
        Box::new(AllocatorPolicy::from_config(Mode::Scoped, config)?),
        Box::new(AllocatorPolicy::from_config(Mode::Expandable, config)?),
        Box::new(OffsetAllocatorPolicy),
        Box::new(RangeAllocPolicy),
        Box::new(PlannedPolicy),
    ];
    Ok(policies)
}

/// Policies run only when named (`--policy NAME`), not by default: `pytorch` (PyTorch's
/// placement: `caching` without the stream caches; see `policy/allocator.rs`).
pub fn named_only(opts: &ReplayOptions) -> Result<Vec<Box<dyn Policy>>, ReplayError> {
    let config = opts.config.as_deref();
    Ok(vec![Box::new(AllocatorPolicy::from_config(Mode::PyTorch, config)?)])
}
