//! Expandable segments (`expandable_segments:true`) on SimDevice, with exact addresses and pages:
//! growth extends the end block, whole free pages are unmapped (interior ones too), the end of a
//! range is used last, a map failure in the middle of a growth rolls back, pages move between
//! streams only after the owner's work (strict) or with the new stream waiting for it
//! (wait_event), persistent ranges are left alone by `empty_cache`, `release_threshold`, the
//! fallback on a device without virtual memory, and nothing leaks.
//!
//! Ranges are reserved from the simulated address space in order, each twice the device's
//! capacity: the first one a test makes starts at `SIM_BASE`, the next one `2 × capacity` bytes
//! above it. Pages are 2 MiB.

mod common;

use common::{assert_no_leak, gated_write_bytes as gated_write};
use std::sync::Arc;
use tidepool::MIB;
use tidepool::device::{Access, AccessKind, Kernel, Launch, SIM_BASE, SimDevice};
use tidepool::{AllocError, Allocator, Config, Device, DeviceAddr, Residency, StreamId};

const P: u64 = 2 * MIB;
const CAP: u64 = 64 * MIB;

use common::expandable_setup as setup;

fn base() -> u64 {
    SIM_BASE
}

/// The pages the device has mapped, as page offsets from `base`.
fn mapped_pages(dev: &SimDevice, base: u64) -> Vec<u64> {
    mapped_chunks(dev, base).into_iter().flat_map(|(p, n)| p..p + n).collect()
}

/// The device's mappings (one per physical chunk) as (first page, pages) from `base`.
fn mapped_chunks(dev: &SimDevice, base: u64) -> Vec<(u64, u64)> {
    dev.live_mappings()
        .iter()
        .map(|&(a, n)| (assert_eq!(n % P, 0), ((a.0 - base) / P, n / P)).1)
        .collect()
}

#[test]
fn growth_extends_the_free_end_block() {
    let (dev, alloc) = setup("", CAP);
    let a = alloc.alloc(3 * MIB, StreamId::DEFAULT).unwrap();
    assert_eq!(a.ptr(), DeviceAddr(base()));
    // [a 3 MiB][free 1 MiB] over two pages.
    assert_eq!(mapped_pages(&dev, base()), vec![0, 1]);
    assert_eq!(alloc.reserved_bytes(), 2 * P);
    // The next 3 MiB do not fit in the free 1 MiB: the end block grows by one page.
    let b = alloc.alloc(3 * MIB, StreamId::DEFAULT).unwrap();
    assert_eq!(b.ptr(), DeviceAddr(base() + 3 * MIB));
    assert_eq!(mapped_pages(&dev, base()), vec![0, 1, 2]);
    let s = alloc.stats();
    assert_eq!(s.blocks.reserved_bytes.all.current, 3 * P);
    assert_eq!(s.blocks.reserved_bytes.large_pool.current, 3 * P);
    assert_eq!(s.blocks.segment.all.current, 1, "one run");
    assert_eq!(s.blocks.allocated_bytes.all.current, 6 * MIB);
    // One physical chunk per growth: two pages, then one.
    assert_eq!(mapped_chunks(&dev, base()), vec![(0, 2), (2, 1)]);
    assert_eq!((s.num_device_map, s.num_physical_create, s.num_device_unmap), (2, 2, 0));
    assert_eq!(s.num_device_alloc, 0, "no cuMemAlloc");
    assert!(s.expandable_segments);
    assert_eq!(s.virtual_reserved_bytes, 2 * CAP);
    assert_eq!(dev.physical_bytes(), 3 * P);
    let ranges = alloc.expandable_ranges();
    assert_eq!(ranges.len(), 1);
    let r = &ranges[0];
    assert_eq!((r.base, r.virtual_size, r.mapped_bytes), (DeviceAddr(base()), 2 * CAP, 3 * P));
    assert_eq!((r.free_bytes, r.free_page_bytes, r.runs.len()), (0, 0, 1));
    alloc.check_invariants().unwrap();
    drop((a, b));
    alloc.check_invariants().unwrap();
    drop(alloc);
    assert_no_leak(&dev);
}

#[test]
fn interior_free_pages_are_unmapped_and_mapped_again() {
    let (dev, alloc) = setup("", CAP);
    let s0 = StreamId::DEFAULT;
    let a = alloc.alloc(4 * MIB, s0).unwrap();
    let b = alloc.alloc(4 * MIB, s0).unwrap();
    let c = alloc.alloc(4 * MIB, s0).unwrap();
    assert_eq!([a.ptr(), b.ptr(), c.ptr()], [0, 4, 8].map(|m| DeviceAddr(base() + m * MIB)));
    drop(b);
    alloc.empty_cache().unwrap();
    // Pages 2 and 3 (b's chunk) are gone; the run is cut in two.
    assert_eq!(mapped_chunks(&dev, base()), vec![(0, 2), (4, 2)]);
    let s = alloc.stats();
    assert_eq!(s.blocks.reserved_bytes.all.current, 4 * P);
    assert_eq!(s.blocks.segment.all.current, 2);
    assert_eq!((s.num_device_unmap, s.num_physical_release), (1, 1));
    assert_eq!(dev.physical_bytes(), 4 * P);
    let runs = &alloc.expandable_ranges()[0].runs;
    assert_eq!(runs, &vec![(DeviceAddr(base()), 2 * P), (DeviceAddr(base() + 8 * MIB), 2 * P)]);
    alloc.check_invariants().unwrap();
    // The hole needs as few new pages as the end: the lower address wins, joining the runs.
    let d = alloc.alloc(4 * MIB, s0).unwrap();
    assert_eq!(d.ptr(), DeviceAddr(base() + 4 * MIB));
    assert_eq!(mapped_pages(&dev, base()), vec![0, 1, 2, 3, 4, 5]);
    assert_eq!(alloc.stats().blocks.segment.all.current, 1);
    alloc.check_invariants().unwrap();
    drop((a, c, d));
    alloc.empty_cache().unwrap();
    assert_eq!(dev.live_mappings(), vec![]);
    assert_eq!(alloc.reserved_bytes(), 0);
    // The virtual range stays for the next growth.
    assert_eq!(dev.virtual_bytes(), 2 * CAP);
    drop(alloc);
    assert_no_leak(&dev);
}

#[test]
fn the_end_of_a_range_is_used_last() {
    let (dev, alloc) = setup("", CAP);
    let s0 = StreamId::DEFAULT;
    let a = alloc.alloc(4 * MIB, s0).unwrap();
    let b = alloc.alloc(4 * MIB, s0).unwrap();
    let c = alloc.alloc(2 * MIB, s0).unwrap();
    assert_eq!(c.ptr(), DeviceAddr(base() + 8 * MIB));
    drop(a);
    drop(c);
    // Best fit alone would take the 2 MiB end block; the 4 MiB hole at the start serves instead.
    let d = alloc.alloc(2 * MIB, s0).unwrap();
    assert_eq!(d.ptr(), DeviceAddr(base()));
    let r = alloc.expandable_ranges()[0].clone();
    // Free: a page of a's chunk (d holds the other) and c's one-page chunk, which alone a
    // release could unmap.
    assert_eq!((r.mapped_bytes, r.free_bytes, r.free_page_bytes), (5 * P, 2 * P, P));
    alloc.check_invariants().unwrap();
    // The rest of the hole serves the next 2 MiB; then only the end block fits: it serves (no
    // device call).
    let f = alloc.alloc(2 * MIB, s0).unwrap();
    assert_eq!(f.ptr(), DeviceAddr(base() + 2 * MIB));
    let g = alloc.alloc(2 * MIB, s0).unwrap();
    assert_eq!(g.ptr(), DeviceAddr(base() + 8 * MIB));
    drop(g);
    // 6 MiB fit nowhere: the end block grows by two new pages, one chunk.
    let maps = alloc.stats().num_device_map;
    let e = alloc.alloc(6 * MIB, s0).unwrap();
    assert_eq!(e.ptr(), DeviceAddr(base() + 8 * MIB));
    assert_eq!(alloc.stats().num_device_map, maps + 1);
    assert_eq!(mapped_chunks(&dev, base()), vec![(0, 2), (2, 2), (4, 1), (5, 2)]);
    assert_eq!(mapped_pages(&dev, base()), (0..7).collect::<Vec<_>>());
    alloc.check_invariants().unwrap();
    drop(f);
    drop((b, d, e));
    alloc.check_invariants().unwrap();
    drop(alloc);
    assert_no_leak(&dev);
}

#[test]
fn a_map_failure_in_the_middle_of_a_growth_rolls_back() {
    const BIG: u64 = 256 * MIB;
    let (dev, alloc) = setup("", BIG);
    let s0 = StreamId::DEFAULT;
    // 70 MiB are 35 pages: two chunks (32 pages, 3 pages). The second mapping fails (once):
    // the first is undone, both chunks released, and the out-of-memory ladder's retry succeeds.
    dev.fail_nth_vm_map(Some(2));
    let a = alloc.alloc(70 * MIB, s0).unwrap();
    assert_eq!(a.ptr(), DeviceAddr(base()));
    let v = dev.vm_counters();
    assert_eq!((v.creates, v.releases, v.maps, v.failed_maps, v.unmaps), (4, 2, 3, 1, 1));
    assert_eq!(mapped_chunks(&dev, base()), vec![(0, 32), (32, 3)]);
    let s = alloc.stats();
    assert_eq!((s.num_alloc_retries, s.num_ooms), (1, 0));
    assert_eq!((s.num_physical_create, s.num_physical_release), (4, 2));
    assert_eq!((s.num_device_map, s.num_device_unmap), (3, 1));
    assert_eq!(dev.physical_bytes(), 35 * P);
    alloc.check_invariants().unwrap();
    // The second creation of a two-chunk growth fails (once): the first chunk is released, the
    // ladder's retry succeeds, and after it nothing is left half done.
    let before = (dev.physical_bytes(), dev.live_mappings(), alloc.reserved_bytes());
    dev.fail_nth_vm_create(Some(2));
    let b = alloc.alloc(66 * MIB, s0).unwrap();
    assert_eq!(b.ptr(), DeviceAddr(base() + 70 * MIB));
    let v = dev.vm_counters();
    assert_eq!((v.creates, v.failed_creates, v.releases), (4 + 1 + 2, 1, 2 + 1));
    assert_eq!(mapped_chunks(&dev, base()), vec![(0, 32), (32, 3), (35, 32), (67, 1)]);
    drop(b);
    alloc.empty_cache().unwrap();
    assert_eq!((dev.physical_bytes(), dev.live_mappings(), alloc.reserved_bytes()), before);
    // Out of device memory: a refusal with the report, and the allocator works on.
    match alloc.alloc(BIG, s0) {
        Err(AllocError::OutOfMemory(r)) => {
            assert_eq!(r.reserved, 35 * P);
            assert_eq!(r.segment, BIG, "what the growth needed");
            assert_eq!(r.mapped_free, 0);
        }
        other => panic!("expected out of memory, got {other:?}"),
    }
    assert_eq!(dev.physical_bytes(), 35 * P);
    alloc.check_invariants().unwrap();
    let c = alloc.alloc(MIB * 3 / 2, s0).unwrap();
    assert_eq!(c.ptr(), DeviceAddr(base() + 70 * MIB));
    drop((a, c));
    drop(alloc);
    assert_no_leak(&dev);
}

#[test]
fn the_oom_report_says_what_is_mapped_but_free() {
    let (_dev, alloc) = setup("", 16 * MIB);
    let s0 = StreamId::DEFAULT;
    let keep = alloc.alloc(MIB, s0).unwrap(); // small range: one page, mostly free
    let p = alloc.alloc_in(4 * MIB, s0, Residency::Persistent).unwrap();
    drop(p); // two whole free pages of a persistent range
    match alloc.alloc(12 * MIB, s0) {
        Err(AllocError::OutOfMemory(r)) => {
            assert_eq!(r.reserved, 3 * P);
            assert_eq!(r.mapped_free, P - MIB + 2 * P);
            assert_eq!(r.mapped_free_in_used_pages, P - MIB);
            assert_eq!(r.mapped_free_persistent, 2 * P);
            let msg = r.to_string();
            assert!(msg.contains("Expandable segments hold 5.00 MiB mapped but free"), "{msg}");
            assert!(msg.contains("release_persistent"), "{msg}");
        }
        other => panic!("expected out of memory, got {other:?}"),
    }
    drop(keep);
}

