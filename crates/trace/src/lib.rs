//! Traces and the replayer: the trace model ([`Trace`]), readers for tidepool CSV, RMM logs
//! and PyTorch memory snapshots ([`read_trace`]), replay [`Policy`]s with their
//! [`registry`], the offline planner ([`plan`]), reports and SVG plots. The `tidepool` command
//! line (crate `tidepool-cli`) is built on it.
//!
//! ```text
//!  file ─► read ─► Trace ─► runner ─► Policy × repeats ─► Report ─► table | JSON | SVG
//! ```

mod error;
mod event;
/// The offline planner's packing, from the core crate (its learned scope plans use it too).
pub use tidepool::packing as plan;
pub mod plot;
pub mod policy;
pub mod read;
pub mod report;
pub mod runner;
mod validate;

pub use error::{ErrorKind, Location, TraceError};
pub use event::{Event, Lifetime, Op, Tag, Trace};
pub use policy::{Policy, PolicyResult, ReplayError, ReplayOptions, registry};
pub use read::{read_trace, read_trace_bytes, read_trace_from};
pub use report::Report;
pub use validate::Validator;
