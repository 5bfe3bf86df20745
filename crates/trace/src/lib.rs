//! Traces and the replayer: the trace model ([`Trace`]), readers for tidepool CSV, RMM logs
//! and PyTorch memory snapshots ([`read_traces`]: one trace per device, with PyTorch's own
//! reserved memory in [`snapshot`]), replay [`Policy`]s with their
//! [`registry`], the offline planner ([`plan`]), reports and SVG plots. The `tidepool` command
//! line (crate `tidepool-cli`) is built on it.
//!
//! ```text
//!  file ─► read ─► Trace ─► runner ─► Policy × repeats ─► Report ─► table | JSON | SVG
//! ```

mod clock;
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

pub use error::{ErrorKind, Location, TraceError};
pub use event::{Event, Lifetime, Op, PreWindow, Tag, Trace};
pub use policy::{Policy, PolicyResult, ReplayError, ReplayOptions, named_only, registry};
pub use read::{
    ReadOptions, read_trace, read_trace_bytes, read_trace_from, read_traces, read_traces_bytes,
    read_traces_from,
};
pub use report::Report;
pub use validate::Validator;
