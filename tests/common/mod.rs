//! Kernels shared by the whole-allocator tests (a module, not a test target).

use std::sync::mpsc;
use tidepool::DeviceAddr;
use tidepool::device::{Access, AccessKind, Kernel};

/// Bytes the shared kernels touch.
pub const N: u64 = 4096;

/// A kernel that waits for the returned gate, then writes `byte` over `[ptr, ptr + N)`: work
/// that is unfinished until the test says so, so nothing depends on timing.
pub fn gated_write(ptr: DeviceAddr, byte: u8) -> (Kernel, mpsc::Sender<()>) {
    let (open, gate) = mpsc::channel::<()>();
    let k = Kernel::new(
        "gated_write",
        vec![Access { ptr, bytes: N, kind: AccessKind::Write }],
        move |m| {
            let _ = gate.recv();
            m.write(ptr, &[byte; N as usize]).unwrap();
        },
    );
    (k, open)
}
