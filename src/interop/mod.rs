//! Interop with other CUDA libraries, above the allocator: their types over tidepool buffers.
//!
//! ```text
//!   cudarc (DevicePtr, DeviceSlice, PushKernelArg) ◀── CudaBuffer<T> ──▶ Buffer<CudaDevice>
//! ```

#[cfg(feature = "cuda")]
mod cuda_buffer;

#[cfg(feature = "cuda")]
pub use cuda_buffer::CudaBuffer;
