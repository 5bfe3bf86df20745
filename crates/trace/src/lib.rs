//! Traces and the replayer: the trace model ([`Trace`]), readers for tidepool CSV, RMM logs
//! and PyTorch memory snapshots ([`read_traces`]: one trace per device, with PyTorch's own
//! reserved memory in [`snapshot`]), replay [`Policy`]s with their
//! [`registry`], the offline planner ([`plan`]), reports and SVG plots. The `tidepool` command
//! line (crate `tidepool-cli`) is built on it.
//!
//! ```text
//!  file ─► read ─► Trace ─► runner ─► Policy × repeats ─► Report ─► table | JSON | SVG
//! ```
//!
//! A trace replayed through tidepool's allocator and the offline planner:
//!
//! ```
//! use tidepool_trace::{ReplayOptions, read_trace_bytes, registry};
//!
//! let csv = "seq,op,id,bytes,stream,tag\n\
//!            0,alloc,1,3145728,0,param\n\
//!            1,alloc,2,2097152,0,act\n\
//!            2,free,2,2097152,0,act\n\
//!            3,alloc,3,2097152,0,act\n\
//!            4,free,3,2097152,0,act\n\
//!            5,free,1,3145728,0,param\n";
//! let trace = read_trace_bytes(csv.as_bytes()).unwrap();
//! assert_eq!((trace.events.len(), trace.peak_live_bytes()), (6, 5 << 20)); // 3 MiB + 2 MiB
//! let policies = registry(&ReplayOptions::default()).unwrap();
//! let caching = policies.iter().find(|p| p.name() == "caching").unwrap();
//! let r = caching.replay(&trace, false).unwrap();
//! assert_eq!(r.device_mallocs, 1); // one 20 MiB large-pool segment serves all three
//! assert_eq!(r.peak_reserved_bytes, 20 << 20);
//! let planned = policies.iter().find(|p| p.name() == "planned").unwrap();
//! assert_eq!(planned.replay(&trace, false).unwrap().peak_reserved_bytes, 5 << 20);
//! ```

mod clock;
mod cost;
mod error;
mod event;
/// The offline planner's packing, from the core crate (its learned scope plans use it too).
pub use tidepool::packing as plan;
pub mod plot;
pub mod policy;
pub mod read;
pub mod report;
pub mod runner;
pub mod snapshot;
mod validate;

pub use error::{ErrorKind, Location, TraceError, echo_path};
pub use event::{Event, Lifetime, Op, PreWindow, Tag, Trace};
pub use policy::{Policy, PolicyResult, ReplayError, ReplayOptions, named_only, registry};
pub use read::{
    ReadOptions, read_trace, read_trace_bytes, read_trace_from, read_traces, read_traces_bytes,
    read_traces_from,
};
pub use report::Report;
pub use validate::Validator;
