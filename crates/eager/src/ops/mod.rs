//! The ops, as methods of [`Ctx`](super::Ctx): each checks shapes, allocates its output from the
//! context, enqueues one kernel on the context's stream and returns at once.
//!
//! | file            | forward                              | backward                          |
//! |-----------------|--------------------------------------|-----------------------------------|
//! | `elementwise`   | add, mul (row broadcast), scale, relu, gelu | add/mul, relu, gelu        |
//! | `matmul`        | matmul (2-D, batched, broadcast), transpose | lhs, rhs; transpose        |
//! | `norm`          | softmax (last dim), layer norm       | softmax, layer norm               |
//! | `reduce`        | sum, mean (last dim), sum over rows  | sum, mean                         |
//! | `loss`          | embedding lookup, cross-entropy      | embedding, cross-entropy          |
//!
//! Backward ops are hand-written, one per forward op; there is no autograd engine. An op that
//! produces parameter gradients next to activation gradients takes a second context for them.

mod elementwise;
mod loss;
mod matmul;
mod norm;
mod reduce;
