//! Stitched blocks (`expandable_stitching:true`, GMLake's stitching over expandable ranges) on
//! SimDevice, with exact addresses, chunks and device calls: a large request that no free block
//! holds is served from the stream's free chunks mapped again at one address of their own; the
//! chunks are lent (the home range cannot hand them out) while the stitch is live and come back
//! when it is freed; a cached stitch serves again with no device call; releases unmap the
//! stitches first, after the stream's work; a map refused midway falls back to a growth; nothing
//! leaks. Broken modes: `StitchKeepsHome`, `StitchUnmapEarly`.
//!
//! With stitching on, ranges are made of chunks of 4 pages (8 MiB). The first range starts at
//! `SIM_BASE` and is twice the device's capacity; the first stitch's own range follows it.

mod common;

use std::sync::Arc;
use std::sync::mpsc;
use tidepool::device::{Access, AccessKind, Kernel, Launch, SIM_BASE, SimDevice};
use tidepool::hooks::Broken;
use tidepool::{AllocError, Allocator, Buffer, Config, Device, DeviceAddr, MIB, StreamId};

const P: u64 = 2 * MIB;
const CAP: u64 = 256 * MIB;
const S0: StreamId = StreamId::DEFAULT;

fn setup(config: &str) -> (Arc<SimDevice>, Allocator<SimDevice>) {
    let dev = Arc::new(SimDevice::backed(CAP));
    let config = Config::parse(config).unwrap().with_expandable_segments(true);
    let alloc = Allocator::new(dev.clone(), config).unwrap();
    (dev, alloc)
}

fn at(offset: u64) -> DeviceAddr {
    DeviceAddr(SIM_BASE + offset)
}

/// Where the first stitch's own range starts.
fn stitch_base() -> DeviceAddr {
    at(2 * CAP)
}

/// The allocator is gone: no physical memory, no virtual range, no violation left.
fn assert_nothing_left(dev: &SimDevice) {
    assert_eq!((dev.live_physical(), dev.virtual_bytes()), (0, 0));
    assert_eq!(dev.violations(), vec![]);
}

/// A kernel declaring a write of `[ptr, ptr + bytes)` that runs once the returned gate opens.
fn gated_write(ptr: DeviceAddr, bytes: u64) -> (Kernel, mpsc::Sender<()>) {
    let (open, gate) = mpsc::channel::<()>();
    let k = Kernel::new(
        "gated_write",
        vec![Access { ptr, bytes, kind: AccessKind::Write }],
        move |_| {
            let _ = gate.recv();
        },
    );
    (k, open)
}

/// 8, 16, 8, 16, 8 MiB back to back (7 chunks, 28 pages), then the three 8 MiB blocks freed:
/// three free chunks at 0, 24 and 48 MiB, none of which holds 24 MiB. Returns the 16 MiB ones.
fn holes(dev: &SimDevice, alloc: &Allocator<SimDevice>) -> Vec<Buffer<SimDevice>> {
    let bufs = holes_above(alloc, 0);
    let v = dev.vm_counters();
    assert_eq!((v.creates, v.maps), (7, 7));
    alloc.check_invariants().unwrap();
    bufs
}

