//! CUDA-graph capture and private pools, probed the way users break them (a review against
//! PyTorch's `CUDACachingAllocator` and `test_cuda.py`): guards begun during a capture, errors
//! in the middle of one, graphs and buffers forgotten or outliving their allocator, captures on
//! several threads at once. Exact addresses and byte counts; the sanitizer checks every replay.

mod common;

use common::{N, device_bytes};
use std::sync::Arc;
use tidepool::device::{Access, AccessKind, Kernel, Launch, SIM_BASE};
use tidepool::{
    AllocError, Allocator, Config, Device, MIB, MemPool, PoolOptions, SimDevice, StreamId,
};

const SEG: u64 = 2 * MIB; // a small-pool segment

/// A replayable kernel writing `byte` over `[p, p + N)`.
fn write_at(p: tidepool::DeviceAddr, byte: u8) -> Kernel {
    let acc = vec![Access { ptr: p, bytes: N, kind: AccessKind::Write }];
    Kernel::replayable("write", acc, move |m| m.write(p, &[byte; N as usize]).unwrap())
}

fn allocated(p: &MemPool<SimDevice>) -> u64 {
    p.stats().blocks.allocated_bytes.all.current
}

fn reserved(p: &MemPool<SimDevice>) -> u64 {
    p.stats().blocks.reserved_bytes.all.current
}

struct Setup {
    dev: Arc<SimDevice>,
    s: StreamId,
    t: StreamId,
    alloc: Allocator<SimDevice>,
}

fn setup() -> Setup {
    let dev = Arc::new(SimDevice::backed(256 * MIB));
    let s = dev.create_stream().unwrap();
    let t = dev.create_stream().unwrap();
    let alloc = Allocator::new(dev.clone(), Config::default()).unwrap();
    Setup { dev, s, t, alloc }
}

/// A guard begun on the capturing stream during the capture (PyTorch's
/// `with torch.cuda.graph(g): with torch.cuda.use_mem_pool(pool): x = ...`). Before the fix
/// the guard, the stream's latest route, won: `x` came from the guard's pool, which no graph
/// holds, so once `x` was dropped after the capture the pool handed its block to `y` on another
/// stream, and each replay of the graph wrote over `y`. Now the capture's pool serves every
/// allocation of a captured stream and `use_pool` refuses a capturing stream.
#[test]
fn a_guard_begun_during_a_capture_does_not_take_its_allocations() {
    let Setup { dev, s, t, alloc } = setup();
    let pool2 = alloc.new_pool(PoolOptions::default()).unwrap();
    alloc.begin_capture(s, None).unwrap();
    let guard = alloc.use_pool(&pool2, s);
    let x = alloc.alloc(N, s).unwrap(); // the graph's pool: its own segment
    let x_ptr = x.ptr();
    let pool2_during = allocated(&pool2);
    dev.launch(s, write_at(x_ptr, 1)).unwrap();
    drop(guard);
    let graph = alloc.end_capture(s).unwrap();
    drop(x); // back into the graph's pool, which only captures are given
    let guard2 = alloc.use_pool(&pool2, t).unwrap();
    let y = alloc.alloc(N, t).unwrap();
    drop(guard2);
    dev.launch(t, write_at(y.ptr(), 2)).unwrap();
    graph.launch(s).unwrap();
    dev.synchronize().unwrap();
    assert_eq!(dev.violations(), vec![], "the replay wrote over y");
    assert_eq!(device_bytes(&dev, &y), vec![2u8; N as usize]);
    assert_ne!(y.ptr(), x_ptr);
    assert_eq!(x_ptr.0, SIM_BASE, "the graph's pool's first segment");
    assert_eq!(y.ptr().0, SIM_BASE + SEG, "pool2's first segment");
    assert_eq!(pool2_during, 0);
    assert_eq!((allocated(graph.pool()), reserved(graph.pool())), (0, SEG));
    assert_eq!((allocated(&pool2), reserved(&pool2)), (N, SEG));
    assert!(matches!(alloc.use_pool(&pool2, s), Ok(_)), "the capture is over");
    // The refusal itself (a fresh capture: the guard above was refused, not given).
    alloc.begin_capture(s, None).unwrap();
    let refused = alloc.use_pool(&pool2, s).map(|_| ());
    assert!(matches!(refused, Err(AllocError::Capture { .. })), "{refused:?}");
    drop(alloc.end_capture(s).unwrap());
    drop((graph, y));
    assert!(dev.violations().is_empty());
}

/// A guard that routed streams before the capture: the capture's pool serves the capturing
/// stream and a stream that joins the capture (PyTorch's `get_pool` searches
/// `captures_underway` last-in first: the capture, begun after the guard, wins on both).
/// After the capture the guard routes again.
#[test]
fn a_guard_begun_before_a_capture_yields_to_it_on_captured_streams() {
    let Setup { dev, s, t, alloc } = setup();
    let pool2 = alloc.new_pool(PoolOptions::default()).unwrap();
    let gs = alloc.use_pool(&pool2, s).unwrap();
    let gt = alloc.use_pool(&pool2, t).unwrap();
    alloc.begin_capture(s, None).unwrap();
    let fork = dev.create_event().unwrap();
    dev.record_event(fork, s).unwrap();
    dev.wait_event(t, fork).unwrap(); // t joins the capture
    let a = alloc.alloc(N, s).unwrap();
    let b = alloc.alloc(N, t).unwrap();
    // Each stream its own segment of the graph's pool (blocks are per stream, as PyTorch's).
    assert_eq!((a.ptr().0, b.ptr().0), (SIM_BASE, SIM_BASE + SEG));
    assert_eq!(allocated(&pool2), 0);
    dev.launch(s, write_at(a.ptr(), 1)).unwrap();
    dev.launch(t, write_at(b.ptr(), 2)).unwrap();
    let join = dev.create_event().unwrap();
    dev.record_event(join, t).unwrap();
    dev.wait_event(s, join).unwrap();
    let graph = alloc.end_capture(s).unwrap();
    assert_eq!((allocated(graph.pool()), reserved(graph.pool())), (2 * N, 2 * SEG));
    let c = alloc.alloc(N, t).unwrap(); // the guard again
    assert_eq!(c.ptr().0, SIM_BASE + 2 * SEG);
    assert_eq!((allocated(&pool2), reserved(&pool2)), (N, SEG));
    drop((a, b));
    let d = alloc.alloc(N, s).unwrap(); // pool2 (a segment for s), not the graph's freed block
    assert_eq!(d.ptr().0, SIM_BASE + 3 * SEG);
    assert_eq!((allocated(&pool2), reserved(&pool2)), (2 * N, 2 * SEG));
    drop((gs, gt));
    dev.launch(s, write_at(d.ptr(), 3)).unwrap();
    graph.launch(s).unwrap();
    dev.synchronize().unwrap();
    assert!(dev.violations().is_empty(), "{:?}", dev.violations());
    assert_eq!(device_bytes(&dev, &d), vec![3u8; N as usize]);
    drop((c, d, graph));
}
