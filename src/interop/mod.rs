//! Interop with other CUDA libraries, above the allocator: their types over tidepool buffers.
//!
//! ```text
//!   cudarc (DevicePtr, DeviceSlice, PushKernelArg) ◀── CudaBuffer<T> ──▶ Buffer<CudaDevice>
//! ```

#[cfg(feature = "cuda")]
mod cuda_buffer;
// Compiled without the feature too: the SimDevice tests what `CudaBuffer::from_buffer` checks.
#[cfg_attr(not(feature = "cuda"), allow(dead_code))]
mod elements;

#[cfg(feature = "cuda")]
pub use cuda_buffer::{CudaBuffer, FromBufferError};