#[test]
fn a_stitch_serves_a_large_request_from_free_chunks_and_is_served_again_with_no_device_call() {
    let (dev, alloc) = setup("fast_cache:false,expandable_stitching:true");
    let kept = holes(&dev, &alloc);
    // 24 MiB: a growth would map 8 pages over the free end; the three free chunks hold all 12.
    let s = alloc.alloc(24 * MIB, S0).unwrap();
    assert_eq!(s.ptr(), stitch_base());
    let v = dev.vm_counters();
    assert_eq!((v.creates, v.maps, v.reserves), (7, 10, 2), "three alias maps, nothing created");
    assert_eq!(alloc.reserved_bytes(), 28 * P, "the chunks count once");
    assert_eq!(dev.physical_bytes(), 28 * P);
    let r = &alloc.expandable_ranges()[0];
    assert_eq!((r.lent_bytes, r.stitches), (24 * MIB, 1));
    assert_eq!(r.runs, vec![(at(8 * MIB), 16 * MIB), (at(32 * MIB), 16 * MIB)]);
    alloc.check_invariants().unwrap();
    // The lent chunks are not the home range's to hand out: an 8 MiB request grows at the top.
    let c = alloc.alloc(8 * MIB, S0).unwrap();
    assert_eq!(c.ptr(), at(56 * MIB));
    // A kernel writes all of the stitched block: its pages are mapped, and nobody else's.
    let k = Kernel::new(
        "fill",
        vec![Access { ptr: s.ptr(), bytes: 24 * MIB, kind: AccessKind::Write }],
        |_| {},
    );
    dev.launch(S0, k).unwrap();
    dev.synchronize().unwrap();
    assert_eq!(dev.violations(), vec![]);
    // Freed: the chunks go home (free there), the stitch stays mapped.
    drop(s);
    let r = &alloc.expandable_ranges()[0];
    assert_eq!((r.lent_bytes, r.stitches, r.free_bytes), (0, 1, 24 * MIB));
    alloc.check_invariants().unwrap();
    let d = alloc.alloc(8 * MIB, S0).unwrap();
    assert_eq!(d.ptr(), at(0), "a chunk back home serves the home range again");
    drop(d);
    // Asked again: the cached stitch, whose chunks are all free, with no device call.
    let maps = dev.vm_counters().maps;
    let s = alloc.alloc(24 * MIB, S0).unwrap();
    assert_eq!(s.ptr(), stitch_base());
    assert_eq!(dev.vm_counters().maps, maps);
    assert_eq!(dev.vm_counters().reserves, 2);
    alloc.check_invariants().unwrap();
    drop((s, c, kept));
    alloc.empty_cache().unwrap();
    assert_eq!(dev.live_mappings(), vec![], "the stitch's mappings went with its chunks");
    assert_eq!(dev.virtual_bytes(), 2 * CAP, "and its range");
    assert_eq!(alloc.expandable_ranges()[0].stitches, 0);
    assert_eq!(dev.physical_bytes(), 0);
    drop(alloc);
    assert_nothing_left(&dev);
}

#[test]
fn a_stitch_whose_chunks_are_busy_again_is_not_served() {
    let (dev, alloc) = setup("fast_cache:false,expandable_stitching:true");
    let kept = holes(&dev, &alloc);
    drop(alloc.alloc(24 * MIB, S0).unwrap());
    // A chunk of the cached stitch is taken at home: the next 24 MiB needs a stitch of its own,
    // of the two chunks still free and one grown at the top.
    let d = alloc.alloc(8 * MIB, S0).unwrap();
    assert_eq!(d.ptr(), at(0));
    let s = alloc.alloc(24 * MIB, S0).unwrap();
    assert_eq!(s.ptr(), DeviceAddr(stitch_base().0 + 24 * MIB));
    let v = dev.vm_counters();
    assert_eq!((v.creates, v.maps, v.reserves), (8, 7 + 3 + 1 + 3, 3));
    assert_eq!(alloc.reserved_bytes(), 32 * P);
    assert_eq!(alloc.expandable_ranges()[0].stitches, 2);
    alloc.check_invariants().unwrap();
    drop((s, d, kept));
    alloc.check_invariants().unwrap();
    drop(alloc);
    assert_nothing_left(&dev);
}

/// An 8 MiB request while a stitch is live: the violations the sanitizer reports.
fn home_request_under_a_live_stitch(broken: bool) -> Vec<String> {
    let (dev, alloc) = setup("fast_cache:false,expandable_stitching:true");
    alloc.set_broken(Broken::StitchKeepsHome, broken);
    let _kept = holes(&dev, &alloc);
    let s = alloc.alloc(24 * MIB, S0).unwrap();
    assert_eq!(s.ptr(), stitch_base());
    let c = alloc.alloc(8 * MIB, S0).unwrap();
    assert_eq!(c.ptr() == at(0), broken, "broken: the lent chunk at 0 is handed out again");
    dev.violations().iter().map(|v| v.op.clone()).collect()
}