#[test]
fn persistent_ranges_are_left_alone_by_empty_cache() {
    let (dev, alloc) = setup("", CAP);
    let s0 = StreamId::DEFAULT;
    let w = alloc.alloc_in(4 * MIB, s0, Residency::Persistent).unwrap();
    let t = alloc.alloc(4 * MIB, s0).unwrap();
    let (wp, tp) = (w.ptr(), t.ptr());
    assert_eq!(wp, DeviceAddr(base()), "the persistent range is made first");
    assert_eq!(tp, DeviceAddr(base() + 2 * CAP), "the transient one above it");
    drop((w, t));
    alloc.empty_cache().unwrap();
    assert_eq!(mapped_pages(&dev, base()), vec![0, 1]);
    let s = alloc.stats();
    assert_eq!(s.blocks.reserved_bytes.persistent.current, 2 * P);
    assert_eq!(s.blocks.reserved_bytes.transient.current, 0);
    alloc.release_persistent().unwrap();
    assert_eq!(dev.live_mappings(), vec![]);
    assert_eq!(alloc.reserved_bytes(), 0);
    alloc.check_invariants().unwrap();
    drop(alloc);
    assert_no_leak(&dev);
}

#[test]
fn small_blocks_of_both_residencies_share_the_small_range() {
    let (dev, alloc) = setup("", CAP);
    let s0 = StreamId::DEFAULT;
    // A weight's 16 KiB bias and a 16 KiB activation: one small range, one page, side by side
    // (a persistent small range would map a second page).
    let w = alloc.alloc_in(16 * 1024, s0, Residency::Persistent).unwrap();
    let t = alloc.alloc(16 * 1024, s0).unwrap();
    assert_eq!(w.ptr(), DeviceAddr(base()));
    assert_eq!(t.ptr(), DeviceAddr(base() + 16 * 1024));
    assert_eq!(mapped_chunks(&dev, base()), vec![(0, 1)]);
    let ranges = alloc.expandable_ranges();
    assert_eq!(ranges.len(), 1);
    assert_eq!(ranges[0].residency, Residency::Transient);
    let s = alloc.stats();
    assert_eq!(s.blocks.reserved_bytes.all.current, P);
    assert_eq!(s.blocks.allocated_bytes.transient.current, 32 * 1024, "counted as transient");
    assert_eq!(s.blocks.allocated_bytes.persistent.current, 0);
    // Large persistent blocks keep a range of their own.
    let big = alloc.alloc_in(4 * MIB, s0, Residency::Persistent).unwrap();
    assert_eq!(big.ptr(), DeviceAddr(base() + 2 * CAP));
    assert_eq!(alloc.stats().blocks.allocated_bytes.persistent.current, 4 * MIB);
    alloc.check_invariants().unwrap();
    drop((w, t, big));
    drop(alloc);
    assert_no_leak(&dev);
}

#[test]
fn release_threshold_keeps_that_much_mapped() {
    let (dev, alloc) = setup("release_threshold_mb:4", CAP);
    let s0 = StreamId::DEFAULT;
    let bufs: Vec<_> = (0..3).map(|_| alloc.alloc(4 * MIB, s0).unwrap()).collect();
    assert_eq!(alloc.reserved_bytes(), 6 * P);
    assert_eq!(mapped_chunks(&dev, base()), vec![(0, 2), (2, 2), (4, 2)]);
    drop(bufs);
    // 12 MiB free after the frees: everything above 4 MiB goes, the highest chunks first.
    assert_eq!(mapped_pages(&dev, base()), vec![0, 1]);
    let s = alloc.stats();
    assert_eq!(s.blocks.reserved_bytes.all.current, 2 * P);
    assert_eq!((s.num_device_unmap, s.num_physical_release, s.num_host_syncs), (2, 2, 0));
    alloc.check_invariants().unwrap();
    // Persistent memory is never trimmed.
    let w = alloc.alloc_in(8 * MIB, s0, Residency::Persistent).unwrap();
    drop(w);
    assert_eq!(alloc.stats().blocks.reserved_bytes.persistent.current, 4 * P);
    drop(alloc);
    assert_no_leak(&dev);
}

/// A fresh allocator (`config`, a device of `capacity`) whose first 4 MiB, at the first
/// range's base on a new stream, a kernel writes until the returned gate opens. Returns the
/// device, the allocator, the stream, the buffer (still allocated) and the gate.
fn written_at_base(config: &str, capacity: u64) -> UnderAKernel {
    let (dev, alloc) = setup(config, capacity);
    let s = dev.create_stream().unwrap();
    let a = alloc.alloc(4 * MIB, s).unwrap();
    assert_eq!(a.ptr(), DeviceAddr(base()));
    let (k, open) = gated_write(a.ptr(), 4 * MIB, 0x5A);
    dev.launch(s, k).unwrap();
    (dev, alloc, s, a, open)
}

type UnderAKernel = (
    Arc<SimDevice>,
    Allocator<SimDevice>,
    StreamId,
    tidepool::Buffer<SimDevice>,
    std::sync::mpsc::Sender<()>,
);

#[test]
fn release_waits_for_the_streams_work_and_counts_the_sync() {
    let (dev, alloc, _, a, open) = written_at_base("", CAP);
    drop(a); // free on its own stream: reusable at once there, but its pages are still in use
    let waiter = common::open_on_next_sync(&dev, open);
    alloc.empty_cache().unwrap(); // must wait for the kernel before unmapping
    waiter.join().unwrap();
    assert_eq!(dev.violations(), vec![], "no unmap under unfinished work");
    let st = alloc.stats();
    assert_eq!((st.num_device_unmap, st.num_host_syncs), (1, 1));
    assert_eq!(dev.kernel_failures(), vec![]);
    drop(alloc);
    assert_no_leak(&dev);
}

/// A free that takes a stream's free mapped bytes past `release_threshold` while a kernel may
/// still use the pages does not wait on the host (`cudaMallocAsync`'s pools trim without
/// blocking): the pages leave the pool at once, stay mapped and counted reserved behind the
/// stream's event, and are unmapped and released by the first trim after the kernel is done.
/// Broken build `trim_waits`: the free waits for the kernel (a counted host sync).
#[test]
fn a_trim_under_unfinished_work_retires_its_pages_without_a_host_wait() {
    let (dev, alloc, s, a, open) = written_at_base("release_threshold_mb:0", CAP);
    // (Under the broken build the free below waits for the kernel: opened at that sync.)
    let opener = common::open_on_next_sync(&dev, open);
    drop(a);
    let st = alloc.stats();
    assert_eq!((st.num_host_syncs, st.num_device_unmap, st.num_physical_release), (0, 0, 0));
    assert_eq!(mapped_pages(&dev, base()), vec![0, 1], "still mapped: the kernel runs there");
    assert_eq!(st.blocks.reserved_bytes.all.current, 2 * P, "held until unmapped");
    assert_eq!(st.blocks.segment.all.current, 0, "no longer in the pool");
    assert_eq!(dev.physical_bytes(), 2 * P);
    alloc.check_invariants().unwrap();
    // The next request cannot have the retiring pages: the range grows above them.
    let b = alloc.alloc(4 * MIB, s).unwrap();
    assert_eq!(b.ptr(), DeviceAddr(base() + 2 * P));
    assert_eq!(mapped_pages(&dev, base()), vec![0, 1, 2, 3]);
    assert_eq!(alloc.stats().blocks.reserved_bytes.all.current, 4 * P);
    alloc.check_invariants().unwrap();
    // The test's own sync lets the kernel finish. Under a threshold every section under the
    // global lock ends with a trim, whose poll releases the retired pages (no wait: their
    // event completed): here `synchronize`'s.
    dev.synchronize().unwrap();
    opener.join().unwrap();
    alloc.synchronize().unwrap();
    let st = alloc.stats();
    assert_eq!(mapped_pages(&dev, base()), vec![2, 3]);
    assert_eq!((st.num_host_syncs, st.num_device_unmap, st.num_physical_release), (0, 1, 1));
    assert_eq!(st.blocks.reserved_bytes.all.current, 2 * P);
    alloc.check_invariants().unwrap();
    drop(b);
    let st = alloc.stats();
    assert_eq!(mapped_pages(&dev, base()), Vec::<u64>::new());
    assert_eq!((st.num_host_syncs, st.num_device_unmap, st.num_physical_release), (0, 2, 2));
    assert_eq!(st.blocks.reserved_bytes.all.current, 0);
    assert_eq!(st.blocks.reserved_bytes.all.peak, 4 * P);
    assert_eq!(dev.violations(), vec![], "no unmap under unfinished work");
    assert_eq!(dev.kernel_failures(), vec![]);
    alloc.check_invariants().unwrap();
    drop(alloc);
    assert_no_leak(&dev);
}

/// `reset_peak_stats` sets each peak to what its lock section leaves: that section's end may
/// release memory (here the pages a trim retired, their kernel done since), and the peaks are
/// reset after it, so `stats()` reads peak = current right after. Broken build
/// `peaks_reset_before_settle`: reset first, the peak stayed at the retired pages' 4 MiB
/// (found by the `allocator_ops` fuzzer).
#[test]
fn reset_peak_stats_resets_to_what_its_lock_section_leaves() {
    let (dev, alloc, _, a, open) = written_at_base("release_threshold_mb:0", CAP);
    drop(a);
    let r = alloc.stats().blocks.reserved_bytes.all;
    assert_eq!((r.current, r.peak), (2 * P, 2 * P), "retired behind the kernel");
    open.send(()).unwrap();
    dev.synchronize().unwrap();
    alloc.reset_peak_stats();
    let st = alloc.stats();
    let r = st.blocks.reserved_bytes.all;
    assert_eq!((r.current, r.peak), (0, 0));
    assert_eq!((st.num_device_unmap, st.num_physical_release, st.num_host_syncs), (1, 1, 0));
    assert_eq!(mapped_pages(&dev, base()), Vec::<u64>::new());
    assert_eq!(dev.violations(), vec![]);
    assert_eq!(dev.kernel_failures(), vec![]);
    alloc.check_invariants().unwrap();
    drop(alloc);
    assert_no_leak(&dev);
}

/// Pages a trim retired (their kernel unfinished) on a device with no room left: the next
/// growth's out-of-memory ladder waits for their event (a counted host sync), releases them
/// and grows; and an allocator dropped with retiring pages waits for them and leaks nothing.
#[test]
fn retired_pages_are_waited_for_by_the_out_of_memory_ladder_and_at_the_end() {
    let (dev, alloc, s, a, open) = written_at_base("release_threshold_mb:0", 2 * P);
    let opener = common::open_on_next_sync(&dev, open);
    drop(a);
    assert_eq!(alloc.stats().num_host_syncs, 0);
    assert_eq!(dev.physical_bytes(), 2 * P, "the device is full of retiring pages");
    let b = alloc.alloc(4 * MIB, s).unwrap();
    opener.join().unwrap();
    let st = alloc.stats();
    assert_eq!((st.num_host_syncs, st.num_device_unmap, st.num_physical_release), (1, 1, 1));
    assert_eq!(b.ptr(), DeviceAddr(base()), "the released pages' place, mapped again");
    assert_eq!(st.blocks.reserved_bytes.all.current, 2 * P);
    assert_eq!(dev.violations(), vec![]);
    alloc.check_invariants().unwrap();
    // Retiring at the end: the allocator's drop waits for them.
    let (k, open) = gated_write(b.ptr(), 4 * MIB, 0x22);
    dev.launch(s, k).unwrap();
    drop(b);
    assert_eq!(alloc.stats().num_host_syncs, 1);
    let opener = common::open_on_next_sync(&dev, open);
    drop(alloc);
    opener.join().unwrap();
    assert_eq!(dev.kernel_failures(), vec![]);
    assert_no_leak(&dev);
}

/// On a device of `capacity` bytes under `config` (expandable segments on), stream 1's first
/// 8 MiB — at the first range's base, four pages in one chunk — written by a kernel held at
/// its gate and freed: cached by stream 1's range while the kernel runs. Returns the device,
/// the allocator, streams 1, 2 and 3 (made in that order) and the kernel's gate.
fn donor_freed_while_running(config: &str, capacity: u64) -> Donor {
    let (dev, alloc) = setup(config, capacity);
    let s = [(); 3].map(|()| dev.create_stream().unwrap());
    let a = alloc.alloc(8 * MIB, s[0]).unwrap();
    assert_eq!(a.ptr(), DeviceAddr(base()));
    let (k, open) = gated_write(a.ptr(), 8 * MIB, 0x11);
    dev.launch(s[0], k).unwrap();
    drop(a);
    (dev, alloc, s, open)
}

