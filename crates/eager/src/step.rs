//! `Step`: one training step (or request) — a named [`Scope`] on one stream, whose runs are
//! served from a learned plan once they repeat, plus its `scope_enter`/`scope_exit` rows in the
//! trace.
//!
//! ```text
//!   let step = eager.step("step", stream);     scope_enter (tag "step<index>")
//!   let cx = step.ctx();                       outputs: ScopedBuffer<'step> (activations)
//!   let gx = step.unscoped();                  outputs: allocator Buffers (gradients)
//!   … ops …; drop(activations); drop(step);    scope_exit; the scope's memory is recycled
//! ```

use super::backend::Backend;
use super::ctx::Ctx;
use super::engine::Eager;
use tidepool::Scope;
use tidepool::device::StreamId;

/// A step of work on one stream; see the module docs. Ends when dropped.
///
/// An activation cannot outlive its step (its memory is the scope's):
///
/// ```compile_fail
/// use tidepool::StreamId;
/// use tidepool_eager::Eager;
/// let eager = Eager::sim(64 << 20).unwrap();
/// let kept = {
///     let step = eager.step("step", StreamId::DEFAULT);
///     step.ctx().zeros(&[4]).unwrap() // error: `step` does not live long enough
/// };
/// ```
///
/// A value that must outlive it comes from [`Step::unscoped`]:
///
/// ```
/// use tidepool::StreamId;
/// use tidepool_eager::Eager;
/// let eager = Eager::sim(64 << 20).unwrap();
/// let kept = {
///     let step = eager.step("step", StreamId::DEFAULT);
///     step.unscoped().zeros(&[4]).unwrap()
/// };
/// assert_eq!(kept.to_host().unwrap(), vec![0.0; 4]);
/// ```
pub struct Step<'e, B: Backend> {
    eager: &'e Eager<B>,
    scope: Scope<'e, B::Device>,
    index: u64,
    /// The trace scope id and tag, when recording.
    traced: Option<(u64, String)>,
}

impl<'e, B: Backend> Step<'e, B> {
    pub(crate) fn open(eager: &'e Eager<B>, name: &str, index: u64, stream: StreamId) -> Self {
        let traced = eager.recorder().map(|r| {
            let tag = format!("{name}{index}");
            (r.scope_enter(&tag, stream), tag)
        });
        Step { eager, scope: eager.allocator().named_scope(name, stream), index, traced }
    }

    /// Ops whose outputs come from this step's scope (they cannot outlive the step).
    pub fn ctx(&self) -> Ctx<'_, B> {
        Ctx::scoped(self.eager.clone(), &self.scope)
    }

    /// Ops on this step's stream whose outputs are transient allocator buffers that may outlive
    /// the step (gradients).
    pub fn unscoped(&self) -> Ctx<'static, B> {
        self.eager.ctx(self.scope.stream())
    }

    /// The step's stream.
    pub fn stream(&self) -> StreamId {
        self.scope.stream()
    }

    /// The step's index (0 for the first step of this eager layer).
    pub fn index(&self) -> u64 {
        self.index
    }
}

impl<B: Backend> Drop for Step<'_, B> {
    fn drop(&mut self) {
        if let (Some((id, tag)), Some(r)) = (&self.traced, self.eager.recorder()) {
            r.scope_exit(*id, tag, self.scope.stream());
        }
    }
}

/// Steps of an engine (here, above the engine, so that `engine.rs` needs nothing of `Step`).
impl<B: Backend> Eager<B> {
    /// Opens a step: a named scope `name` on `stream` (its runs share a learned plan) and, when
    /// recording, a `scope_enter` row tagged `name` + the step's index.
    pub fn step(&self, name: &str, stream: StreamId) -> Step<'_, B> {
        let index = self.next_step_index();
        Step::open(self, name, index, stream)
    }
}
