//! `Recorder`: the eager layer's allocation trace, in tidepool's CSV trace format, so that
//! `tidepool replay` can compare allocation policies on the eager workloads themselves.
//!
//! ```text
//!   seq,op,id,bytes,stream,tag
//!   0,alloc,1,4096,0,param          <- Tensor::parameter, optimizer state (Persistent)
//!   1,scope_enter,0,0,0,step0       <- Eager::step("step", …): one scope per step, tag = name+index
//!   2,alloc,2,512,0,act             <- op outputs (through the scope, or unscoped: gradients)
//!   3,free,2,512,0,act
//!   4,scope_exit,0,0,0,step0
//! ```
//!
//! Buffer ids start at 1 (0 marks a tensor made before recording started, whose free is not
//! recorded). Rows are appended under one lock, in the order the host made the calls.

use std::fmt::Write as _;
use std::path::Path;
use std::sync::{Mutex, MutexGuard};
use tidepool::StreamId;

/// The header line of tidepool's CSV trace format, which the recorder writes (the trace crate's
/// reader checks the same line; `tests/eager_train.rs` replays a recorded trace through it).
pub const TRACE_HEADER: &str = "seq,op,id,bytes,stream,tag";

/// Residency tag of a traced buffer (`param` persistent, `act` transient).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum TraceTag {
    /// Persistent: parameters, optimizer state.
    Param,
    /// Transient: activations, gradients, inputs.
    Act,
}

impl TraceTag {
    fn as_str(self) -> &'static str {
        match self {
            TraceTag::Param => "param",
            TraceTag::Act => "act",
        }
    }
}

#[derive(Default)]
struct State {
    rows: String,
    seq: u64,
    next_id: u64,
    next_scope: u64,
}

impl State {
    fn row(&mut self, op: &str, id: u64, bytes: u64, stream: StreamId, tag: &str) {
        let seq = self.seq;
        self.seq += 1;
        // The format has no quoting: a comma or a line break in a tag (a step's name) made a
        // row the reader refuses, and with it the whole trace. They become `_`.
        // BROKEN (`trace_tags_raw`): written as given.
        let is_separator = |c: char| matches!(c, ',' | '\n' | '\r');
        let tag = match tag.contains(is_separator) && !cfg!(tidepool_broken = "trace_tags_raw") {
            true => std::borrow::Cow::Owned(tag.replace(is_separator, "_")),
            false => std::borrow::Cow::Borrowed(tag),
        };
        let _ = writeln!(self.rows, "{seq},{op},{id},{bytes},{},{tag}", stream.0);
    }
}

fn lock(m: &Mutex<State>) -> MutexGuard<'_, State> {
    // A poisoned lock holds complete rows: every row is written by one `writeln!`.
    m.lock().unwrap_or_else(|p| p.into_inner())
}

/// An allocation trace being recorded. See the module docs.
#[derive(Default)]
pub struct Recorder {
    state: Mutex<State>,
}

impl Recorder {
    /// An empty trace.
    pub fn new() -> Recorder {
        Recorder::default()
    }

    /// Records an allocation; returns its id (≥ 1).
    pub fn alloc(&self, bytes: u64, stream: StreamId, tag: TraceTag) -> u64 {
        let mut st = lock(&self.state);
        st.next_id += 1;
        let id = st.next_id;
        st.row("alloc", id, bytes, stream, tag.as_str());
        id
    }

    /// Records the free of allocation `id`.
    pub fn free(&self, id: u64, bytes: u64, stream: StreamId, tag: TraceTag) {
        lock(&self.state).row("free", id, bytes, stream, tag.as_str());
    }

    /// Records entering a scope named `name` (a comma or line break in it is written as `_`:
    /// the format has no quoting); returns its id.
    pub fn scope_enter(&self, name: &str, stream: StreamId) -> u64 {
        let mut st = lock(&self.state);
        let id = st.next_scope;
        st.next_scope += 1;
        st.row("scope_enter", id, 0, stream, name);
        id
    }

    /// Records leaving scope `id`.
    pub fn scope_exit(&self, id: u64, name: &str, stream: StreamId) {
        lock(&self.state).row("scope_exit", id, 0, stream, name);
    }

    /// Rows recorded so far (the header not counted).
    pub fn len(&self) -> u64 {
        lock(&self.state).seq
    }

    /// Whether nothing was recorded.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The trace so far as tidepool CSV, header included.
    pub fn to_csv(&self) -> String {
        format!("{TRACE_HEADER}\n{}", lock(&self.state).rows)
    }

    /// Writes [`Recorder::to_csv`] to `path`.
    pub fn write_csv(&self, path: &Path) -> std::io::Result<()> {
        std::fs::write(path, self.to_csv())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rows_in_the_tidepool_format() {
        let r = Recorder::new();
        let p = r.alloc(4096, StreamId(0), TraceTag::Param);
        let s = r.scope_enter("step0", StreamId(0));
        let a = r.alloc(512, StreamId(1), TraceTag::Act);
        r.free(a, 512, StreamId(1), TraceTag::Act);
        r.scope_exit(s, "step0", StreamId(0));
        assert_eq!((p, a, s), (1, 2, 0));
        assert_eq!(
            r.to_csv(),
            "seq,op,id,bytes,stream,tag\n0,alloc,1,4096,0,param\n1,scope_enter,0,0,0,step0\n\
             2,alloc,2,512,1,act\n3,free,2,512,1,act\n4,scope_exit,0,0,0,step0\n"
        );
        assert_eq!(r.len(), 5);
    }
}