#[test]
fn lent_chunks_are_not_handed_out_at_home() {
    assert_eq!(home_request_under_a_live_stitch(false), Vec::<String>::new());
    let found = home_request_under_a_live_stitch(true);
    assert!(
        found.iter().any(|op| op == "handout of physical memory handed out at another address"),
        "{found:?}"
    );
}

/// A kernel still running on a freed stitched block when `empty_cache` releases its chunks.
fn release_under_a_running_kernel(broken: bool) -> Vec<String> {
    let (dev, alloc) = setup("fast_cache:false,expandable_stitching:true");
    alloc.set_broken(Broken::StitchUnmapEarly, broken);
    let kept = holes(&dev, &alloc);
    let s = alloc.alloc(24 * MIB, S0).unwrap();
    let (k, open) = gated_write(s.ptr(), 24 * MIB);
    dev.launch(S0, k).unwrap();
    drop(s);
    // The release waits for the stream (a host sync): the kernel finishes then.
    let watcher = common::open_on_next_sync(&dev, open);
    drop(kept);
    alloc.empty_cache().unwrap();
    watcher.join().unwrap();
    dev.synchronize().unwrap();
    assert_eq!(dev.live_mappings(), vec![]);
    assert_eq!(dev.physical_bytes(), 0);
    dev.violations().iter().map(|v| v.op.clone()).collect()
}

#[test]
fn stitches_are_unmapped_only_after_the_streams_work() {
    assert_eq!(release_under_a_running_kernel(false), Vec::<String>::new());
    let found = release_under_a_running_kernel(true);
    assert!(found.iter().any(|op| op == "unmap of memory that unfinished work uses"), "{found:?}");
}

#[test]
fn a_map_refused_midway_through_a_stitch_falls_back_to_a_growth() {
    let (dev, alloc) = setup("fast_cache:false,expandable_stitching:true");
    let kept = holes(&dev, &alloc);
    dev.fail_nth_vm_map(Some(2));
    let s = alloc.alloc(24 * MIB, S0).unwrap();
    assert_eq!(s.ptr(), at(48 * MIB), "the growth over the free end");
    let v = dev.vm_counters();
    assert_eq!((v.maps, v.failed_maps, v.unmaps), (7 + 1 + 2, 1, 1));
    assert_eq!((v.reserves, v.frees), (2, 1), "the stitch's range was given back");
    assert_eq!(dev.virtual_bytes(), 2 * CAP);
    assert_eq!(alloc.expandable_ranges()[0].stitches, 0);
    assert_eq!(alloc.reserved_bytes(), 36 * P);
    alloc.check_invariants().unwrap();
    drop((s, kept));
    drop(alloc);
    assert_nothing_left(&dev);
}

/// A stitch that grew the range at its top for the pages its free chunks lacked, then had a
/// map of its own range refused, falls back to a growth placed again: over the pages it grew
/// (free at the top now), not over the place planned before it (found by `allocator_ops`
/// fuzzing: the growth mapped those pages a second time, and the device refused the request
/// with `CUDA_ERROR_INVALID_VALUE`; the broken build `cfg(tidepool_broken = "stale_place")`
/// does that again and fails here).
#[test]
fn a_map_refused_after_a_stitch_grew_the_range_falls_back_to_a_growth_over_the_new_pages() {
    let (dev, alloc) = setup("fast_cache:false,expandable_stitching:true");
    // 8, 16, 8, 16, 8 MiB back to back, the first two 8 MiB blocks freed: the free chunks at 0
    // and 24 MiB hold 8 of a 24 MiB request's 12 pages, and the stitch grows one chunk
    // (4 pages) at the top for the rest, where a growth would map all 12.
    let sizes = [8, 16, 8, 16, 8].map(|m| m * MIB);
    let mut kept: Vec<_> = sizes.iter().map(|&b| alloc.alloc(b, S0).unwrap()).collect();
    for i in [2, 0] {
        drop(kept.remove(i));
    }
    let v0 = dev.vm_counters();
    dev.fail_nth_vm_map(Some(2)); // the top chunk maps, the stitch's first alias does not
    let s = alloc.alloc(24 * MIB, S0).unwrap();
    assert_eq!(s.ptr(), at(56 * MIB), "the growth over the chunk the stitch grew");
    let v = dev.vm_counters();
    assert_eq!(v.maps - v0.maps, 1 + 2, "the stitch's top chunk, then the growth's 8 pages");
    assert_eq!((v.failed_maps - v0.failed_maps, v.unmaps - v0.unmaps), (1, 0));
    assert_eq!((v.reserves - v0.reserves, v.frees - v0.frees), (1, 1), "its range given back");
    assert_eq!(alloc.expandable_ranges()[0].stitches, 0);
    assert_eq!(alloc.reserved_bytes(), 40 * P);
    alloc.check_invariants().unwrap();
    drop((s, kept));
    drop(alloc);
    assert_nothing_left(&dev);
}