type Donor = (Arc<SimDevice>, Allocator<SimDevice>, [StreamId; 3], std::sync::mpsc::Sender<()>);

/// Stream 1 caches 8 MiB of free pages while its kernel may still run on them (until the first
/// host sync, unless `done_first`); stream 2 needs 4 MiB on a device with no room left. Returns
/// the device, the allocator and stream 2's buffer address, and the device's mappings (as
/// [`mapped_chunks`]) once stream 2 has its buffer, before that host sync.
fn page_move(config: &str, done_first: bool) -> PageMove {
    let (dev, alloc, [_, s2, _], open) = donor_freed_while_running(config, 8 * MIB);
    let waiter = if done_first {
        open.send(()).unwrap();
        dev.synchronize().unwrap();
        None
    } else {
        Some(common::open_on_next_sync(&dev, open))
    };
    let b = alloc.alloc(4 * MIB, s2).unwrap();
    let ptr = b.ptr();
    let before_sync = mapped_chunks(&dev, base());
    // Stream 2 writes its buffer (in order after whatever the allocator arranged).
    dev.launch(
        s2,
        Kernel::new(
            "w2",
            vec![Access { ptr, bytes: 4 * MIB, kind: AccessKind::Write }],
            move |m| {
                m.write(ptr, &vec![0x22; (4 * MIB) as usize]).unwrap();
            },
        ),
    )
    .unwrap();
    dev.synchronize().unwrap();
    if let Some(w) = waiter {
        w.join().unwrap();
    }
    drop(b);
    alloc.check_invariants().unwrap();
    (dev, alloc, ptr, before_sync)
}

type PageMove = (Arc<SimDevice>, Allocator<SimDevice>, DeviceAddr, Vec<(u64, u64)>);

#[test]
fn strict_moves_pages_of_an_idle_stream_without_a_sync() {
    let (dev, alloc, ptr, _) = page_move("", true);
    assert_eq!(ptr, DeviceAddr(base() + 16 * MIB), "stream 2's range is the next one");
    let s = alloc.stats();
    // Stream 1's one chunk (4 pages) moves whole: stream 2's range maps all four.
    assert_eq!((s.num_pages_moved, s.num_physical_create, s.num_host_syncs), (4, 1, 0));
    assert_eq!(s.num_device_unmap, 1);
    assert_eq!(mapped_chunks(&dev, base()), vec![(8, 4)]);
    assert_eq!(dev.physical_bytes(), 8 * MIB, "no new physical memory");
    assert_eq!(dev.violations(), vec![]);
    drop(alloc);
    assert_no_leak(&dev);
}

#[test]
fn strict_waits_for_a_busy_owner_before_its_pages_go() {
    let (dev, alloc, ptr, _) = page_move("", false);
    assert_eq!(ptr, DeviceAddr(base() + 16 * MIB));
    let s = alloc.stats();
    // Not moved while stream 1 ran: the ladder released stream 1's pages after waiting for it
    // (one host sync) and stream 2 created its own.
    assert_eq!(s.num_pages_moved, 0);
    assert_eq!((s.num_host_syncs, s.num_alloc_retries), (1, 1));
    assert_eq!((s.num_physical_create, s.num_physical_release), (2, 1));
    assert_eq!(dev.violations(), vec![]);
    assert_eq!(dev.kernel_failures(), vec![]);
    drop(alloc);
    assert_no_leak(&dev);
}

/// Under `wait_event` stream 2 takes stream 1's free chunk at once, ordered after stream 1's
/// kernel on the device; the chunk's old mapping in stream 1's range retires behind that
/// kernel, and goes at the first lock section after the kernel is done — here the helper's
/// own (the free of stream 2's buffer or its invariant check), with no growth after it and no
/// host wait. Broken build `retiring_unpolled`: it stayed mapped until the next growth.
#[test]
fn wait_event_moves_pages_at_once_and_unmaps_after_the_owner() {
    let (dev, alloc, ptr, while_running) = page_move("cross_stream:wait_event", false);
    assert_eq!(ptr, DeviceAddr(base() + 16 * MIB));
    assert_eq!(while_running, vec![(0, 4), (8, 4)], "the chunk mapped twice while s1 ran");
    let s = alloc.stats();
    assert_eq!((s.num_pages_moved, s.num_host_syncs, s.num_physical_create), (4, 0, 1));
    assert_eq!((s.num_device_map, s.num_device_unmap), (2, 1));
    assert_eq!(dev.violations(), vec![], "stream 2 waited for stream 1 on the device");
    assert_eq!(dev.kernel_failures(), vec![]);
    let retiring = |a: &Allocator<SimDevice>| {
        a.expandable_ranges().iter().map(|r| r.retiring_pages).sum::<usize>()
    };
    assert_eq!(retiring(&alloc), 0);
    assert_eq!(mapped_chunks(&dev, base()), vec![(8, 4)]);
    assert_eq!(dev.physical_bytes(), 8 * MIB);
    assert_eq!(alloc.stats().num_device_unmap, 1, "(a view releases nothing more)");
    alloc.check_invariants().unwrap();
    drop(alloc);
    assert_no_leak(&dev);
}

/// Stream 1 frees 8 MiB while its kernel still writes them; stream 2 asks for 4 MiB on a
/// device with no room left and, under `wait_event`, takes stream 1's chunk at once: mapped in
/// its range while the old mapping retires behind the kernel (the chunk *in transit*). Returns
/// the device, the allocator, streams 1 and 2, stream 2's buffer and the kernel's gate.
fn moved_while_the_donor_runs(config: &str) -> InTransit {
    let (dev, alloc, [s1, s2, _], open) = donor_freed_while_running(config, 8 * MIB);
    let b = alloc.alloc(4 * MIB, s2).unwrap();
    assert_eq!(b.ptr(), DeviceAddr(base() + 16 * MIB));
    assert_eq!(mapped_chunks(&dev, base()), vec![(0, 4), (8, 4)], "mapped twice: in transit");
    (dev, alloc, [s1, s2], b, open)
}

type InTransit = (
    Arc<SimDevice>,
    Allocator<SimDevice>,
    [StreamId; 2],
    tidepool::Buffer<SimDevice>,
    std::sync::mpsc::Sender<()>,
);

/// The old mapping of a moved chunk, once its donor's kernel is done, meets a device that
/// fails: an event query that errs counts as unfinished (no wait, nothing unmapped) and a
/// refused unmap keeps the mapping; each is tried again at the next lock section's end, and the
/// mapping goes then. Nothing is lost or counted twice, and the allocator works on.
#[test]
fn a_retired_mapping_the_device_refuses_to_unmap_goes_at_a_later_lock_section() {
    let (dev, alloc, [s1, _], b, open) = moved_while_the_donor_runs("cross_stream:wait_event");
    open.send(()).unwrap();
    dev.synchronize().unwrap();
    let unmaps = |a: &Allocator<SimDevice>| a.stats().num_device_unmap;
    dev.fail_event_queries(true);
    alloc.synchronize().unwrap();
    assert_eq!(mapped_chunks(&dev, base()), vec![(0, 4), (8, 4)], "the query failed");
    assert_eq!((unmaps(&alloc), alloc.stats().num_host_syncs), (0, 0));
    dev.fail_event_queries(false);
    dev.fail_nth_vm_unmap(Some(1));
    alloc.synchronize().unwrap();
    assert_eq!(mapped_chunks(&dev, base()), vec![(0, 4), (8, 4)], "the unmap was refused");
    assert_eq!(unmaps(&alloc), 0);
    alloc.check_invariants().unwrap();
    alloc.synchronize().unwrap();
    assert_eq!(mapped_chunks(&dev, base()), vec![(8, 4)]);
    assert_eq!((unmaps(&alloc), alloc.stats().num_host_syncs), (1, 0));
    assert_eq!(dev.physical_bytes(), 8 * MIB);
    // It works on: s1 grows again in its own range, where the device has no room left for new
    // memory: the chunk comes back from s2 (free once b is).
    drop(b);
    let c = alloc.alloc(4 * MIB, s1).unwrap();
    assert_eq!(c.ptr(), DeviceAddr(base()));
    assert_eq!(mapped_chunks(&dev, base()), vec![(0, 4)], "the chunk moved back");
    assert_eq!(dev.violations(), vec![]);
    assert_eq!(dev.kernel_failures(), vec![]);
    alloc.check_invariants().unwrap();
    drop(c);
    drop(alloc);
    assert_no_leak(&dev);
}

/// A statistics read changes nothing: the old mapping of a moved chunk, its donor's kernel
/// done, goes at the next lock section's end (here `synchronize`'s), not at a read's. Under
/// `global_lock` a read takes the lock, and it used to be a lock section of its own, whose end
/// unmapped it: when pages went then hung on how often the statistics were read (a private
/// pool's old mapping went at the differential harness's read after each step, where the
/// lock-free read left it for the pool's next section). Broken build `locked_read_settles`.
#[test]
fn a_statistics_read_releases_no_retired_mapping() {
    for config in ["cross_stream:wait_event", "cross_stream:wait_event,global_lock:true"] {
        let (dev, alloc, _, b, open) = moved_while_the_donor_runs(config);
        open.send(()).unwrap();
        dev.synchronize().unwrap();
        for _ in 0..2 {
            let s = alloc.stats();
            assert_eq!((s.num_device_map, s.num_device_unmap), (2, 0), "{config}");
        }
        assert_eq!(mapped_chunks(&dev, base()), vec![(0, 4), (8, 4)], "{config}: still mapped");
        alloc.synchronize().unwrap();
        assert_eq!(alloc.stats().num_device_unmap, 1, "{config}");
        assert_eq!(mapped_chunks(&dev, base()), vec![(8, 4)], "{config}: unmapped");
        assert_eq!(dev.violations(), vec![]);
        drop(b);
        alloc.check_invariants().unwrap();
        drop(alloc);
        assert_no_leak(&dev);
    }
}

/// A chunk a `wait_event` page move took is *in transit* while its old mapping retires (the
/// donor's kernel runs): the device frees its memory only at that last unmapping. A trim of
/// the new range meanwhile (here a `release_threshold` set after the move) passes it over: it
/// stays a run of its range, mapped and counted; once the donor is done and the old mapping
/// gone, the next trim releases it. Broken build `transit_released`: the trim takes it (here
/// it retires behind stream 2's event, which waits for the donor; where the new stream's work
/// is done it is released at once, and the device holds memory no allocator counts — the
/// `allocator_ops` input `crash-chunk-in-transit-released`, with a stitched block and failing
/// event queries, shows that).
#[test]
fn a_chunk_in_transit_is_not_released_before_its_old_mapping_goes() {
    let (dev, alloc, [_, s2], b, open) = moved_while_the_donor_runs("cross_stream:wait_event");
    drop(b);
    let conf = "expandable_segments:true,cross_stream:wait_event,release_threshold_mb:0";
    alloc.set_config(Config::parse(conf).unwrap()).unwrap();
    // s2 frees again (a trim of its range is due): the chunk stays, counted.
    drop(alloc.alloc(2 * MIB, s2).unwrap());
    let reserved = |a: &Allocator<SimDevice>| a.stats().blocks.reserved_bytes.all.current;
    assert_eq!(mapped_chunks(&dev, base()), vec![(0, 4), (8, 4)]);
    let s2_range = |a: &Allocator<SimDevice>| {
        let r = a.expandable_ranges().into_iter().find(|r| r.stream == s2).unwrap();
        (r.runs, r.retiring_pages)
    };
    assert_eq!(s2_range(&alloc), (vec![(DeviceAddr(base() + 16 * MIB), 8 * MIB)], 0));
    assert_eq!((reserved(&alloc), dev.physical_bytes()), (8 * MIB, 8 * MIB));
    let st = alloc.stats();
    assert_eq!((st.num_device_unmap, st.num_physical_release, st.num_host_syncs), (0, 0, 0));
    alloc.check_invariants().unwrap();
    // s1's kernel done: the old mapping goes at the next lock section, and s2's next free
    // trims the chunk away.
    open.send(()).unwrap();
    dev.synchronize().unwrap();
    drop(alloc.alloc(2 * MIB, s2).unwrap());
    assert_eq!(mapped_chunks(&dev, base()), Vec::<(u64, u64)>::new());
    assert_eq!((reserved(&alloc), dev.physical_bytes()), (0, 0));
    let st = alloc.stats();
    assert_eq!((st.num_device_unmap, st.num_physical_release, st.num_host_syncs), (2, 1, 0));
    assert_eq!(dev.violations(), vec![]);
    assert_eq!(dev.kernel_failures(), vec![]);
    alloc.check_invariants().unwrap();
    drop(alloc);
    assert_no_leak(&dev);
}

