//! The eager tensor layer: f32 [`Tensor`]s whose storage comes from the [`tidepool::Allocator`],
//! ops enqueued asynchronously on streams through one op interface ([`Backend`]) with two back
//! ends — host kernels on [`tidepool::SimDevice`] ([`HostBackend`]) and NVRTC/cuBLAS kernels on
//! `CudaDevice` (`CudaBackend`, feature `cuda`) — optimizers, and a trace recorder.
//! It exists to drive the allocator with real eager workloads, not to compete with a tensor
//! library.
//!
//! ```text
//!   models/ (MLP, transformer block, synthetic data)   optim (SGD, AdamW)   record (CSV trace)
//!      │ forward/backward by hand
//!   Ctx ── ops/ (elementwise, matmul, norm, reduce, loss) ── KernelOp ──▶ Backend::launch
//!      │ outputs from                                                     ├ HostBackend (host/)
//!   Step (named Scope, Transient) │ Eager::ctx (allocator, Transient)     └ CudaBackend (cuda/)
//!   Tensor::parameter (allocator, Persistent)
//! ```
//!
//! Residency follows how a tensor is made: parameters and optimizer state are Persistent;
//! activations made inside a [`Step`] come from its scope (so a repeated step is served from a
//! learned plan, with no device malloc and no search); gradients that must outlive the step come
//! from the allocator as ordinary Transient buffers.
//!
//! ```
//! use tidepool::StreamId;
//! use tidepool_eager::{Eager, Tensor};
//!
//! let eager = Eager::sim(64 << 20).unwrap();
//! let w = Tensor::parameter(&eager, &[1.0, 2.0, 3.0, 4.0], &[2, 2], StreamId::DEFAULT).unwrap();
//! for _ in 0..3 {
//!     let step = eager.step("step", StreamId::DEFAULT);
//!     let cx = step.ctx();
//!     let x = cx.tensor(&[1.0, 1.0], &[1, 2]).unwrap();
//!     let y = cx.relu(&cx.matmul(&x, &w).unwrap()).unwrap();
//!     assert_eq!(y.to_host().unwrap(), vec![4.0, 6.0]);
//! }
//! assert!(eager.allocator().stats().plan_hits > 0);
//! ```

mod backend;
mod ctx;
mod engine;
mod error;
pub mod host;
pub mod models;
mod ops;
mod optim;
mod pinned;
mod record;
mod shape;
mod step;
mod tensor;

#[cfg(feature = "cuda")]
mod cuda;

pub use backend::{Backend, BinaryOp, ELEM, KernelOp, UnaryOp};
pub use ctx::Ctx;
#[cfg(feature = "cuda")]
pub use cuda::CudaBackend;
pub use engine::{Eager, EagerStats, SimEager};
pub use error::{EagerError, Result};
pub use host::HostBackend;
pub use optim::{AdamW, Optimizer, Sgd};
pub use record::{Recorder, TRACE_HEADER, TraceTag};
pub use shape::{MAX_RANK, Shape};
pub use step::Step;
pub use tensor::Tensor;