#[test]
fn without_stitching_the_request_grows_the_range() {
    let (dev, alloc) = setup("fast_cache:false");
    let sizes = [8, 16, 8, 16, 8].map(|m| m * MIB);
    let mut bufs: Vec<_> = sizes.iter().map(|&b| alloc.alloc(b, S0).unwrap()).collect();
    for i in [4, 2, 0] {
        drop(bufs.remove(i));
    }
    let s = alloc.alloc(24 * MIB, S0).unwrap();
    assert_eq!(s.ptr(), at(48 * MIB));
    assert_eq!(alloc.reserved_bytes(), 36 * P);
    assert_eq!(dev.vm_counters().reserves, 1);
}

#[test]
fn with_the_stream_caches_a_freed_stitch_comes_home_at_the_next_search() {
    let (dev, alloc) = setup("expandable_stitching:true");
    let kept = holes(&dev, &alloc);
    let s = alloc.alloc(24 * MIB, S0).unwrap();
    assert_eq!(s.ptr(), stitch_base());
    drop(s);
    // Wherever the freed block waits, the next large search sees the chunks home again.
    let d = alloc.alloc(8 * MIB, S0).unwrap();
    assert_eq!(d.ptr(), at(0));
    alloc.check_invariants().unwrap();
    drop((d, kept));
    drop(alloc);
    assert_nothing_left(&dev);
}

/// The segments and reserved-byte totals after [`holes`], a 24 MiB stitch freed, and the same
/// request again, with the stream caches on (`lock`: through `global_lock:true`, which has
/// none).
fn a_freed_stitch_and_its_reuse(lock: bool) -> Vec<(u64, u64, u64)> {
    let dev = Arc::new(SimDevice::backed(CAP));
    let config = Config::parse("expandable_stitching:true").unwrap();
    let config = config.with_expandable_segments(true).with_global_lock(lock);
    let alloc = Allocator::new(dev.clone(), config).unwrap();
    let kept = holes(&dev, &alloc);
    let figures = |alloc: &Allocator<SimDevice>| {
        let b = alloc.stats().blocks;
        (b.segment.all.current, b.reserved_bytes.all.allocated, b.reserved_bytes.all.freed)
    };
    let s = alloc.alloc(24 * MIB, S0).unwrap();
    assert_eq!(s.ptr(), stitch_base());
    let mut seen = vec![figures(&alloc)];
    drop(s);
    seen.push(figures(&alloc));
    let s = alloc.alloc(24 * MIB, S0).unwrap();
    assert_eq!(s.ptr(), stitch_base(), "the cached stitch serves again");
    assert_eq!(dev.vm_counters().creates, 7, "no device call");
    seen.push(figures(&alloc));
    alloc.check_invariants().unwrap();
    drop((s, kept));
    drop(alloc);
    assert_nothing_left(&dev);
    seen
}