/// [`donor_freed_while_running`] on a 16 MiB device under `wait_event`, then stream 2 takes
/// stream 1's chunk for 4 MiB (in transit: mapped in both ranges) and frees them after
/// `release_threshold_mb:0` is set: a trim passes the chunk over. Returns the device, the
/// allocator, stream 2 and the gate of stream 1's kernel.
fn passed_over_in_transit() -> PassedOver {
    let (dev, alloc, [_, s2, _], open) =
        donor_freed_while_running("cross_stream:wait_event", 16 * MIB);
    let b = alloc.alloc(4 * MIB, s2).unwrap();
    assert_eq!(b.ptr(), DeviceAddr(base() + 32 * MIB));
    let conf = "cross_stream:wait_event,release_threshold_mb:0";
    alloc.set_config(Config::parse(conf).unwrap().with_expandable_segments(true)).unwrap();
    drop(b);
    assert_eq!(mapped_chunks(&dev, base()), vec![(0, 4), (16, 4)]);
    (dev, alloc, s2, open)
}

type PassedOver = (Arc<SimDevice>, Allocator<SimDevice>, StreamId, std::sync::mpsc::Sender<()>);

/// A trim that passes a chunk in transit over remembers nothing: once the old mapping is gone,
/// the stream's next change — here a persistent allocation, which leaves its transient free
/// bytes as they were — checks again, and the chunk goes. Broken build `transit_memo_kept`: the
/// trim remembered the stream's free bytes, and the chunk stayed mapped past
/// `release_threshold_mb:0` until the stream freed a page more.
#[test]
fn a_chunk_passed_over_in_transit_goes_at_its_streams_next_change() {
    let (dev, alloc, s2, open) = passed_over_in_transit();
    open.send(()).unwrap();
    dev.synchronize().unwrap();
    alloc.check_invariants().unwrap(); // a lock section: the old mapping goes
    assert_eq!(mapped_chunks(&dev, base()), vec![(16, 4)]);
    let w = alloc.alloc_in(2 * MIB, s2, Residency::Persistent).unwrap();
    assert_eq!(w.ptr(), DeviceAddr(base() + 64 * MIB));
    assert_eq!(mapped_chunks(&dev, base()), vec![(32, 1)], "the chunk went");
    assert_eq!(alloc.stats().blocks.reserved_bytes.all.current, 2 * MIB);
    let st = alloc.stats();
    assert_eq!((st.num_device_unmap, st.num_physical_release, st.num_host_syncs), (2, 1, 0));
    assert_eq!(dev.violations(), vec![]);
    drop(w);
    alloc.check_invariants().unwrap();
    alloc.release_persistent().unwrap();
    drop(alloc);
    assert_no_leak(&dev);
}

#[test]
fn the_sanitizer_catches_a_page_move_without_order() {
    let (dev, alloc) = setup("cross_stream:wait_event", 8 * MIB);
    alloc.set_broken_skip_events(true);
    let (s1, s2) = (dev.create_stream().unwrap(), dev.create_stream().unwrap());
    let a = alloc.alloc(8 * MIB, s1).unwrap();
    let (k, open) = gated_write(a.ptr(), 8 * MIB, 0x11);
    dev.launch(s1, k).unwrap();
    drop(a);
    let b = alloc.alloc(4 * MIB, s2).unwrap();
    let v = dev.violations();
    assert!(!v.is_empty(), "the broken allocator unmapped or aliased memory stream 1 still uses");
    open.send(()).unwrap();
    dev.synchronize().unwrap();
    drop(b);
}

#[test]
fn a_device_without_virtual_memory_falls_back_with_a_note() {
    let dev = Arc::new(SimDevice::new(CAP));
    dev.set_virtual_memory(false);
    let alloc =
        Allocator::new(dev.clone(), Config::default().with_expandable_segments(true)).unwrap();
    let a = alloc.alloc(3 * MIB, StreamId::DEFAULT).unwrap();
    assert_eq!(a.ptr(), DeviceAddr(SIM_BASE));
    let s = alloc.stats();
    assert!(!s.expandable_segments);
    assert_eq!((s.num_device_alloc, s.num_device_map), (1, 0));
    assert_eq!(dev.live_segments(), vec![(DeviceAddr(SIM_BASE), 20 * MIB)]);
    let summary = alloc.memory_summary();
    assert!(summary.contains("has no virtual memory management: ordinary segments"), "{summary}");
    drop(a);
    drop(alloc);
    assert!(dev.live_segments().is_empty());
}

#[test]
fn kernels_and_handouts_on_unmapped_pages_are_violations() {
    let dev = SimDevice::backed(CAP);
    let s = StreamId::DEFAULT;
    let base = dev.vm_reserve(8 * MIB).unwrap();
    let h = dev.vm_create(P).unwrap();
    dev.vm_map(base, P, h).unwrap();
    dev.note_handout(base, P, s);
    assert_eq!(dev.violations(), vec![]);
    dev.note_handout(base.offset(P), 16, s);
    let v = dev.violations();
    assert_eq!((v[0].ptr, v[0].op.as_str()), (base.offset(P), "handout of unmapped memory"));
    let k = Kernel::new(
        "spill",
        vec![Access { ptr: base.offset(P - 8), bytes: 16, kind: AccessKind::Write }],
        |_| {},
    );
    dev.launch(s, k).unwrap();
    let v = dev.violations();
    assert_eq!(v[1].op, "kernel spill touches unallocated memory");
    dev.synchronize().unwrap();
    dev.note_reclaim(base, P, s);
    dev.note_reclaim(base.offset(P), 16, s);
    dev.vm_unmap(base, P).unwrap();
    dev.vm_release(h).unwrap();
    dev.vm_free(base, 8 * MIB).unwrap();
    assert_eq!(dev.physical_bytes(), 0);
}

#[test]
fn unmapping_under_unfinished_work_is_a_violation() {
    let dev = SimDevice::backed(CAP);
    let s = dev.create_stream().unwrap();
    let base = dev.vm_reserve(4 * MIB).unwrap();
    let h = dev.vm_create(P).unwrap();
    dev.vm_map(base, P, h).unwrap();
    let (k, open) = gated_write(base, 64, 1);
    dev.note_handout(base, 64, s);
    dev.launch(s, k).unwrap();
    dev.note_reclaim(base, 64, s);
    dev.vm_unmap(base, P).unwrap();
    let v = dev.violations();
    assert_eq!(v.len(), 1);
    assert_eq!(
        (v[0].ptr, v[0].stream, v[0].op.as_str()),
        (base, s, "unmap of memory that unfinished work uses")
    );
    // (The kernel then faults on the unmapped page: the device reports it as a kernel failure.)
    open.send(()).unwrap();
    dev.synchronize().unwrap();
    assert_eq!(dev.kernel_failures().len(), 1);
    dev.vm_release(h).unwrap();
}

#[test]
fn device_counts_and_refuses_what_cuda_refuses() {
    let dev = SimDevice::new(8 * MIB);
    assert!(dev.supports_virtual_memory());
    assert_eq!(dev.vm_granularity(), Ok(P));
    let base = dev.vm_reserve(6 * MIB).unwrap();
    assert_eq!(base, DeviceAddr(SIM_BASE));
    assert!(dev.vm_reserve(3 * MIB).is_err(), "not a multiple of the granularity");
    let hs: Vec<_> = (0..4).map(|_| dev.vm_create(P).unwrap()).collect();
    let refused = dev.vm_create(P).unwrap_err();
    assert_eq!(refused, tidepool::DeviceError::Driver { op: "cuMemCreate", code: 2 });
    assert_eq!(dev.mem_info().unwrap().free, 0);
    assert!(dev.reserve(512).is_err(), "physical memory counts against segments too");
    dev.vm_map(base, P, hs[0]).unwrap();
    assert!(dev.vm_map(base, P, hs[1]).is_err(), "overlapping mapping");
    assert!(dev.vm_map(base.offset(6 * MIB), P, hs[1]).is_err(), "outside the range");
    dev.vm_map(base.offset(4 * MIB), P, hs[0]).unwrap(); // a second mapping of one allocation
    assert!(dev.vm_free(base, 6 * MIB).is_err(), "still mapped");
    assert!(dev.vm_unmap(base, 4 * MIB).is_err(), "not one mapping");
    dev.vm_release(hs[0]).unwrap();
    assert_eq!(dev.physical_bytes(), 8 * MIB, "released, but still mapped");
    dev.vm_unmap(base, P).unwrap();
    dev.vm_unmap(base.offset(4 * MIB), P).unwrap();
    assert_eq!(dev.physical_bytes(), 6 * MIB);
    for &h in &hs[1..] {
        dev.vm_release(h).unwrap();
    }
    dev.vm_free(base, 6 * MIB).unwrap();
    let v = dev.vm_counters();
    assert_eq!(
        (v.reserves, v.frees, v.creates, v.failed_creates, v.releases, v.maps, v.unmaps),
        (1, 1, 4, 1, 4, 2, 2)
    );
    assert_eq!((dev.physical_bytes(), dev.virtual_bytes()), (0, 0));
}

#[test]
fn no_virtual_room_falls_back_to_segments_with_a_note() {
    let dev = Arc::new(SimDevice::new(CAP));
    dev.set_virtual_capacity(CAP); // less than one range (twice the device)
    let alloc =
        Allocator::new(dev.clone(), Config::default().with_expandable_segments(true)).unwrap();
    let a = alloc.alloc(3 * MIB, StreamId::DEFAULT).unwrap();
    assert_eq!(dev.live_segments(), vec![(a.ptr(), 20 * MIB)]);
    assert_eq!(alloc.stats().num_device_map, 0);
    let summary = alloc.memory_summary();
    assert!(summary.contains("of virtual addresses for stream 0 failed"), "{summary}");
    drop(a);
    drop(alloc);
    assert!(dev.live_segments().is_empty());
}

#[test]
fn the_memory_history_records_maps_and_unmaps() {
    use tidepool::{Action, HistoryOptions};
    let (dev, alloc) = setup("", CAP);
    alloc.record_history(HistoryOptions::new(100));
    let a = alloc.alloc(3 * MIB, StreamId::DEFAULT).unwrap();
    drop(a);
    alloc.empty_cache().unwrap();
    let got: Vec<(Action, u64, u64)> =
        alloc.history().iter().map(|e| (e.action, e.addr.0 - base(), e.size)).collect();
    assert_eq!(
        got,
        vec![
            (Action::SegmentMap, 0, 2 * P),
            (Action::Alloc, 0, 3 * MIB),
            (Action::FreeRequested, 0, 3 * MIB),
            (Action::FreeCompleted, 0, 3 * MIB),
            (Action::SegmentUnmap, 0, 2 * P),
        ]
    );
    let pickle = alloc.snapshot_pickle();
    assert!(!pickle.is_empty());
    drop(alloc);
    assert_no_leak(&dev);
}

#[test]
fn a_learning_run_gives_freed_pages_back_and_the_runs_after_it_map_nothing() {
    let (dev, alloc) = setup("", CAP);
    let s0 = StreamId::DEFAULT;
    let run = |alloc: &Allocator<SimDevice>, learning: bool| {
        let scope = alloc.named_scope("step", s0);
        let grad = scope.alloc_unbound(2 * P).unwrap(); // escapes (a gradient)
        let act = scope.alloc_unbound(4 * P).unwrap();
        assert_eq!(alloc.stats().blocks.reserved_bytes.all.current, 6 * P);
        drop(act);
        // Learning: act's four pages are unmapped as it is freed; planned: the region keeps them.
        let want = if learning { 2 * P } else { 6 * P };
        assert_eq!(alloc.stats().blocks.reserved_bytes.all.current, want);
        let tmp = scope.alloc_unbound(3 * P).unwrap();
        drop(tmp);
        grad
    };
    let g1 = run(&alloc, true);
    let s = alloc.stats();
    // Run 1 mapped grad, act and tmp (one physical chunk each) and unmapped act's and tmp's;
    // at its exit the region (grad's run as a bin, one fresh block of 4 pages for act and tmp)
    // mapped one more.
    assert_eq!((s.num_device_map, s.num_device_unmap), (4, 2));
    assert_eq!(s.plan_region_bytes, 6 * P);
    drop(g1); // zero_grad
    for _ in 0..3 {
        let before = alloc.stats();
        let g = run(&alloc, false);
        let after = alloc.stats();
        assert!(g.is_planned());
        assert_eq!(after.num_device_map - before.num_device_map, 0);
        assert_eq!(after.num_device_unmap - before.num_device_unmap, 0);
        assert_eq!(after.best_fit_searches, before.best_fit_searches);
        assert_eq!(after.blocks.reserved_bytes.all.current, 6 * P);
        drop(g);
    }
    assert_eq!(alloc.stats().plan_hits, 3 * 3);
    alloc.check_invariants().unwrap();
    drop(alloc);
    assert_no_leak(&dev);
}

