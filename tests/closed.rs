//! An allocator whose last handle is gone is *closed* (`src/allocator/closed.rs`; the pinned
//! host allocator's `Inner::close`): nothing can allocate from it again, so its cached memory
//! goes back to the device at once and each buffer's memory as it is freed. A `mem::forget`ten buffer keeps its own segment (or pages)
//! only, where it used to keep every cached segment of the allocator for the rest of the
//! process. The broken build `cfg(tidepool_broken = "closed_keeps_cache")` keeps the cache
//! until the last buffer goes, and fails these tests.

mod common;

use common::{N, gated};
use std::sync::Arc;
use tidepool::device::{Access, AccessKind, Kernel, Launch, SimDevice};
use tidepool::{
    Allocator, Config, Device, DeviceAddr, HostAllocator, MIB, PoolOptions, Residency, StreamId,
};

/// SimDevice's first segment address.
const BASE: u64 = 0x7f00_0000_0000;

fn setup(conf: &str) -> (Arc<SimDevice>, StreamId, Allocator<SimDevice>) {
    let dev = Arc::new(SimDevice::backed(512 * MIB));
    let s = dev.create_stream().unwrap();
    let alloc = Allocator::new(dev.clone(), Config::parse(conf).unwrap()).unwrap();
    (dev, s, alloc)
}

/// A kernel on `stream` that writes `buf` (so the sanitizer sees any early release).
fn write(dev: &SimDevice, stream: StreamId, ptr: DeviceAddr, bytes: u64) {
    let acc = vec![Access { ptr, bytes, kind: AccessKind::Write }];
    dev.launch(stream, Kernel::new("write", acc, |_| {})).unwrap();
}

/// Six 30 MiB segments cached (persistent and transient), one 4 KiB buffer forgotten: when the
/// last handle goes, every segment but the forgotten buffer's small one goes back.
#[test]
fn a_forgotten_buffer_keeps_only_its_own_segment() {
    let (dev, s, alloc) = setup("");
    let big: Vec<_> = (0..6)
        .map(|i| {
            let r = if i < 2 { Residency::Persistent } else { Residency::Transient };
            let b = alloc.alloc_in(30 * MIB, s, r).unwrap();
            write(&dev, s, b.ptr(), b.len());
            b
        })
        .collect();
    drop(big);
    let leak = alloc.alloc(N, s).unwrap();
    assert_eq!(leak.ptr().0, BASE + 6 * 30 * MIB, "a small segment after the six");
    std::mem::forget(leak);
    assert_eq!(dev.reserved_bytes(), 6 * 30 * MIB + 2 * MIB, "all of it cached");
    drop(alloc);
    assert_eq!(dev.live_segments(), vec![(DeviceAddr(BASE + 6 * 30 * MIB), 2 * MIB)]);
    assert_eq!(dev.counters().frees, 6);
    dev.synchronize().unwrap();
    assert_eq!(dev.violations(), vec![]);
}

/// The same over expandable segments: the ranges' free pages go back, the forgotten buffer's
/// page stays mapped.
#[test]
fn a_forgotten_buffer_keeps_only_its_own_pages() {
    let (dev, s, alloc) = setup("expandable_segments:true");
    let big: Vec<_> = (0..3).map(|_| alloc.alloc(30 * MIB, s).unwrap()).collect();
    for b in &big {
        write(&dev, s, b.ptr(), b.len());
    }
    drop(big);
    std::mem::forget(alloc.alloc(N, s).unwrap());
    let mapped = alloc.stats().blocks.reserved_bytes.all.current;
    assert!(mapped >= 90 * MIB + 2 * MIB, "{mapped}");
    assert_eq!(dev.physical_bytes(), mapped);
    drop(alloc);
    assert_eq!(dev.physical_bytes(), 2 * MIB, "the small range's one page");
    assert_eq!(dev.live_physical(), 1);
    let vm = dev.vm_counters();
    assert_eq!((vm.maps - vm.unmaps, vm.creates - vm.releases), (1, 1));
    dev.synchronize().unwrap();
    assert_eq!(dev.violations(), vec![]);
}