/// A stitched block's free is its segment's (it leaves the pool, its chunks go home), so it
/// never waits in a stream cache: the statistics are at once `global_lock:true`'s, and a
/// reuse of the same stitch lends its chunks again as the pool's own does. (Broken build
/// `stitch_in_lane`: the freed block waited in its stream's first lane, its segment still
/// counted, and was handed out again from there with no lending counted.)
#[test]
fn a_freed_stitched_block_skips_the_stream_cache() {
    let (p, m) = (P, MIB);
    // Home runs cut around the three lent chunks: two runs and the stitch; freed, one run.
    // Each lending counts the stitch's 24 MiB as reserved and the chunks' as freed, and
    // each return the reverse (the physical bytes are counted once, 28 pages, throughout).
    let want = vec![
        (3, 28 * p + 24 * m, 24 * m),
        (1, 28 * p + 48 * m, 48 * m),
        (3, 28 * p + 72 * m, 72 * m),
    ];
    assert_eq!(a_freed_stitch_and_its_reuse(false), want);
    assert_eq!(a_freed_stitch_and_its_reuse(true), want);
}

#[test]
fn a_stitched_block_used_on_another_stream_lends_its_chunks_until_that_work_is_done() {
    let (dev, alloc) = setup("fast_cache:false,expandable_stitching:true");
    let kept = holes(&dev, &alloc);
    let s1 = dev.create_stream().unwrap();
    let s = alloc.alloc(24 * MIB, S0).unwrap();
    assert_eq!(s.ptr(), stitch_base());
    // A kernel on another stream writes the stitched block, held until the gate opens.
    let (k, open) = gated_write(s.ptr(), 24 * MIB);
    dev.launch(s1, k).unwrap();
    s.record_stream(s1).unwrap();
    drop(s);
    // Its free waits for that kernel: the chunks stay lent, a home request grows the range.
    let c = alloc.alloc(8 * MIB, S0).unwrap();
    assert_eq!(c.ptr(), at(56 * MIB));
    let r = &alloc.expandable_ranges()[0];
    assert_eq!((r.lent_bytes, r.stitches), (24 * MIB, 1));
    alloc.check_invariants().unwrap();
    open.send(()).unwrap();
    dev.synchronize().unwrap();
    // The work done, the next search sees the block free and its chunks home.
    let d = alloc.alloc(8 * MIB, S0).unwrap();
    assert_eq!(d.ptr(), at(0));
    assert_eq!(alloc.expandable_ranges()[0].lent_bytes, 0);
    alloc.check_invariants().unwrap();
    drop((c, d, kept));
    alloc.empty_cache().unwrap();
    assert_eq!(dev.live_mappings(), vec![]);
    drop(alloc);
    assert_nothing_left(&dev);
}

#[test]
fn two_allocators_on_one_device_stitch_apart() {
    let dev = Arc::new(SimDevice::backed(CAP));
    let config = Config::parse("fast_cache:false,expandable_stitching:true").unwrap();
    let config = config.with_expandable_segments(true);
    let a = Allocator::new(dev.clone(), config.clone()).unwrap();
    let b = Allocator::new(dev.clone(), config).unwrap();
    let ka = holes(&dev, &a);
    let kb: Vec<_> = [8, 16, 8, 16, 8].map(|m| b.alloc(m * MIB, S0).unwrap()).into_iter().collect();
    let kb: Vec<_> =
        kb.into_iter().enumerate().filter(|(i, _)| i % 2 == 1).map(|(_, x)| x).collect();
    let sa = a.alloc(24 * MIB, S0).unwrap();
    let sb = b.alloc(24 * MIB, S0).unwrap();
    assert_ne!(sa.ptr(), sb.ptr());
    assert_eq!(a.reserved_bytes(), 28 * P);
    assert_eq!(b.reserved_bytes(), 28 * P);
    assert_eq!(dev.physical_bytes(), 56 * P);
    a.check_invariants().unwrap();
    b.check_invariants().unwrap();
    assert_eq!(dev.violations(), vec![]);
    drop((sa, sb, ka, kb));
    drop((a, b));
    assert_nothing_left(&dev);
}