/// Where a 4 MiB transient request goes once `expandable_segments` is turned off, with a
/// persistent range's 8 MiB free (mapped) beside it: its address, and the device's ordinary
/// segments after it.
fn transient_after_ranges_turned_off(broken: bool) -> (DeviceAddr, Vec<(DeviceAddr, u64)>) {
    let (dev, alloc) = setup("", CAP);
    alloc.set_broken(tidepool::hooks::Broken::SharedRanges, broken);
    let s0 = StreamId::DEFAULT;
    let w = alloc.alloc_in(8 * MIB, s0, Residency::Persistent).unwrap();
    assert_eq!(w.ptr(), DeviceAddr(base()));
    drop(w); // four free mapped pages of a persistent range
    alloc.set_config(Config::default()).unwrap();
    let t = alloc.alloc(4 * MIB, s0).unwrap();
    let at = (t.ptr(), dev.live_segments());
    alloc.check_invariants().unwrap();
    assert_eq!(mapped_pages(&dev, base()), vec![0, 1, 2, 3]); // the range is left as it was
    drop(t);
    alloc.release_persistent().unwrap();
    alloc.empty_cache().unwrap();
    drop(alloc);
    assert_no_leak(&dev);
    at
}

#[test]
fn a_range_keeps_its_residency_after_expandable_segments_are_turned_off() {
    let (t, segments) = transient_after_ranges_turned_off(false);
    assert_eq!(segments, vec![(t, 20 * MIB)]); // an ordinary transient segment of its own
    assert!(t.0 >= base() + 2 * CAP, "{t} lies in the persistent range");
}

#[test]
fn a_transient_block_in_a_persistent_range_is_caught() {
    let (t, segments) = transient_after_ranges_turned_off(true);
    assert_eq!(t, DeviceAddr(base())); // the persistent range's free pages
    assert_eq!(segments, vec![]);
}

/// Event records fail (injected) while a growth on one stream needs the pages another stream
/// caches: no page can be moved (nothing orders the move), so the growth goes on to the
/// out-of-memory ladder, which releases the other stream's free pages after a host wait (no
/// event marks its work) and retries: the allocation succeeds, and the allocator works on once
/// records succeed again. (Broken mode `VmEventErrors`: the failed record fails the allocation.)
fn growth_while_event_records_fail(broken: bool) -> Result<(), String> {
    let (dev, alloc) = setup("", 8 * MIB);
    alloc.set_broken(tidepool::hooks::Broken::VmEventErrors, broken);
    let (s1, s2) = (dev.create_stream().unwrap(), dev.create_stream().unwrap());
    let a = alloc.alloc(8 * MIB, s1).unwrap();
    assert_eq!(a.ptr(), DeviceAddr(base()));
    drop(a); // four pages cached by s1's range: the device is full
    dev.fail_event_records(true);
    let syncs = alloc.stats().num_host_syncs;
    let b = alloc
        .alloc(4 * MIB, s2)
        .map_err(|e| format!("alloc while records fail: {}", tidepool::ErrorChain(&e)))?;
    assert_eq!(alloc.stats().num_host_syncs, syncs + 1, "one host wait for s1's work");
    assert_eq!(alloc.stats().blocks.reserved_bytes.all.current, 4 * MIB);
    dev.fail_event_records(false);
    alloc.check_invariants()?;
    drop(b);
    let c = alloc
        .alloc(8 * MIB, s1)
        .map_err(|e| format!("alloc after: {}", tidepool::ErrorChain(&e)))?;
    drop(c);
    alloc.empty_cache().map_err(|e| tidepool::ErrorChain(&e).to_string())?;
    alloc.check_invariants()?;
    assert_eq!(dev.violations(), vec![]);
    Ok(())
}

#[test]
fn a_growth_works_on_while_event_records_fail() {
    growth_while_event_records_fail(false).unwrap();
    let e = growth_while_event_records_fail(true).unwrap_err();
    // The allocator's layer, then the device's (its source).
    assert!(
        e.starts_with("alloc while records fail: a device call of the allocator failed: "),
        "{e}"
    );
    assert!(e.contains("record_event failed"), "{e}");
}

/// A named scope's run keeps what it frees for its next request of the size (its local cache).
/// A transient block it got from a persistent ordinary segment's free space while segments
/// were in force (the residencies then share free space) is not handed out again once
/// `expandable_segments` is on, where a transient request never takes persistent memory: the
/// run asks the pool, which grows a transient range. Returns the two blocks' addresses, the
/// persistent segment's, and the device's segments while the second block lives. (Broken mode
/// `LocalReuseAcrossRanges`: the run hands the persistent segment's block out again.)
fn scope_reuse_after_ranges_turned_on(broken: bool) -> (u64, u64, u64, Vec<(DeviceAddr, u64)>) {
    let dev = Arc::new(SimDevice::backed(CAP));
    let alloc = Allocator::new(dev.clone(), Config::default()).unwrap();
    alloc.set_broken(tidepool::hooks::Broken::LocalReuseAcrossRanges, broken);
    let s0 = StreamId::DEFAULT;
    // A 20 MiB persistent segment (a large request under 10 MiB), its first 3 MiB live.
    let w = alloc.alloc_in(3 * MIB, s0, Residency::Persistent).unwrap();
    let scope = alloc.named_scope("step", s0);
    let a = scope.alloc(2 * MIB).unwrap(); // the persistent segment's free tail
    let first = a.ptr().0;
    drop(a); // into the run's local cache
    alloc.set_config(Config::default().with_expandable_segments(true)).unwrap();
    let b = scope.alloc(2 * MIB).unwrap();
    let second = (b.ptr().0, dev.live_segments());
    alloc.check_invariants().unwrap();
    drop(b);
    drop(scope);
    let persistent = w.ptr().0;
    drop(w);
    alloc.check_invariants().unwrap();
    alloc.release_persistent().unwrap();
    alloc.empty_cache().unwrap();
    drop(alloc);
    assert_no_leak(&dev);
    (first, second.0, persistent, second.1)
}

#[test]
fn a_scope_reuses_no_persistent_block_once_ranges_serve_requests() {
    let (first, second, persistent, segments) = scope_reuse_after_ranges_turned_on(false);
    assert_eq!((persistent, first), (base(), base() + 3 * MIB));
    // The first page of a transient range reserved right above the persistent segment, the
    // device's only segment.
    assert_eq!(segments, vec![(DeviceAddr(base()), 20 * MIB)]);
    assert_eq!(second, base() + 20 * MIB);
}

#[test]
fn a_scope_reusing_a_persistent_block_over_ranges_is_caught() {
    let (first, second, persistent, _) = scope_reuse_after_ranges_turned_on(true);
    assert_eq!(first, persistent + 3 * MIB);
    assert_eq!(second, first); // the persistent segment's block again
}

/// A stream destroyed elsewhere (here by the application, on another thread) is forgotten by
/// the device before its work is done: CUDA's `cuStreamDestroy` returns at once, and SimDevice
/// refuses the stream while it drains. An unknown stream is then no proof that its work is done:
/// `empty_cache` waits for the whole device (one host sync) before it unmaps the stream's pages.
/// (Found by `multi_props` with 20 MiB requests: a scope's learning run ended on a stream that
/// the other allocator was destroying.) Broken mode `GoneStreamDrained`: the pages are unmapped
/// under the running kernel, which then faults.
#[test]
fn a_stream_destroyed_elsewhere_is_waited_for_before_its_pages_go() {
    for broken in [false, true] {
        let (dev, alloc) = setup("", CAP);
        alloc.set_broken(tidepool::hooks::Broken::GoneStreamDrained, broken);
        let s = dev.create_stream().unwrap();
        let b = alloc.alloc(P, s).unwrap();
        assert_eq!(b.ptr(), DeviceAddr(base()));
        let (k, open) = gated_write(b.ptr(), P, 7);
        dev.launch(s, k).unwrap();
        drop(b);
        assert_eq!(mapped_pages(&dev, base()), vec![0]);
        let destroyer = {
            let dev = dev.clone();
            std::thread::spawn(move || dev.destroy_stream(s))
        };
        while dev.has_stream(s) {
            std::thread::yield_now();
        }
        let syncs = alloc.stats().num_host_syncs;
        let opener = common::open_on_next_sync(&dev, open);
        alloc.empty_cache().unwrap();
        assert_eq!(mapped_pages(&dev, base()), Vec::<u64>::new(), "broken: {broken}");
        let v = dev.violations();
        if broken {
            assert_eq!(v.len(), 1, "{v:?}");
            assert_eq!(
                (v[0].ptr, v[0].stream, v[0].op.as_str()),
                (DeviceAddr(base()), s, "unmap of memory that unfinished work uses")
            );
            assert_eq!(alloc.stats().num_host_syncs, syncs);
            dev.synchronize().unwrap(); // opens the gate: the kernel faults on the lost page
            assert_eq!(dev.kernel_failures().len(), 1);
        } else {
            assert_eq!(v, vec![]);
            assert_eq!(alloc.stats().num_host_syncs, syncs + 1);
            assert_eq!(dev.kernel_failures(), vec![]);
        }
        opener.join().unwrap();
        destroyer.join().unwrap().unwrap();
        assert_eq!(alloc.release_stream(s), Err(AllocError::UnknownStream(s)));
        drop(alloc);
        if !broken {
            assert_no_leak(&dev);
        }
    }
}

/// Two 1 MiB blocks freed into their stream's cache during a named scope's learning run: its
/// stream's threshold is 0, but the run's small frees still wait in the lanes (design notes,
/// "Small blocks in the stream caches under a release threshold"), so its page of the small
/// range stays mapped (nothing unmapped) until a flush frees them into the pool. `check` runs
/// while the run is open. (This was a 20 MiB block freed after `set_config` turned expandable
/// segments off with the threshold kept, which the lanes no longer take: design notes,
/// "Ranges left by switching expandable segments off".)
fn with_blocks_cached_in_a_learning_run(check: impl FnOnce(&SimDevice, &Allocator<SimDevice>)) {
    let (dev, alloc) = setup("", CAP);
    let s = dev.create_stream().unwrap();
    let run = alloc.named_scope("step", s);
    // Two blocks fill the page (a block alone would leave the trim a memo of its free half,
    // which a learning run keeps: design notes, "A page whose last block went").
    let (a, b) = (alloc.alloc(MIB, s).unwrap(), alloc.alloc(MIB, s).unwrap());
    assert_eq!((a.ptr().0, b.ptr().0), (base(), base() + MIB));
    drop((a, b));
    assert_eq!(mapped_pages(&dev, base()), vec![0]);
    let st = alloc.stats();
    assert_eq!((st.num_device_unmap, st.cached_fast_bytes), (0, 2 * MIB));
    check(&dev, &alloc);
    drop(run);
    drop(alloc);
    assert_no_leak(&dev);
}

/// A view reads the state its own lock section leaves: a block the stream cache held, flushed
/// into the pool for the view, is trimmed as the lock is let go, so the view must not show the
/// pages that trim unmaps. (Broken mode `view_unsettled`: the snapshot lists the flushed run
/// of mapped pages the device no longer has.)
#[test]
fn a_view_does_not_show_pages_its_flush_lets_go_of() {
    with_blocks_cached_in_a_learning_run(|dev, alloc| {
        let snap = alloc.snapshot();
        assert_eq!(dev.live_mappings(), vec![], "the flush's free was trimmed at once");
        assert_eq!(snap, vec![], "the snapshot shows a run the device no longer maps");
        assert_eq!(alloc.reserved_bytes(), 0);
        assert_eq!(alloc.expandable_ranges()[0].mapped_bytes, 0);
    });
}

/// The summary is a read: it flushes no stream cache, so the freed block shows as fast-cached
/// and its pages as mapped, and nothing is unmapped; a snapshot then flushes and settles.
/// (Flushing for the summary's ranges, settled, emptied its fast-cached row:
/// `fast_path::memory_summary_has_a_fast_cache_row_and_a_hits_row`.)
#[test]
fn the_summary_reads_without_flushing() {
    with_blocks_cached_in_a_learning_run(|dev, alloc| {
        let summary = alloc.memory_summary();
        let cached = summary.lines().find(|l| l.starts_with("| Fast-cached memory")).unwrap();
        assert!(cached.contains("2.00 MiB"), "{cached}");
        assert!(summary.contains(" 0 unmaps,"), "{summary}");
        let range = summary.lines().find(|l| l.contains("Range ")).expect("a range line");
        assert!(range.contains("2.00 MiB"), "{range}");
        assert_eq!(mapped_pages(dev, base()), vec![0]);
        assert_eq!(alloc.snapshot(), vec![]);
        assert_eq!(dev.live_mappings(), vec![]);
    });
}