/// A closed allocator returns each segment as its last buffer goes, on any thread; the
/// buffers still work (a kernel writes them after the last handle is gone).
#[test]
fn a_closed_allocator_returns_each_segment_as_its_last_buffer_goes() {
    let (dev, s, alloc) = setup("");
    let t = dev.create_stream().unwrap();
    let a = alloc.alloc(3 * MIB, s).unwrap(); // a 20 MiB segment
    let b = alloc.alloc(25 * MIB, t).unwrap(); // a 26 MiB segment of stream t's
    let c = alloc.alloc(N, s).unwrap(); // a 2 MiB segment
    let d = alloc.alloc(N, s).unwrap(); // the same one
    drop(alloc.alloc(40 * MIB, s).unwrap()); // cached: goes back as the handle does
    assert_eq!(dev.live_segments().len(), 4);
    drop(alloc);
    assert_eq!(
        dev.live_segments(),
        vec![
            (DeviceAddr(BASE), 20 * MIB),
            (DeviceAddr(BASE + 20 * MIB), 26 * MIB),
            (DeviceAddr(BASE + 46 * MIB), 2 * MIB),
        ]
    );
    write(&dev, s, a.ptr(), a.len());
    write(&dev, t, b.ptr(), b.len());
    drop(c);
    assert_eq!(dev.live_segments().len(), 3, "`d` still uses the small segment");
    std::thread::spawn(move || drop(d)).join().unwrap();
    assert_eq!(dev.live_segments().len(), 2);
    drop(b);
    assert_eq!(dev.live_segments(), vec![(DeviceAddr(BASE), 20 * MIB)]);
    drop(a); // the last buffer: the allocator itself goes
    assert!(dev.live_segments().is_empty());
    assert_eq!(dev.counters().mallocs, dev.counters().frees);
    dev.synchronize().unwrap();
    assert_eq!(dev.violations(), vec![]);
}

/// A buffer used on another stream (`record_stream`) and freed after the last handle went: its
/// segment goes back only once that stream's work on it completed (a host wait, as
/// `caching:false` makes), so the gated kernel still reading it sees no release under it.
#[test]
fn a_closed_allocator_waits_for_other_streams_before_a_release() {
    let (dev, s, alloc) = setup("");
    let t = dev.create_stream().unwrap();
    let x = alloc.alloc(N, s).unwrap();
    let keep = alloc.alloc(25 * MIB, s).unwrap(); // keeps the allocator up
    let (k, open) = gated(x.ptr(), N, AccessKind::Read);
    dev.launch(t, k).unwrap();
    x.record_stream(t).unwrap();
    drop(alloc);
    let opener = std::thread::spawn(move || {
        std::thread::sleep(std::time::Duration::from_millis(50));
        open.send(()).unwrap();
    });
    drop(x); // waits for `t`'s read, then the small segment goes back
    assert_eq!(dev.live_segments(), vec![(DeviceAddr(BASE + 2 * MIB), 26 * MIB)]);
    opener.join().unwrap();
    drop(keep);
    assert!(dev.live_segments().is_empty());
    dev.synchronize().unwrap();
    assert_eq!(dev.violations(), vec![], "released under `t`'s read");
}

/// A private pool whose handles are all gone while a graph captured into it lives: the graph's
/// replays write the pool's free memory (its capture freed those blocks), so the pool keeps it
/// until the graph goes, and then returns it.
#[test]
fn a_closed_pool_keeps_what_a_live_graph_replays_into() {
    let (dev, s, alloc) = setup("");
    let pool = alloc.new_pool(PoolOptions::default()).unwrap();
    alloc.begin_capture(s, Some(&pool)).unwrap();
    let tmp = alloc.alloc(N, s).unwrap();
    let p = tmp.ptr();
    let acc = vec![Access { ptr: p, bytes: N, kind: AccessKind::Write }];
    dev.launch(s, Kernel::replayable("w", acc, move |m| m.write(p, &[3; N as usize]).unwrap()))
        .unwrap();
    drop(tmp); // free in the pool, written by every replay
    let graph = alloc.end_capture(s).unwrap();
    drop(pool);
    assert_eq!(dev.live_segments(), vec![(p, 2 * MIB)], "the pool's segment stays");
    for _ in 0..3 {
        graph.launch(s).unwrap();
    }
    dev.synchronize().unwrap();
    assert_eq!(dev.violations(), vec![]);
    drop(graph);
    assert!(dev.live_segments().is_empty(), "{:?}", dev.live_segments());
    drop(alloc);
    assert_eq!(dev.counters().mallocs, dev.counters().frees);
}