/// A 22.5 MiB request stitched (12 pages: the three free chunks of [`holes`]) and a 1.5 MiB
/// one after it: the stitched block and the small one, and the physical bytes the cache is
/// left with once the stitched block is freed and `release` ran.
fn small_request_after_a_stitch(release: impl FnOnce(Allocator<SimDevice>)) -> Vec<u64> {
    let (dev, alloc) = setup("fast_cache:false,expandable_stitching:true");
    let kept = holes(&dev, &alloc);
    let s = alloc.alloc(45 * MIB / 2, S0).unwrap();
    let t = alloc.alloc(3 * MIB / 2, S0).unwrap();
    let figures = vec![s.ptr().0, s.block_size(), t.ptr().0];
    alloc.check_invariants().unwrap();
    drop(s);
    release(alloc);
    let left = dev.physical_bytes();
    drop((t, kept));
    assert_nothing_left(&dev);
    figures.into_iter().chain([left]).collect()
}

/// The tail a split leaves in a stitched block's segment served the small request, which then
/// kept the segment busy, so its chunks stayed lent and mapped after the stitched block went:
/// `empty_cache` could not return 24 MiB that held nothing. Taken whole, the block leaves no
/// tail (the broken build `cfg(tidepool_broken = "stitch_split")` splits it).
#[test]
fn a_stitched_block_is_taken_whole_so_no_small_block_pins_its_chunks() {
    let got = small_request_after_a_stitch(|alloc| {
        alloc.empty_cache().unwrap();
        assert_eq!(alloc.expandable_ranges()[0].stitches, 0, "the stitch is unmapped");
        alloc.check_invariants().unwrap();
    });
    // The small block grows the range at its top by a page; the cache keeps the two 16 MiB
    // blocks' chunks and that page.
    assert_eq!(got, [stitch_base().0, 24 * MIB, at(56 * MIB).0, 34 * MIB]);
}

/// The same with the allocator's last handle dropped instead of `empty_cache`: a closed
/// allocator returns the stitched block's chunks as it goes.
#[test]
fn a_closed_allocator_returns_a_freed_stitch_while_a_small_block_lives() {
    let got = small_request_after_a_stitch(drop);
    assert_eq!(got, [stitch_base().0, 24 * MIB, at(56 * MIB).0, 34 * MIB]);
}

/// An aligned request is never stitched: a stitch's own range need not start at the alignment,
/// and the padding split off its front would be a free block in the stitch's segment, which a
/// small request then takes, pinning every chunk the stitch borrowed (as a split tail did).
/// The broken build `cfg(tidepool_broken = "stitch_aligned")` stitches it.
#[test]
fn an_aligned_request_is_not_stitched() {
    let (dev, alloc) = setup("fast_cache:false,expandable_stitching:true");
    let kept = holes(&dev, &alloc);
    let s = alloc.alloc(24 * MIB, S0).unwrap();
    assert_eq!(s.ptr(), stitch_base());
    // The same holes again above: three more free 8 MiB chunks, at 56, 80 and 104 MiB.
    let more = holes_above(&alloc, 56);
    // 10 MiB at 16 MiB alignment (no free chunk holds it): a stitch of 13 pages would start
    // 24 MiB past the first one's, 8 MiB short of the alignment.
    let a = alloc.alloc_aligned(10 * MIB, 16 * MIB, S0).unwrap();
    assert_eq!(a.ptr().0 % (16 * MIB), 0);
    assert_eq!(alloc.expandable_ranges()[0].stitches, 1, "no second stitch");
    let small = alloc.alloc(8 * MIB, S0).unwrap();
    drop(a);
    drop(s);
    alloc.empty_cache().unwrap();
    alloc.check_invariants().unwrap();
    assert_eq!(alloc.expandable_ranges()[0].stitches, 0);
    // What is left mapped: the four 16 MiB blocks and the small one's pages.
    let held: u64 = kept.iter().chain(&more).chain([&small]).map(|b| b.block_size()).sum();
    assert_eq!(dev.physical_bytes(), held);
    drop((kept, more, small));
    drop(alloc);
    assert_nothing_left(&dev);
}