/// PyTorch's `expandable_segments_reserve`: each range reserves that share of the device (or
/// that many GiB) instead of twice the device. A request its stream's range has no room for is
/// served by an ordinary segment (PyTorch fails it); one that fits grows the range as ever.
#[test]
fn expandable_segments_reserve_sizes_the_ranges() {
    let (dev, alloc) = setup("expandable_segments_reserve:0.25", CAP);
    let a = alloc.alloc(8 * MIB, StreamId::DEFAULT).unwrap(); // in the range
    let ranges = alloc.expandable_ranges();
    assert_eq!(ranges.len(), 1);
    assert_eq!((ranges[0].base.0, ranges[0].virtual_size), (base(), CAP / 4));
    assert_eq!(a.ptr().0, base());
    let b = alloc.alloc(12 * MIB, StreamId::DEFAULT).unwrap(); // 8 + 12 > 16: no room
    assert!(!(base()..base() + CAP / 4).contains(&b.ptr().0), "an ordinary segment");
    let seg = alloc.snapshot().into_iter().find(|s| s.address == b.ptr()).unwrap();
    assert_eq!(seg.size, 12 * MIB);
    assert_eq!(alloc.stats().virtual_reserved_bytes, CAP / 4);
    drop((a, b));
    alloc.empty_cache().unwrap();
    assert_eq!(alloc.stats().blocks.reserved_bytes.all.current, 0);
    alloc.check_invariants().unwrap();
    assert!(dev.violations().is_empty());
    // In GiB: 1 GiB per range on this 64 MiB device.
    let (_dev, alloc) = setup("expandable_segments_reserve:1G", CAP);
    drop(alloc.alloc(8 * MIB, StreamId::DEFAULT).unwrap());
    assert_eq!(alloc.expandable_ranges()[0].virtual_size, 1 << 30);
}

/// A range the device cannot reserve (no room in its virtual address space) is asked for once:
/// the requests (12 MiB: a new segment each) go to ordinary segments without a reservation
/// attempt each (found in review:
/// one device call at every large-pool slow-path allocation; the broken build
/// `refused_ranges_retried` does so still), and asked for again after `set_config` or
/// `empty_cache`.
#[test]
fn a_range_the_device_refuses_is_not_asked_for_at_every_allocation() {
    let (dev, alloc) = setup("expandable_segments_reserve:1000000", CAP);
    let refused = |d: &SimDevice| d.vm_counters().failed_reserves;
    let live: Vec<_> = (0..3).map(|_| alloc.alloc(12 * MIB, StreamId::DEFAULT).unwrap()).collect();
    assert_eq!((refused(&dev), dev.vm_counters().reserves), (1, 0));
    assert!(alloc.expandable_ranges().is_empty());
    assert!(alloc.memory_summary().contains("failed"), "{}", alloc.memory_summary());
    alloc.set_config(alloc.config().as_ref().clone()).unwrap();
    drop(alloc.alloc(12 * MIB, StreamId::DEFAULT).unwrap());
    assert_eq!(refused(&dev), 2, "asked again under the new configuration");
    alloc.empty_cache().unwrap();
    drop(alloc.alloc(12 * MIB, StreamId::DEFAULT).unwrap());
    assert_eq!(refused(&dev), 3, "asked again after empty_cache");
    drop(live);
    alloc.check_invariants().unwrap();
}

/// `set_config` changes the ranges' `release_threshold` at once, not at the next growth: a
/// block freed after the threshold went from 0 to none stays mapped through a snapshot's flush,
/// and one freed after it went from none to 0 is unmapped (found in review; broken build
/// `stale_release_threshold`).
#[test]
fn set_config_changes_the_release_threshold_at_once() {
    for (before, after, mapped) in
        [("release_threshold_mb:0", "", 14 * MIB), ("", "release_threshold_mb:0", 0)]
    {
        let (dev, alloc) = setup(before, CAP);
        let s = dev.create_stream().unwrap();
        let b = alloc.alloc(14 * MIB, s).unwrap();
        let conf = match after {
            "" => "expandable_segments:true".to_string(),
            a => format!("expandable_segments:true,{a}"),
        };
        alloc.set_config(Config::parse(&conf).unwrap()).unwrap();
        drop(b);
        let _ = alloc.snapshot(); // flushes the stream cache into the range
        let reserved = alloc.stats().blocks.reserved_bytes.all.current;
        assert_eq!((reserved, dev.physical_bytes()), (mapped, mapped), "{before} → {after}");
        drop(alloc);
        assert_no_leak(&dev);
    }
}

/// A learning run (a named scope's first) gives its stream's pages back as they are freed; its
/// end stops that even when a `set_config` turned expandable segments off meanwhile (found in
/// review: the count stayed raised, so once they were on again every free on the stream
/// unmapped its pages). Broken build `learning_count_kept`.
#[test]
fn a_learning_run_ended_after_set_config_leaves_no_trimming_behind() {
    let (dev, alloc) = setup("", CAP);
    let s = dev.create_stream().unwrap();
    let run = alloc.named_scope("step", s);
    drop(run.alloc(4 * MIB).unwrap());
    alloc.set_config(Config::parse("expandable_segments:false").unwrap()).unwrap();
    drop(run);
    alloc.set_config(Config::parse("expandable_segments:true").unwrap()).unwrap();
    let unmaps = alloc.stats().num_device_unmap;
    for _ in 0..3 {
        drop(alloc.alloc(30 * MIB, s).unwrap()); // in the range (the run left 20 MiB cached)
    }
    alloc.check_invariants().unwrap();
    assert_eq!(alloc.stats().num_device_unmap, unmaps, "frees kept their pages mapped");
    drop(alloc);
    assert_no_leak(&dev);
}

/// A growth taking free chunks from two donor streams (`cross_stream:wait_event`, the first
/// donor's work still running) needs a new event for the second donor; the device refuses to
/// create it. The growth takes what it has (the first donor's chunk) and creates the rest: the
/// request is served, and the chunk taken is neither lost (it was out of every range, its
/// physical memory held for good) nor counted twice (found in review).
#[test]
fn an_event_refused_in_the_middle_of_a_page_move_loses_no_chunk() {
    let (dev, alloc) = setup("cross_stream:wait_event,fast_cache:false", 48 * MIB);
    let (s1, s2) = (dev.create_stream().unwrap(), dev.create_stream().unwrap());
    let a = alloc.alloc(20 * MIB, s1).unwrap(); // s1's range first: the first donor
    let b = alloc.alloc(20 * MIB, s2).unwrap();
    let (k, gate) = gated_write(a.ptr(), a.len(), 1);
    dev.launch(s1, k).unwrap();
    drop((a, b));
    assert_eq!(dev.physical_bytes(), 40 * MIB);
    dev.fail_nth_event_create(Some(2));
    let opener = common::open_on_next_sync(&dev, gate);
    let got = alloc.alloc(40 * MIB, StreamId::DEFAULT).unwrap();
    dev.synchronize().unwrap();
    opener.join().unwrap();
    alloc.check_invariants().unwrap();
    let reserved = alloc.stats().blocks.reserved_bytes.all.current;
    assert_eq!((reserved, dev.physical_bytes()), (40 * MIB, 40 * MIB));
    drop(got);
    drop(alloc);
    assert_no_leak(&dev);
}

/// `empty_cache` waits for a range's stream before it unmaps the range's free pages; when the
/// device refuses to create the event that wait needs, it waits for the whole device instead (as
/// for a refused record) and unmaps them. It used to skip the range and return `Ok` with 4 MiB
/// of free pages still mapped and cached (found by the fuzz harness once it injected refused
/// event creations).
#[test]
fn empty_cache_unmaps_a_ranges_free_pages_when_the_event_for_its_stream_is_refused() {
    let (dev, alloc) = setup("", CAP);
    let s = dev.create_stream().unwrap();
    drop(alloc.alloc(4 * MIB, s).unwrap()); // freed on its own stream: no event
    assert_eq!((alloc.reserved_bytes(), dev.physical_bytes()), (4 * MIB, 4 * MIB));
    let events = dev.live_events();
    dev.fail_nth_event_create(Some(1));
    alloc.empty_cache().unwrap();
    assert_eq!(dev.live_events(), events, "the refused creation made no event");
    alloc.check_invariants().unwrap();
    assert_eq!(
        (alloc.reserved_bytes(), dev.physical_bytes(), dev.live_mappings()),
        (0, 0, vec![]),
        "empty_cache left free pages mapped"
    );
    drop(alloc.alloc(4 * MIB, s).unwrap()); // and the allocator serves on
    drop(alloc);
    assert_no_leak(&dev);
}

/// A growth whose second chunk's map is refused undoes the first chunk's map, and that unmap is
/// refused too: the mapping stays, as a run of free pages of the range (counted, released later
/// like any), not forgotten with its handle released (its address then failed every later
/// growth, and it outlived the allocator; found in review). With stitching on, chunks are 4
/// pages: 12 MiB is a chunk of 4 pages and one of 2.
#[test]
fn an_unmap_refused_while_a_failed_growth_is_undone_keeps_the_pages_in_the_range() {
    let (dev, alloc) = setup("expandable_stitching:true", CAP);
    dev.fail_nth_vm_map(Some(2));
    dev.fail_nth_vm_unmap(Some(1));
    let first = alloc.alloc(12 * MIB, StreamId::DEFAULT);
    alloc.check_invariants().unwrap();
    // The ladder's retry may serve it over the kept pages; either way the pages are the range's.
    let kept = alloc.stats().blocks.reserved_bytes.all.current;
    assert_eq!(kept, dev.physical_bytes(), "every mapped byte is counted");
    drop(first);
    for _ in 0..3 {
        drop(alloc.alloc(12 * MIB, StreamId::DEFAULT).unwrap());
    }
    alloc.empty_cache().unwrap();
    assert_eq!((alloc.stats().blocks.reserved_bytes.all.current, dev.physical_bytes()), (0, 0));
    drop(alloc);
    assert_no_leak(&dev);
}

/// A growth widened by its headroom (a build-up's ramp: 5 pages, with stitching's 4-page
/// chunks a chunk of 4 and one of 1) whose second map is refused, and whose rollback's unmap of
/// the first chunk is refused too, keeps that chunk mapped: free pages of the range at the
/// place the growth had found. The request then grows by its own pages only — at a place
/// found again. Grown at the place found before the wide growth, over the kept pages, the map
/// was refused (an invalid value) and the allocation failed with that error although the kept
/// pages held it (broken build `headroom_stale_place`).
#[test]
fn a_failed_headroom_growth_that_keeps_its_first_chunk_places_the_request_again() {
    let (dev, alloc) = setup("expandable_stitching:true", CAP);
    let s = StreamId::DEFAULT;
    // 18 blocks of a page, none freed (a build-up): growths of 1 page (9), then 2, 3 and 4.
    let mut live: Vec<_> = (0..18).map(|_| alloc.alloc(2 * MIB, s).unwrap()).collect();
    let base = live[0].ptr().0;
    assert_eq!((alloc.reserved_bytes(), dev.vm_counters().creates), (36 * MIB, 12));
    // The 13th growth maps 5 pages: its second chunk's map refused, then the rollback's unmap.
    dev.fail_nth_vm_map(Some(2));
    dev.fail_nth_vm_unmap(Some(1));
    let b = alloc.alloc(2 * MIB, s).expect("served by the kept pages");
    assert_eq!(b.ptr().0, base + 36 * MIB, "the kept chunk's first page");
    live.push(b);
    alloc.check_invariants().unwrap();
    let vm = dev.vm_counters();
    assert_eq!((vm.creates, vm.releases, vm.maps, vm.unmaps), (14, 1, 13, 0));
    assert_eq!((alloc.reserved_bytes(), dev.physical_bytes()), (44 * MIB, 44 * MIB));
    assert_eq!(dev.violations(), vec![]);
    drop(live);
    alloc.empty_cache().unwrap();
    assert_eq!((alloc.reserved_bytes(), dev.physical_bytes()), (0, 0));
    drop(alloc);
    assert_no_leak(&dev);
}