/// A named scope's planned unbound buffer outlives the scope and the last handle: it holds its
/// plan's region, which goes back (with its segment) when the buffer does, not at some later
/// free (found by the fuzz harness's handles-first teardown: `release_region` took no lock
/// section while the plan still held the region).
#[test]
fn a_closed_allocator_returns_a_region_when_its_last_buffer_goes() {
    let (dev, s, alloc) = setup("");
    let t = dev.create_stream().unwrap();
    let keep = alloc.alloc(25 * MIB, t).unwrap(); // keeps the allocator up
    for _ in 0..2 {
        let scope = alloc.named_scope("step", s);
        drop(scope.alloc_unbound(2 * MIB).unwrap());
    }
    let scope = alloc.named_scope("step", s);
    let x = scope.alloc_unbound(2 * MIB).unwrap();
    assert!(x.is_planned());
    drop(scope); // `x` escapes: the region stays pinned
    let region = alloc.stats().plan_region_bytes;
    assert_eq!(region, 2 * MIB);
    let seg = (DeviceAddr(BASE + 46 * MIB), 20 * MIB); // (the learning runs' went back)
    assert_eq!(dev.live_segments(), vec![(DeviceAddr(BASE), 26 * MIB), seg]);
    drop(alloc);
    assert_eq!(dev.live_segments().len(), 2, "the region's segment holds `x`");
    write(&dev, s, x.ptr(), x.len());
    drop(x);
    assert_eq!(dev.live_segments(), vec![(DeviceAddr(BASE), 26 * MIB)]);
    drop(keep);
    assert!(dev.live_segments().is_empty());
    dev.synchronize().unwrap();
    assert_eq!(dev.violations(), vec![]);
}

/// The pinned host allocator: three cached blocks and a forgotten one; when the last handle
/// goes, the cached ones are freed (`cuMemFreeHost`) and the forgotten one alone stays
/// page-locked. A buffer freed later goes back to the device at once.
#[test]
fn a_forgotten_pinned_buffer_keeps_only_its_own_block() {
    let dev = Arc::new(SimDevice::backed(64 * MIB));
    let pinned = HostAllocator::new(dev.clone());
    drop([pinned.alloc(MIB).unwrap(), pinned.alloc(MIB).unwrap(), pinned.alloc(4096).unwrap()]);
    let kept = pinned.alloc(8192).unwrap();
    let leak = pinned.alloc(512).unwrap();
    let leaked = leak.host_ptr();
    std::mem::forget(leak);
    assert_eq!(dev.host_reserved_bytes(), 2 * MIB + 4096 + 8192 + 512);
    drop(pinned);
    assert_eq!(dev.host_reserved_bytes(), 8192 + 512, "the cached blocks went back");
    drop(kept);
    assert_eq!(dev.live_host_allocations(), vec![(leaked, 512)]);
}

/// A closed pinned allocator waits for a buffer's copy before it frees the block: the upload
/// reads the host memory until the gated stream runs it.
#[test]
fn a_closed_pinned_allocator_frees_a_block_after_its_copy() {
    let (dev, s, alloc) = setup("");
    let pinned = HostAllocator::new(dev.clone());
    let dst = alloc.alloc(N, s).unwrap();
    let (k, open) = gated(dst.ptr(), N, AccessKind::Read);
    dev.launch(s, k).unwrap(); // the upload waits behind it
    let mut src = pinned.alloc(N).unwrap();
    src.as_mut_slice().unwrap().fill(9);
    src.upload(&dst).unwrap();
    let keep = pinned.alloc(512).unwrap(); // keeps the allocator up past `src`
    drop(pinned);
    let opener = std::thread::spawn(move || {
        std::thread::sleep(std::time::Duration::from_millis(50));
        open.send(()).unwrap();
    });
    drop(src); // waits for the copy, then frees the block
    assert_eq!(dev.host_reserved_bytes(), 512, "`src`'s block went back");
    opener.join().unwrap();
    drop(keep);
    assert_eq!(dev.host_reserved_bytes(), 0);
    assert_eq!(common::device_bytes(&dev, &dst), vec![9; N as usize]);
    dev.synchronize().unwrap();
    assert_eq!(dev.violations(), vec![]);
}