/// [`holes`] at `at_mib` MiB (the range's top): returns the two 16 MiB blocks.
fn holes_above(alloc: &Allocator<SimDevice>, at_mib: u64) -> Vec<Buffer<SimDevice>> {
    let sizes = [8, 16, 8, 16, 8].map(|m| m * MIB);
    let mut bufs: Vec<_> = sizes.iter().map(|&b| alloc.alloc(b, S0).unwrap()).collect();
    let ptrs: Vec<_> = bufs.iter().map(|b| b.ptr()).collect();
    assert_eq!(ptrs, [0, 8, 24, 32, 48].map(|m| at((at_mib + m) * MIB)));
    for i in [4, 2, 0] {
        drop(bufs.remove(i));
    }
    bufs
}

/// A live stitched block outlives the configuration that made it: turned to `config` (no
/// expandable segments), its free still sends the chunks home and leaves the stitch cached;
/// every view agrees with the device at each step; `empty_cache` lets go of all of it; and
/// turned on again, stitching serves the same request anew. (With the stream caches on, the
/// freed block waits in one until a view flushes it: broken build `view_unsettled` lists the
/// stitch's segment that the view's own lock section takes away.)
fn a_stitch_outlives_its_configuration(config: &str) {
    let (dev, alloc) = setup("fast_cache:false,expandable_stitching:true");
    let kept = holes(&dev, &alloc);
    let s = alloc.alloc(24 * MIB, S0).unwrap();
    assert_eq!(s.ptr(), stitch_base());
    alloc.set_config(Config::parse(config).unwrap()).unwrap();
    // An ordinary request: a segment of its own, not the range.
    let o = alloc.alloc(4 * MIB, S0).unwrap();
    let seg = alloc.snapshot().iter().find(|g| g.address == o.ptr()).map(|g| g.size).unwrap();
    assert_eq!(o.ptr().0, stitch_base().0 + 24 * MIB, "the device's next addresses");
    assert_eq!(dev.live_segments(), vec![(o.ptr(), seg)]);
    let next = o.ptr().0 + seg;
    drop(s);
    // Every view settles first: the stitch's segment is gone from the pool, its chunks are home.
    let snap = alloc.snapshot();
    assert!(snap.iter().all(|g| g.address != stitch_base()), "{snap:?}");
    let r = &alloc.expandable_ranges()[0];
    assert_eq!((r.lent_bytes, r.stitches, r.free_bytes), (0, 1, 24 * MIB));
    assert_eq!(
        alloc.reserved_bytes(),
        28 * P + dev.live_segments().iter().map(|s| s.1).sum::<u64>()
    );
    alloc.check_invariants().unwrap();
    drop((o, kept));
    alloc.empty_cache().unwrap();
    assert_eq!(dev.live_mappings(), vec![]);
    assert_eq!(dev.live_segments(), vec![]);
    assert_eq!((dev.physical_bytes(), alloc.reserved_bytes()), (0, 0));
    assert_eq!(alloc.expandable_ranges()[0].stitches, 0, "the stitch went with its chunks");
    assert_eq!(alloc.snapshot(), vec![]);
    alloc.check_invariants().unwrap();
    // On again: the range grows anew and stitches over its holes again.
    let on = Config::parse("fast_cache:false,expandable_stitching:true").unwrap();
    alloc.set_config(on.with_expandable_segments(true)).unwrap();
    let kept = holes_above(&alloc, 0);
    let s = alloc.alloc(24 * MIB, S0).unwrap();
    assert_eq!(alloc.expandable_ranges()[0].stitches, 1);
    assert_eq!(s.block_size(), 24 * MIB);
    // A range of its own again, at the device's next addresses (the segment's came before).
    assert_eq!(s.ptr().0, next);
    alloc.check_invariants().unwrap();
    drop((s, kept));
    drop(alloc);
    assert_nothing_left(&dev);
}

#[test]
fn a_stitch_outlives_expandable_segments_turned_off() {
    a_stitch_outlives_its_configuration("fast_cache:false");
}