/// PyTorch's `release_cached_blocks` gives a wholly unmapped expandable segment's addresses
/// back (`release_expandable_segment`). Here a range whose stream the device no longer knows
/// (destroyed on the device, not through the allocator) does so at `empty_cache` once nothing
/// is mapped there; a live stream's range stays for its next growth. Kept (broken build
/// `empty_cache_keeps_ranges`), three such ranges filled this device's virtual space for good,
/// and every later stream fell back to ordinary segments.
#[test]
fn empty_cache_frees_the_ranges_of_streams_destroyed_elsewhere() {
    let (dev, alloc) = setup("", CAP);
    dev.set_virtual_capacity(6 * CAP); // room for three ranges
    drop(alloc.alloc(4 * MIB, StreamId::DEFAULT).unwrap());
    alloc.empty_cache().unwrap();
    assert_eq!(dev.virtual_bytes(), 2 * CAP, "a live stream's range stays");
    for _ in 0..4 {
        let s = dev.create_stream().unwrap();
        drop(alloc.alloc(4 * MIB, s).unwrap());
        assert!(dev.live_segments().is_empty(), "served by a range, no ordinary segment");
        assert_eq!(dev.virtual_bytes(), 4 * CAP);
        dev.destroy_stream(s).unwrap();
        alloc.empty_cache().unwrap();
        assert_eq!(dev.virtual_bytes(), 2 * CAP);
        assert_eq!(alloc.stats().virtual_reserved_bytes, 2 * CAP);
        assert_eq!(alloc.expandable_ranges().len(), 1);
        alloc.check_invariants().unwrap();
    }
    let s = dev.create_stream().unwrap();
    let b = alloc.alloc(4 * MIB, s).unwrap();
    assert!(dev.live_segments().is_empty(), "no ordinary segment");
    assert_eq!(alloc.expandable_ranges().len(), 2);
    drop(b);
    drop(alloc);
    assert_no_leak(&dev);
}

/// The stream caches hand out blocks of the small pool's largest class (1 MiB, half a page)
/// lowest address first over expandable segments, as the pool's best fit picks among blocks of
/// one size (LIFO, t5_train's small range grew by a page in its third step; design notes,
/// "Placement-driven maps after the first step"). Smaller classes, and the largest over
/// ordinary segments, stay last freed first. Hits all: no global lock.
/// (`cfg(tidepool_broken = "lanes_lifo_largest_small")`: LIFO for every class.)
#[test]
fn the_largest_small_class_leaves_the_stream_cache_lowest_address_first() {
    let s = StreamId::DEFAULT;
    let (dev, alloc) = setup("", CAP);
    let mib: Vec<_> = (0..3).map(|_| alloc.alloc(MIB, s).unwrap()).collect();
    let half: Vec<_> = (0..2).map(|_| alloc.alloc(MIB / 2, s).unwrap()).collect();
    let at = |off: u64| DeviceAddr(base() + off);
    // The small range: [1 MiB ×3][512 KiB ×2], its two pages full.
    assert_eq!(mib.iter().map(|b| b.ptr()).collect::<Vec<_>>(), [at(0), at(MIB), at(2 * MIB)]);
    assert_eq!(half.iter().map(|b| b.ptr()).collect::<Vec<_>>(), [at(3 * MIB), at(7 * MIB / 2)]);
    assert_eq!(mapped_pages(&dev, base()), vec![0, 1]);
    // Freed as 0, 2, 1 MiB (LIFO would hand out 1, then 2, then 0) and 3, 3.5 MiB.
    let [a, b, c]: [_; 3] = mib.try_into().unwrap();
    let [d, e]: [_; 2] = half.try_into().unwrap();
    drop((a, c, b, d, e));
    assert_eq!(alloc.stats().cached_fast_bytes, 4 * MIB);
    let n = alloc.global_lock_acquisitions();
    let mib: Vec<_> = (0..3).map(|_| alloc.alloc(MIB, s).unwrap()).collect();
    let half = alloc.alloc(MIB / 2, s).unwrap();
    assert_eq!(alloc.global_lock_acquisitions(), n, "four hits, no lock");
    assert_eq!(mib.iter().map(|b| b.ptr()).collect::<Vec<_>>(), [at(0), at(MIB), at(2 * MIB)]);
    assert_eq!(half.ptr(), at(7 * MIB / 2), "a smaller class: the last freed");
    assert_eq!(alloc.stats().cached_fast_bytes, MIB / 2);
    assert_eq!(mapped_pages(&dev, base()), vec![0, 1]);
    alloc.check_invariants().unwrap();
    assert_eq!(dev.violations(), vec![]);
    drop((mib, half, alloc));
    assert_no_leak(&dev);

    // Ordinary segments: LIFO as before (the caching allocator's placement is unchanged).
    let dev = Arc::new(SimDevice::backed(CAP));
    let alloc = Allocator::new(dev.clone(), Config::default()).unwrap();
    let mib: Vec<_> = (0..3).map(|_| alloc.alloc(MIB, s).unwrap()).collect();
    let ptrs: Vec<_> = mib.iter().map(|b| b.ptr()).collect();
    let [a, b, c]: [_; 3] = mib.try_into().unwrap();
    drop((a, c, b));
    let n = alloc.global_lock_acquisitions();
    let again: Vec<_> = (0..3).map(|_| alloc.alloc(MIB, s).unwrap()).collect();
    assert_eq!(alloc.global_lock_acquisitions(), n, "three hits, no lock");
    assert_eq!(again.iter().map(|b| b.ptr()).collect::<Vec<_>>(), [ptrs[1], ptrs[2], ptrs[0]]);
}

/// What a growth that failed after taking another stream's chunk left: its result, the
/// device's mappings, reserved and physical bytes, host syncs and pages moved.
type AfterFailedTake = (Result<DeviceAddr, String>, Vec<(u64, u64)>, u64, u64, u64, u64);

/// Stream 1 frees 8 MiB while its kernel still writes them; stream 2, under `wait_event` with
/// `throw_on_cudamalloc_oom` and a cap of 8 MiB, asks for 12 MiB, optionally while a capture
/// runs on a third stream. Its growth takes stream 1's chunk (4 pages, its old mapping
/// retiring behind the kernel) and needs 2 pages more: past the cap, refused. Returns what the
/// failed growth left (see [`AfterFailedTake`]), the kernel's gate opened afterwards, with the
/// invariants checked and no leak at the end.
fn rejected_after_taking(capture: bool, unsettled: bool) -> AfterFailedTake {
    let conf =
        "cross_stream:wait_event,throw_on_cudamalloc_oom:true,per_process_memory_fraction:0.5";
    let (dev, alloc, [_, s2, c], open) = donor_freed_while_running(conf, 16 * MIB);
    alloc.set_broken(tidepool::hooks::Broken::UnsettledMoves, unsettled);
    if capture {
        alloc.begin_capture(c, None).unwrap();
    }
    // (A host wait, where the allocator makes one, opens the gate.)
    let opener = common::open_on_next_sync(&dev, open);
    let b = alloc.alloc(12 * MIB, s2).map(|b| b.ptr()).map_err(|e| e.to_string());
    let s = alloc.stats();
    let after = (
        b,
        mapped_chunks(&dev, base()),
        s.blocks.reserved_bytes.all.current,
        dev.physical_bytes(),
        s.num_host_syncs,
        s.num_pages_moved,
    );
    if capture {
        drop(alloc.end_capture(c).unwrap());
    }
    dev.synchronize().unwrap();
    opener.join().unwrap();
    if !unsettled {
        alloc.check_invariants().unwrap();
    }
    alloc.synchronize().unwrap();
    alloc.empty_cache().unwrap();
    alloc.check_invariants().unwrap();
    assert_eq!(dev.violations(), vec![]);
    assert_eq!(dev.kernel_failures(), vec![]);
    drop(alloc);
    assert_no_leak(&dev);
    after
}

/// A growth refused after taking pages goes back to where it was: the chunk, still mapped at
/// its old place, is a free run of stream 1's range again — no device call, no host wait, also
/// during a capture, where no wait is allowed. Broken build `taken_waited_for` (the earlier
/// fix): a host wait for stream 1's kernel, then the chunk released; in a capture, which
/// refuses the wait, released while still mapped (the device holds 8 MiB no range counts).
#[test]
fn a_failed_growth_gives_the_pages_it_took_back_to_their_donor() {
    for capture in [false, true] {
        let (b, chunks, reserved, physical, syncs, moved) = rejected_after_taking(capture, false);
        let e = b.unwrap_err();
        assert!(e.contains("preemptively rejected"), "{e}");
        assert_eq!(chunks, vec![(0, 4)], "capture: {capture}");
        assert_eq!((reserved, physical), (8 * MIB, 8 * MIB), "capture: {capture}");
        assert_eq!((syncs, moved), (0, 0), "capture: {capture}");
    }
}

/// Broken mode `UnsettledMoves`: the taken chunk is released while its old mapping retires,
/// and the device holds its memory where no range counts it.
#[test]
fn a_taken_chunk_released_while_mapped_is_caught() {
    let (b, chunks, reserved, physical, syncs, _) = rejected_after_taking(false, true);
    assert!(b.is_err());
    assert_eq!((chunks, reserved, physical, syncs), (vec![(0, 4)], 0, 8 * MIB, 0));
}

/// `throw_on_cudamalloc_oom` and the caps weigh what a growth holds once done, the chunks it
/// takes from other streams included (carved out of their donors' pools, they are in no
/// reserved bytes while the growth runs): stream 2's 12 MiB — stream 1's 8 MiB moved, 4 MiB
/// new — pass a cap of 8 MiB. Without the cap, or with a cap the growth fits, the same request
/// moves the chunk. Broken build `cap_skips_taken`: only the new 4 MiB weighed, and the
/// allocator reserves 12 MiB under a cap of 8.
#[test]
fn the_caps_weigh_the_pages_a_growth_takes() {
    let (b, ..) = rejected_after_taking(false, false);
    assert!(b.unwrap_err().contains("would take the 8.00 MiB reserved past the cap of 8.00 MiB"));
    for conf in ["", "per_process_memory_fraction:0.75", "throw_on_cudamalloc_oom:true"] {
        let (dev, alloc) = setup(&format!("cross_stream:wait_event,{conf}"), 16 * MIB);
        let (s1, s2) = (dev.create_stream().unwrap(), dev.create_stream().unwrap());
        drop(alloc.alloc(8 * MIB, s1).unwrap());
        let b = alloc.alloc(12 * MIB, s2).unwrap();
        assert_eq!(b.ptr(), DeviceAddr(base() + 32 * MIB), "{conf}");
        assert_eq!(mapped_chunks(&dev, base()), vec![(16, 4), (20, 2)], "{conf}");
        let s = alloc.stats();
        assert_eq!((s.num_pages_moved, s.blocks.reserved_bytes.all.current), (4, 12 * MIB));
        drop(b);
        alloc.check_invariants().unwrap();
        drop(alloc);
        assert_no_leak(&dev);
    }
}

/// A growth refused after taking an idle stream's chunk: that chunk was unmapped at its old
/// place at once (the donor's work was done), so it is no free run of the donor any more and is
/// released — and counted as no page moved, since no page served another stream. Stream 1's
/// 8 MiB are unmapped (one unmap) and released (one release); nothing is reserved or held
/// after. Broken build `failed_take_counted`: the 4 pages stay counted as moved.
#[test]
fn a_chunk_taken_by_a_refused_growth_and_released_counts_as_no_move() {
    let (dev, alloc) = setup("cross_stream:wait_event,per_process_memory_fraction:0.5", 16 * MIB);
    let (s1, s2) = (dev.create_stream().unwrap(), dev.create_stream().unwrap());
    drop(alloc.alloc(8 * MIB, s1).unwrap());
    assert_eq!(mapped_chunks(&dev, base()), vec![(0, 4)]);
    let e = alloc.alloc(12 * MIB, s2).unwrap_err();
    assert!(matches!(e, tidepool::AllocError::OutOfMemory(_)), "{e}");
    let s = alloc.stats();
    assert_eq!(mapped_chunks(&dev, base()), vec![]);
    assert_eq!((s.blocks.reserved_bytes.all.current, dev.physical_bytes()), (0, 0));
    assert_eq!(s.num_pages_moved, 0);
    let c = dev.vm_counters();
    assert_eq!((c.creates, c.maps, c.unmaps, c.releases), (1, 1, 1, 1));
    assert_eq!(s.num_host_syncs, 0);
    alloc.check_invariants().unwrap();
    // The allocator works on: 8 MiB fit the cap.
    let b = alloc.alloc(8 * MIB, s2).unwrap();
    assert_eq!(alloc.stats().num_pages_moved, 0);
    drop(b);
    alloc.check_invariants().unwrap();
    assert_eq!(dev.violations(), vec![]);
    drop(alloc);
    assert_no_leak(&dev);
}