/// The pinned allocator's pooled events (one per copy recorded, reused by later copies) go
/// back to the device when the last handle goes, as its free blocks do: a `mem::forget`ten
/// buffer keeps the allocator's core alive, and used to keep every event it ever pooled. A live
/// buffer that copies after the close makes its own event; the one its second copy supersedes
/// goes back at once, and its last one as the buffer goes.
#[test]
fn a_forgotten_pinned_buffer_keeps_no_event_of_its_closed_allocator() {
    let (dev, s, alloc) = setup("");
    let pinned = HostAllocator::new(dev.clone());
    let dst = alloc.alloc(N, s).unwrap();
    let forgotten = pinned.alloc(N).unwrap();
    let mut used: Vec<_> = (0..8).map(|_| pinned.alloc(N).unwrap()).collect();
    used.iter_mut().for_each(|h| h.upload(&dst).unwrap());
    let mut late = pinned.alloc(N).unwrap();
    assert_eq!(dev.live_events(), 8, "one per upload");
    drop(used);
    dev.synchronize().unwrap();
    pinned.process_events().unwrap();
    assert_eq!(dev.live_events(), 8, "pooled");
    std::mem::forget(forgotten);
    drop(pinned);
    assert_eq!(dev.live_events(), 0, "the closed allocator kept its pooled events");
    assert_eq!(dev.host_reserved_bytes(), 2 * N, "the forgotten buffer's block and `late`'s");
    late.upload(&dst).unwrap();
    late.upload(&dst).unwrap();
    assert_eq!(dev.live_events(), 1, "the superseded event went back");
    drop(late);
    assert_eq!(dev.live_events(), 0);
    assert_eq!(dev.host_reserved_bytes(), N, "only the forgotten buffer's block is left");
    drop((dst, alloc));
    dev.synchronize().unwrap();
    assert_eq!(dev.violations(), vec![]);
}

/// A handle cloned from a buffer's ([`tidepool::PinnedBuffer::allocator`]) reopens a closed
/// pinned allocator: it caches again.
#[test]
fn a_pinned_handle_cloned_from_a_buffer_reopens_the_cache() {
    let dev = Arc::new(SimDevice::backed(64 * MIB));
    let pinned = HostAllocator::new(dev.clone());
    let a = pinned.alloc(4096).unwrap();
    drop(pinned);
    let again = a.allocator().clone();
    drop(a);
    assert_eq!(dev.host_reserved_bytes(), 4096, "cached: a handle is alive");
    let b = again.alloc(4096).unwrap();
    assert_eq!(again.stats().num_host_alloc, 1, "reused");
    drop((b, again));
    assert_eq!(dev.host_reserved_bytes(), 0);
}

/// The last handle goes while two threads drop buffers: whatever the interleaving (a free
/// racing the stash's close, the flush, the release), once they are done the only memory left
/// on the device is the segment or pages of the one buffer kept, and nothing once it goes.
/// Plain, expandable and unbiased lanes, 200 rounds each.
#[test]
fn a_last_handle_dropped_while_other_threads_free_leaves_only_live_memory() {
    for conf in ["", "expandable_segments:true", "biased_lanes:false"] {
        for round in 0..200 {
            let dev = Arc::new(SimDevice::new(1 << 30));
            let s = dev.create_stream().unwrap();
            let alloc = Allocator::new(dev.clone(), Config::parse(conf).unwrap()).unwrap();
            let mut bufs: Vec<_> = (0..64u64)
                .map(|i| {
                    let size = if i % 3 == 0 { 3 * MIB } else { 4096 * (1 + i % 5) };
                    alloc.alloc(size, s).unwrap()
                })
                .collect();
            for _ in 0..8 {
                drop(alloc.alloc(4096, s).unwrap()); // cached in the stream's lane
                drop(alloc.alloc(5 * MIB, s).unwrap()); // in its large slot
            }
            let kept = alloc.alloc(512, s).unwrap();
            let half = bufs.split_off(32);
            let start = Arc::new(std::sync::Barrier::new(3));
            let threads = [bufs, half].map(|v| {
                let start = start.clone();
                std::thread::spawn(move || {
                    start.wait();
                    v.into_iter().for_each(drop);
                })
            });
            start.wait();
            drop(alloc);
            threads.into_iter().for_each(|t| t.join().unwrap());
            let p = kept.ptr().0;
            let holds = |&(a, n): &(DeviceAddr, u64)| a.0 <= p && p < a.0 + n;
            let (segs, maps) = (dev.live_segments(), dev.live_mappings());
            assert!(segs.iter().all(holds), "{conf:?} round {round}: {segs:x?}");
            assert!(maps.iter().all(holds), "{conf:?} round {round}: {maps:x?}");
            drop(kept);
            assert!(dev.live_segments().is_empty() && dev.live_mappings().is_empty());
        }
    }
}