#[test]
fn a_stitch_freed_into_a_stream_cache_outlives_expandable_segments_turned_off() {
    a_stitch_outlives_its_configuration("");
}

#[test]
fn a_stitch_outlives_caching_turned_off() {
    a_stitch_outlives_its_configuration("caching:false");
}

/// Each segment of the snapshot pickle as (address, total_size, is_expandable).
fn dumped_segments(alloc: &Allocator<SimDevice>) -> Vec<(u64, u64, bool)> {
    use common::pickle::{get, list, read, uint};
    list(get(&read(&alloc.snapshot_pickle()), "segments"))
        .iter()
        .map(|s| {
            let serde_pickle::Value::Bool(e) = get(s, "is_expandable") else { panic!("{s:?}") };
            (uint(get(s, "address")), uint(get(s, "total_size")), e)
        })
        .collect()
}

/// PyTorch's snapshot marks every segment its expandable segments map `is_expandable`; a live
/// stitched block's segment is mapped the same way (`cuMemMap` onto the home range's physical
/// chunks, in a virtual range of its own) and is marked so too, beside the home range's runs.
#[test]
fn a_stitched_segment_is_expandable_in_the_snapshot() {
    let (dev, alloc) = setup("fast_cache:false,expandable_stitching:true");
    let kept = holes(&dev, &alloc);
    let s = alloc.alloc(24 * MIB, S0).unwrap();
    assert_eq!(s.ptr(), stitch_base());
    let segs = dumped_segments(&alloc);
    assert_eq!(
        segs,
        vec![
            (at(8 * MIB).0, 16 * MIB, true),
            (at(32 * MIB).0, 16 * MIB, true),
            (stitch_base().0, 24 * MIB, true),
        ]
    );
    drop((s, kept));
    alloc.empty_cache().unwrap();
    drop(alloc);
    assert_nothing_left(&dev);
}

/// `empty_cache` over a cached stitch whose unmapping the device refuses: the stitch stays
/// (dead, tried again at the next release), so the home chunks it still maps stay mapped and
/// in the home range too. Releasing them anyway (broken build `stitch_refused_released`) left
/// the stitch mapping physical allocations its range no longer had (`check_invariants`: the
/// chunk "drifted"), counted released while the device still held them. The refusal is
/// `empty_cache`'s answer, as a refused unmapping of the home range's own pages is (it
/// answered `Ok`: broken build `stitch_refusal_unreported`).
#[test]
fn a_refused_stitch_unmapping_keeps_its_home_chunks() {
    let (dev, alloc) = setup("fast_cache:false,expandable_stitching:true");
    let kept = holes(&dev, &alloc);
    let s = alloc.alloc(24 * MIB, S0).unwrap();
    assert_eq!(s.ptr(), stitch_base());
    drop(s); // the stitch is cached, its chunks (0, 24 and 48 MiB) back home, free
    // The stitch's first unmapping (its top chunk) is refused: it stays whole, and so do the
    // three chunks it maps at home, the only free ones.
    dev.fail_nth_vm_unmap(Some(1));
    let refused = alloc.empty_cache();
    assert!(matches!(refused, Err(AllocError::Device(_))), "{refused:?}");
    alloc.check_invariants().unwrap();
    assert_eq!(dev.live_mappings().len(), 7 + 3);
    assert_eq!((alloc.reserved_bytes(), dev.physical_bytes()), (28 * P, 28 * P));
    let r = &alloc.expandable_ranges()[0];
    assert_eq!((r.stitches, r.free_bytes, r.mapped_bytes), (1, 24 * MIB, 28 * P));
    assert_eq!(alloc.stats().num_physical_release, 0);
    // Tried again at the next release, with the rest.
    drop(kept);
    alloc.empty_cache().unwrap();
    alloc.check_invariants().unwrap();
    assert_eq!(dev.live_mappings(), vec![]);
    assert_eq!(dev.physical_bytes(), 0);
    drop(alloc);
    assert_nothing_left(&dev);
}