/// A growth whose map fails after it took another stream's chunk, during a capture on a third
/// stream (no host wait allowed): the chunk goes back to its donor, and the ladder's retry takes
/// it again and succeeds, on a device with no room for new memory beyond it. Broken build
/// `taken_waited_for`: the refused wait left the chunk mapped at its old place when it was
/// released; its memory held there, the retry's new pages do not fit: out of memory.
#[test]
fn a_map_refused_after_a_take_during_a_capture_leaves_the_pages_to_retry() {
    let (dev, alloc, [_, s2, c], open) =
        donor_freed_while_running("cross_stream:wait_event", 12 * MIB);
    alloc.begin_capture(c, None).unwrap();
    dev.fail_nth_vm_map(Some(1));
    let b = alloc.alloc(12 * MIB, s2).map_err(|e| tidepool::ErrorChain(&e).to_string()).unwrap();
    assert_eq!(b.ptr(), DeviceAddr(base() + 24 * MIB));
    assert_eq!(mapped_chunks(&dev, base()), vec![(0, 4), (12, 4), (16, 2)], "in transit");
    let s = alloc.stats();
    assert_eq!((s.num_pages_moved, s.num_host_syncs, s.num_alloc_retries), (4, 0, 1));
    assert_eq!((dev.physical_bytes(), s.blocks.reserved_bytes.all.current), (12 * MIB, 12 * MIB));
    drop(alloc.end_capture(c).unwrap());
    open.send(()).unwrap();
    dev.synchronize().unwrap();
    drop(b);
    alloc.synchronize().unwrap();
    assert_eq!(mapped_chunks(&dev, base()), vec![(12, 4), (16, 2)]);
    alloc.check_invariants().unwrap();
    assert_eq!(dev.violations(), vec![]);
    assert_eq!(dev.kernel_failures(), vec![]);
    drop(alloc);
    assert_no_leak(&dev);
}

/// A learning run (a named scope's first) on stream 2 takes stream 1's cached chunk while
/// stream 1's kernel still writes it (`wait_event`: in transit, its old mapping retiring). The
/// run's end releases stream 2's free pages, and waits on the host for what retires for them —
/// here the old mapping, which must go before the chunk can — though for no other stream's.
/// Broken build `adopt_skips_transit`: the run's end did not wait for it, and the chunk stayed
/// mapped twice.
#[test]
fn a_learning_runs_end_waits_for_the_chunks_moved_into_its_stream() {
    let (dev, alloc, [_, s2, _], open) =
        donor_freed_while_running("cross_stream:wait_event", 16 * MIB);
    let run = alloc.named_scope("step", s2);
    let b = run.alloc(4 * MIB).unwrap();
    assert_eq!(b.ptr(), DeviceAddr(base() + 32 * MIB));
    assert_eq!(mapped_chunks(&dev, base()), vec![(0, 4), (16, 4)], "in transit");
    drop(b);
    let opener = common::open_on_next_sync(&dev, open);
    drop(run);
    let s = alloc.stats();
    // The old mapping went; the chunk was released, and the run's plan keeps a region of
    // 4 MiB mapped anew.
    let (chunks, physical) = (mapped_chunks(&dev, base()), dev.physical_bytes());
    dev.synchronize().unwrap(); // (where the allocator did not wait, this opens the gate)
    opener.join().unwrap();
    // One wait for stream 1's event; the release of stream 2's pages may wait once more, for
    // stream 2's own work: its queue holds the wait on that event, which its worker may not
    // have passed yet when the host is released.
    assert!((1..=2).contains(&s.num_host_syncs), "{}", s.num_host_syncs);
    assert_eq!(s.num_pages_moved, 4);
    assert_eq!((chunks, physical), (vec![(16, 2)], 4 * MIB));
    alloc.check_invariants().unwrap();
    assert_eq!(dev.violations(), vec![]);
    drop(alloc);
    assert_no_leak(&dev);
}

/// A view (`snapshot`) shows what its lock section leaves. A trim checks only the streams whose
/// free bytes changed since the last trim, and one that passed a chunk in transit over checks
/// the stream again at its next change, not at every section's end. Here the donor's kernel is
/// done, but the event query of the view's settle fails, so the chunk is still in transit there
/// and the view lists its run; the section's end polls again and the old mapping goes, but
/// trims nothing (the stream did not change since its trim), and the stream's next change
/// releases the chunk. Broken build `trim_dirty_published` (a trim checks the streams the
/// statistics have not published, a list a view leaves as it was): the section's end released
/// the run the view had just listed (found by the `allocator_ops` fuzzer, where it depended on
/// the kernel completing between the two settles; fixed then by a view's section trimming
/// once, a special case this rule made unneeded).
#[test]
fn a_view_lists_no_run_its_own_section_releases() {
    let (dev, alloc, s2, open) = passed_over_in_transit();
    open.send(()).unwrap();
    dev.synchronize().unwrap();
    dev.fail_next_event_queries(1);
    let runs: Vec<(DeviceAddr, u64)> =
        alloc.snapshot().iter().filter(|s| s.stream == s2).map(|s| (s.address, s.size)).collect();
    assert_eq!(runs, vec![(DeviceAddr(base() + 32 * MIB), 8 * MIB)]);
    assert_eq!(mapped_chunks(&dev, base()), vec![(16, 4)], "the view's run still mapped");
    alloc.check_invariants().unwrap();
    drop(alloc.alloc(2 * MIB, s2).unwrap()); // the stream's next change: the chunk goes
    assert_eq!(mapped_chunks(&dev, base()), Vec::<(u64, u64)>::new());
    assert_eq!(alloc.stats().blocks.reserved_bytes.all.current, 0);
    assert_eq!(dev.violations(), vec![]);
    drop(alloc);
    assert_no_leak(&dev);
}

/// Device calls of 20 allocations of 8 MiB on stream `s`, each freed at once, after a run of
/// the named scope "step" on `s` (an 8 MiB unbound buffer, freed) — with, before it, a first
/// (learning) run of the scope that was `mem::forget`-ten (`forget`), which never ends; with
/// `beside` too, an earlier learning run opened before the forgotten one and ended after it
/// opened (so the run after them follows the plan it learned): (creates, maps, unmaps,
/// releases).
fn allocations_after_a_forgotten_learning_run(forget: bool, beside: bool) -> (u64, u64, u64, u64) {
    let (dev, alloc) = setup("", CAP);
    let s = dev.create_stream().unwrap();
    let run = || {
        let scope = alloc.named_scope("step", s);
        drop(scope.alloc_unbound(8 * MIB).unwrap());
        scope
    };
    let earlier = beside.then(run);
    if forget {
        std::mem::forget(run());
    }
    drop(earlier); // learns the plan the next run follows
    drop(run()); // learns (again), or follows that plan
    let before = dev.vm_counters();
    for _ in 0..20 {
        drop(alloc.alloc(8 * MIB, s).unwrap());
    }
    let v = dev.vm_counters();
    alloc.check_invariants().unwrap();
    drop(alloc);
    assert_no_leak(&dev);
    (
        v.creates - before.creates,
        v.maps - before.maps,
        v.unmaps - before.unmaps,
        v.releases - before.releases,
    )
}

/// A named scope's learning run gives its stream's freed pages back at once until it ends; a
/// `mem::forget`-ten one never ended, so every later free on the stream unmapped its pages for
/// good (20 allocations of 8 MiB: 20 creates, maps and unmaps instead of one create and map).
/// The stream's learning mark is now one per named scope and stream: the scope's next run
/// takes it over from the forgotten one, or ends it if it follows a plan (learned by a run
/// that opened before the forgotten one), so once that run ends the stream keeps its pages as
/// without the forgotten run. (The broken build
/// `cfg(tidepool_broken = "forgotten_learning_kept")` counts a mark per run, as before.)
#[test]
fn a_forgotten_learning_run_stops_trimming_its_stream_when_the_scope_runs_again() {
    for (forget, beside) in [(false, false), (true, false), (false, true), (true, true)] {
        let calls = allocations_after_a_forgotten_learning_run(forget, beside);
        assert_eq!(calls, (1, 1, 0, 0), "forget {forget}, beside {beside}");
    }
}

/// Best-fit searches of 20 allocations of 8 MiB on the default stream, each freed at once,
/// after stream `t` is destroyed with a first (learning) run of a named scope on it
/// `mem::forget`-ten (`forget`) or ended.
fn searches_after_a_stream_destroyed_with_a_forgotten_learning_run(forget: bool) -> u64 {
    let (dev, alloc) = setup("", CAP);
    let t = dev.create_stream().unwrap();
    let scope = alloc.named_scope("step", t);
    drop(scope.alloc_unbound(8 * MIB).unwrap());
    match forget {
        true => std::mem::forget(scope),
        false => drop(scope),
    }
    alloc.destroy_stream(t).unwrap();
    let before = alloc.stats().best_fit_searches;
    for _ in 0..20 {
        drop(alloc.alloc(8 * MIB, StreamId::DEFAULT).unwrap());
    }
    let searches = alloc.stats().best_fit_searches - before;
    alloc.check_invariants().unwrap();
    drop(alloc);
    assert_no_leak(&dev);
    searches
}

/// While any stream has a learning run open, freed large blocks go to the pool at once instead
/// of their stream's cache (`Shared::large_cacheable`), on every stream. A learning run
/// `mem::forget`-ten on a stream that is then destroyed kept that for good: every 8 MiB
/// allocation on the default stream searched the pool. Destroying the stream now ends the
/// learning marks of its scopes with their plans: one search, then the stream's cache serves.
/// (Broken build `forgotten_learning_kept`: 20.)
#[test]
fn destroying_a_stream_ends_the_learning_mark_of_a_forgotten_run_on_it() {
    assert_eq!(searches_after_a_stream_destroyed_with_a_forgotten_learning_run(false), 1);
    assert_eq!(searches_after_a_stream_destroyed_with_a_forgotten_learning_run(true), 1);
}

/// The out-of-memory ladder releases every free chunk it can: a chunk of another stream whose
/// unmapping the device refuses stays mapped (a free block of its range, counted reserved),
/// the chunk below it goes all the same, and the request is served from the room that made.
/// Before, the refusal ended the release and became the request's error, although the
/// request had nothing to do with that chunk.
#[test]
fn a_refused_unmap_in_the_ladder_keeps_that_chunk_and_releases_the_others() {
    // 8 pages; s1's range takes 6 of them in two chunks of 3, both free after.
    let (dev, alloc) = setup("cross_stream:never", 8 * P);
    let s1 = dev.create_stream().unwrap();
    let a = alloc.alloc(3 * P, s1).unwrap();
    let b = alloc.alloc(3 * P, s1).unwrap();
    let s1_base = a.ptr().0;
    assert_eq!(b.ptr().0, s1_base + 3 * P);
    drop((a, b));
    alloc.synchronize().unwrap();
    assert_eq!(mapped_chunks(&dev, s1_base), vec![(0, 3), (3, 3)]);
    assert_eq!(alloc.reserved_bytes(), 6 * P);
    // 4 pages on the default stream: the device has 2. The ladder unmaps s1's chunks from the
    // top down; the device refuses the first unmap (the top chunk).
    dev.fail_nth_vm_unmap(Some(1));
    let c = alloc.alloc(4 * P, StreamId::DEFAULT).expect("served once the lower chunk went");
    assert_eq!(c.len(), 4 * P);
    assert_eq!(mapped_chunks(&dev, s1_base), vec![(3, 3), ((c.ptr().0 - s1_base) / P, 4)]);
    assert_eq!(alloc.reserved_bytes(), 7 * P, "the refused chunk is still counted");
    assert_eq!(dev.physical_bytes(), 7 * P);
    let s1_range = alloc.expandable_ranges().into_iter().find(|r| r.base.0 == s1_base).unwrap();
    assert_eq!((s1_range.mapped_bytes, s1_range.free_bytes), (3 * P, 3 * P));
    alloc.check_invariants().unwrap();
    assert_eq!(dev.violations(), vec![]);
    // The kept chunk goes at the next release.
    drop(c);
    alloc.empty_cache().unwrap();
    assert_eq!((alloc.reserved_bytes(), dev.physical_bytes()), (0, 0));
    drop(alloc);
    assert_no_leak(&dev);
}
