//! Expandable segments (`expandable_segments:true`) the way applications stress them, on
//! SimDevice with its sanitizer: several streams growing and freeing under running kernels,
//! buffers used on other streams (`record_stream`), `mem::forget`, two allocators on one
//! nearly full device, `set_config` turning the ranges off and on, a forked CUDA-graph capture,
//! aligned requests, sizes around page multiples, and device refusals (maps, creates, unmaps,
//! events) at every step of workloads with page moves, releases and stitches: after each step
//! the invariants hold, the sanitizer sees nothing, and the history's `segment_map` /
//! `segment_unmap` entries give the snapshot's segments (as PyTorch's trace and snapshot agree).

mod common;

use common::{assert_no_leak, gated_write_bytes as gated_write};
use std::sync::Arc;
use std::sync::mpsc;
use tidepool::MIB;
use tidepool::device::{Access, AccessKind, Kernel, Launch, SimDevice};
use tidepool::{Allocator, Config, Device, DeviceAddr, StreamId};

const P: u64 = 2 * MIB;
const CAP: u64 = 64 * MIB;

use common::expandable_setup as setup;

/// Opens every gate handed to it whenever the device counts a new host sync.
struct Opener {
    gates: Arc<std::sync::Mutex<Vec<mpsc::Sender<()>>>>,
    stop: Arc<std::sync::atomic::AtomicBool>,
    h: Option<std::thread::JoinHandle<()>>,
}

impl Opener {
    fn new(dev: &Arc<SimDevice>) -> Opener {
        let gates: Arc<std::sync::Mutex<Vec<mpsc::Sender<()>>>> = Default::default();
        let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
        let (d, g, st) = (dev.clone(), gates.clone(), stop.clone());
        let mut seen = d.counters().host_syncs;
        let h = std::thread::spawn(move || {
            while !st.load(std::sync::atomic::Ordering::Relaxed) {
                let now = d.counters().host_syncs;
                if now != seen {
                    seen = now;
                    for x in g.lock().unwrap().drain(..) {
                        let _ = x.send(());
                    }
                }
                std::thread::yield_now();
            }
            for x in g.lock().unwrap().drain(..) {
                let _ = x.send(());
            }
        });
        Opener { gates, stop, h: Some(h) }
    }
    fn add(&self, g: mpsc::Sender<()>) {
        self.gates.lock().unwrap().push(g);
    }
    fn finish(mut self) {
        self.stop.store(true, std::sync::atomic::Ordering::Relaxed);
        self.h.take().unwrap().join().unwrap();
    }
}

/// A refusal armed on the device.
type Fault = Box<dyn Fn(&SimDevice)>;

/// The device's `n`th map, create, unmap or event creation refused.
fn refusals(n: u64) -> [(&'static str, Fault); 4] {
    [
        ("map", Box::new(move |d: &SimDevice| d.fail_nth_vm_map(Some(n)))),
        ("create", Box::new(move |d: &SimDevice| d.fail_nth_vm_create(Some(n)))),
        ("unmap", Box::new(move |d: &SimDevice| d.fail_nth_vm_unmap(Some(n)))),
        ("event", Box::new(move |d: &SimDevice| d.fail_nth_event_create(Some(n)))),
    ]
}

fn write(ptr: DeviceAddr, bytes: u64, byte: u8) -> Kernel {
    Kernel::new("w", vec![Access { ptr, bytes, kind: AccessKind::Write }], move |m| {
        m.write(ptr, &vec![byte; bytes as usize]).unwrap();
    })
}

/// PyTorch's `record_stream` then `empty_cache` (`test_record_stream`'s pattern, over
/// expandable segments): a buffer of stream 1 used on stream 2 and freed is unmapped only once
/// stream 2's work is done (the sanitizer sees no unmap under it); then nothing is mapped.
/// Every fault the workloads arm, cleared.
fn clear_faults(dev: &SimDevice) {
    dev.fail_nth_vm_map(None);
    dev.fail_nth_vm_create(None);
    dev.fail_nth_vm_unmap(None);
    dev.fail_nth_event_create(None);
    dev.fail_event_records(false);
    dev.fail_event_waits(false);
    dev.fail_event_queries(false);
}

/// Drops `alloc`; then the device saw no violation nor failed kernel, and holds no mapping,
/// physical memory or virtual range.
fn gone_cleanly(dev: &SimDevice, alloc: Allocator<SimDevice>) -> Result<(), String> {
    drop(alloc);
    if !dev.violations().is_empty() || !dev.kernel_failures().is_empty() {
        return Err(format!("{:?} {:?}", dev.violations(), dev.kernel_failures()));
    }
    if dev.live_mappings() != vec![] || dev.live_physical() != 0 || dev.virtual_bytes() != 0 {
        return Err(format!(
            "leak: maps {:?} phys {} virt {}",
            dev.live_mappings(),
            dev.live_physical(),
            dev.virtual_bytes()
        ));
    }
    Ok(())
}

#[test]
fn a_buffer_used_on_another_stream_is_unmapped_after_that_streams_work() {
    let (dev, alloc) = setup("", CAP);
    let (s1, s2) = (dev.create_stream().unwrap(), dev.create_stream().unwrap());
    let a = alloc.alloc(8 * MIB, s1).unwrap();
    let (k, open) = gated_write(a.ptr(), 8 * MIB, 1);
    dev.launch(s2, k).unwrap();
    a.record_stream(s2).unwrap();
    drop(a);
    // s2 still runs on it: empty_cache must not unmap (it syncs events first, so open the gate
    // on a thread once a sync starts).
    let h = common::open_on_next_sync(&dev, open);
    alloc.empty_cache().unwrap();
    h.join().unwrap();
    assert_eq!(dev.violations(), vec![]);
    assert_eq!(alloc.reserved_bytes(), 0);
    alloc.check_invariants().unwrap();
    drop(alloc);
    assert_no_leak(&dev);
}

/// The same buffer's pages wanted by the stream it was used on (a page move, strict and
/// wait_event, or the ladder): handed over only after that stream's work on them.
#[test]
fn a_buffer_used_on_another_stream_moves_to_it_after_its_work() {
    for cfg in ["", "cross_stream:wait_event"] {
        let (dev, alloc) = setup(cfg, 16 * MIB);
        let (s1, s2) = (dev.create_stream().unwrap(), dev.create_stream().unwrap());
        let a = alloc.alloc(16 * MIB, s1).unwrap();
        let (k, open) = gated_write(a.ptr(), 16 * MIB, 1);
        dev.launch(s2, k).unwrap();
        a.record_stream(s2).unwrap();
        drop(a);
        let h = common::open_on_next_sync(&dev, open);
        let b = alloc.alloc(8 * MIB, s2).unwrap();
        dev.launch(s2, write(b.ptr(), 8 * MIB, 2)).unwrap();
        dev.synchronize().unwrap();
        h.join().unwrap();
        assert_eq!(dev.violations(), vec![], "{cfg}");
        assert_eq!(dev.kernel_failures(), vec![], "{cfg}");
        drop(b);
        alloc.check_invariants().unwrap();
        drop(alloc);
        assert_no_leak(&dev);
    }
}

/// Three streams growing and freeing blocks of sizes around page multiples while gated
/// kernels still write them (some read on the next stream, `record_stream`), `empty_cache`
/// among them, in six configurations and two capacities: no unmap or reuse under unfinished
/// work, invariants after each round, nothing left.
#[test]
fn three_streams_grow_and_free_under_running_kernels() {
    let only = std::env::var("ONLY_CFG").ok();
    for cfg in [
        "",
        "cross_stream:wait_event",
        "expandable_stitching:true",
        "release_threshold_mb:0",
        "expandable_stitching:true,cross_stream:wait_event",
        "release_threshold_mb:6,cross_stream:wait_event",
    ] {
        if only.as_deref().is_some_and(|o| o != cfg) {
            continue;
        }
        for cap in [40 * MIB, 128 * MIB] {
            let (dev, alloc) = setup(cfg, cap);
            let opener = Opener::new(&dev);
            let streams: Vec<StreamId> = (0..3).map(|_| dev.create_stream().unwrap()).collect();
            let mut live = Vec::new();
            let mut ooms = 0;
            for round in 0..12u64 {
                for (i, &s) in streams.iter().enumerate() {
                    let sz = (1 + (round * 7 + i as u64 * 3) % 11) * 3 * MIB / 2 + 17;
                    match alloc.alloc(sz, s) {
                        Ok(b) => {
                            let (k, open) = gated_write(b.ptr(), sz, i as u8);
                            dev.launch(s, k).unwrap();
                            opener.add(open);
                            if round % 3 == 1 {
                                let other = streams[(i + 1) % 3];
                                let ev = dev.create_event().unwrap();
                                dev.record_event(ev, s).unwrap();
                                dev.wait_event(other, ev).unwrap();
                                dev.launch(
                                    other,
                                    Kernel::new(
                                        "r",
                                        vec![Access {
                                            ptr: b.ptr(),
                                            bytes: sz,
                                            kind: AccessKind::Read,
                                        }],
                                        |_| {},
                                    ),
                                )
                                .unwrap();
                                b.record_stream(other).unwrap();
                            }
                            live.push(b);
                        }
                        Err(_) => ooms += 1,
                    }
                }
                let mut keep = Vec::new();
                for (j, b) in live.drain(..).enumerate() {
                    if (j + round as usize).is_multiple_of(3) { keep.push(b) } else { drop(b) }
                }
                live = keep;
                if round % 4 == 3 {
                    alloc.empty_cache().unwrap();
                }
                alloc.check_invariants().unwrap();
                assert_eq!(dev.violations(), vec![], "{cfg} round {round}");
            }
            alloc.empty_cache().unwrap();
            opener.finish();
            dev.synchronize().unwrap();
            assert_eq!(dev.violations(), vec![], "{cfg}");
            assert_eq!(dev.kernel_failures(), vec![], "{cfg}");
            drop(live);
            alloc.empty_cache().unwrap();
            alloc.check_invariants().unwrap();
            assert_eq!(alloc.reserved_bytes(), 0, "{cfg}");
            assert!(cap < 128 * MIB || ooms == 0, "{cfg}: {ooms} out of memory with room");
            drop(alloc);
            assert_no_leak(&dev);
        }
    }
}

/// A buffer `mem::forget`-ten keeps its pages mapped; the rest goes.
#[test]
fn a_forgotten_buffer_keeps_only_its_pages() {
    let (dev, alloc) = setup("", CAP);
    let a = alloc.alloc(5 * MIB, StreamId::DEFAULT).unwrap();
    let b = alloc.alloc(7 * MIB, StreamId::DEFAULT).unwrap();
    std::mem::forget(a);
    drop(b);
    alloc.empty_cache().unwrap();
    alloc.check_invariants().unwrap();
    assert_eq!(alloc.reserved_bytes(), 3 * P);
    drop(alloc);
    assert_eq!(dev.violations(), vec![]);
}

/// Two allocators of one device, expandable segments on both, the device nearly full: the
/// second is served by what the first cached.
#[test]
fn two_allocators_near_capacity_share_the_device() {
    let dev = Arc::new(SimDevice::backed(32 * MIB));
    let c = Config::parse("").unwrap().with_expandable_segments(true);
    let a1 = Allocator::new(dev.clone(), c.clone()).unwrap();
    let a2 = Allocator::new(dev.clone(), c).unwrap();
    let x = a1.alloc(20 * MIB, StreamId::DEFAULT).unwrap();
    drop(x);
    // a2 needs 20 MiB: a1 caches 20 MiB of pages; the device has 12 MiB free.
    let y = a2.alloc(20 * MIB, StreamId::DEFAULT);
    assert!(y.is_ok(), "the peer's cached pages serve: {:?}", y.as_ref().err());
    assert!(dev.physical_bytes() <= 32 * MIB);
    a1.check_invariants().unwrap();
    a2.check_invariants().unwrap();
    drop(y);
    drop((a1, a2));
    assert_no_leak(&dev);
}

/// `set_config` turning expandable segments off and on again with live buffers in ranges and
/// in ordinary segments: every block freed where it lives, invariants throughout, nothing left.
#[test]
fn expandable_segments_turned_off_and_on_with_live_buffers() {
    let (dev, alloc) = setup("", CAP);
    let a = alloc.alloc(5 * MIB, StreamId::DEFAULT).unwrap();
    let small = alloc.alloc(1000, StreamId::DEFAULT).unwrap();
    alloc.set_config(Config::parse("").unwrap()).unwrap();
    let b = alloc.alloc(5 * MIB, StreamId::DEFAULT).unwrap();
    let small2 = alloc.alloc(1000, StreamId::DEFAULT).unwrap();
    alloc.check_invariants().unwrap();
    drop(a);
    drop(small);
    alloc.check_invariants().unwrap();
    alloc.empty_cache().unwrap();
    alloc.check_invariants().unwrap();
    alloc.set_config(Config::parse("").unwrap().with_expandable_segments(true)).unwrap();
    let c = alloc.alloc(5 * MIB, StreamId::DEFAULT).unwrap();
    drop(b);
    drop(small2);
    alloc.check_invariants().unwrap();
    alloc.empty_cache().unwrap();
    alloc.check_invariants().unwrap();
    drop(c);
    alloc.empty_cache().unwrap();
    assert_eq!(alloc.reserved_bytes(), 0);
    alloc.check_invariants().unwrap();
    drop(alloc);
    assert_no_leak(&dev);
}

/// Sizes one byte below, at and above page multiples: each block is mapped whole (a kernel
/// writes all of it), and `empty_cache` leaves nothing mapped.
#[test]
fn sizes_around_page_multiples() {
    let (dev, alloc) = setup("", CAP);
    for sz in [P - 1, P, P + 1, 2 * P - 1, 2 * P, 2 * P + 1, MIB, MIB + 1, 10 * MIB + 1] {
        let b = alloc.alloc(sz, StreamId::DEFAULT).unwrap();
        alloc.check_invariants().unwrap();
        dev.launch(StreamId::DEFAULT, write(b.ptr(), sz, 3)).unwrap();
        drop(b);
    }
    dev.synchronize().unwrap();
    assert_eq!(dev.kernel_failures(), vec![]);
    alloc.empty_cache().unwrap();
    assert_eq!(alloc.reserved_bytes(), 0);
    drop(alloc);
    assert_no_leak(&dev);
}

/// Aligned requests (`alloc_aligned`), above and below a page: aligned, mapped whole.
#[test]
fn aligned_requests_over_ranges() {
    let (dev, alloc) = setup("", CAP);
    let mut live = Vec::new();
    for (sz, al) in
        [(3 * MIB, 4 * MIB), (MIB + 1, 2 * MIB), (5 * MIB, 8 * MIB), (100, 512), (3000, 4096)]
    {
        let b = alloc.alloc_aligned(sz, al, StreamId::DEFAULT).unwrap();
        assert_eq!(b.ptr().0 % al, 0, "{sz} {al}");
        alloc.check_invariants().unwrap();
        dev.launch(StreamId::DEFAULT, write(b.ptr(), sz, 3)).unwrap();
        live.push(b);
    }
    dev.synchronize().unwrap();
    assert_eq!(dev.kernel_failures(), vec![]);
    drop(live);
    alloc.empty_cache().unwrap();
    alloc.check_invariants().unwrap();
    assert_eq!(alloc.reserved_bytes(), 0);
    drop(alloc);
    assert_no_leak(&dev);
}

/// A CUDA-graph capture forked to a second stream, with expandable segments: its pool grows
/// on both streams, a block allocated before the capture is freed during it, a stream outside
/// the capture grows and frees, `empty_cache` is called during it: no call the capture forbids
/// reaches the device, the graph replays cleanly, and everything goes afterwards.
#[test]
fn a_forked_capture_over_ranges_stays_valid() {
    use common::{replayable_write as rw, wait_stream};
    for cfg in [
        "",
        "cross_stream:wait_event",
        "release_threshold_mb:0",
        "expandable_stitching:true",
        "cross_stream:wait_event,release_threshold_mb:0",
    ] {
        let (dev, alloc) = setup(cfg, 128 * MIB);
        let (s, t, u) = (
            dev.create_stream().unwrap(),
            dev.create_stream().unwrap(),
            dev.create_stream().unwrap(),
        );
        drop(alloc.alloc(8 * MIB, s).unwrap());
        drop(alloc.alloc(8 * MIB, u).unwrap());
        drop(alloc.alloc(18 * MIB, t).unwrap());
        let pre = alloc.alloc(6 * MIB, s).unwrap();
        dev.launch(s, write(pre.ptr(), 6 * MIB, 1)).unwrap();
        alloc.begin_capture(s, None).unwrap();
        wait_stream(&dev, t, s);
        let a = alloc.alloc(10 * MIB, s).unwrap();
        dev.launch(s, rw(&a, 2)).unwrap();
        let b = alloc.alloc(12 * MIB, t).unwrap();
        dev.launch(t, rw(&b, 3)).unwrap();
        drop(b);
        let c = alloc.alloc(12 * MIB, s).unwrap();
        dev.launch(s, rw(&c, 4)).unwrap();
        drop(pre);
        let x = alloc.alloc(20 * MIB, u).unwrap();
        dev.launch(u, write(x.ptr(), 20 * MIB, 5)).unwrap();
        drop(x);
        let y = alloc.alloc(30 * MIB, u).unwrap();
        drop(y);
        let _ = alloc.empty_cache();
        alloc.check_invariants().unwrap();
        wait_stream(&dev, s, t);
        let g = alloc.end_capture(s).unwrap_or_else(|e| panic!("{cfg}: {e}"));
        assert_eq!(dev.graph_counters().refused_in_capture, 0, "{cfg}");
        g.launch(s).unwrap();
        g.launch(s).unwrap();
        dev.synchronize().unwrap();
        assert_eq!(dev.violations(), vec![], "{cfg}");
        assert_eq!(dev.kernel_failures(), vec![], "{cfg}");
        drop((a, c));
        drop(g);
        alloc.synchronize().unwrap();
        alloc.empty_cache().unwrap();
        alloc.check_invariants().unwrap();
        assert_eq!(alloc.reserved_bytes(), 0, "{cfg}");
        drop(alloc);
        assert_no_leak(&dev);
    }
}

/// The history's segment_map/unmap/alloc/free entries, replayed page by page, give the
/// snapshot's segments.
fn trace_matches(alloc: &Allocator<SimDevice>) -> Result<(), String> {
    use std::collections::BTreeSet;
    use tidepool::Action;
    let mut pages = BTreeSet::new();
    for e in alloc.history() {
        let (add, kind) = match e.action {
            Action::SegmentMap | Action::SegmentAlloc => (true, e.action),
            Action::SegmentUnmap | Action::SegmentFree => (false, e.action),
            _ => continue,
        };
        if e.size % P != 0 {
            return Err(format!("{kind:?} of {} bytes", e.size));
        }
        for p in (e.addr.0..e.addr.0 + e.size).step_by(P as usize) {
            let ok = if add { pages.insert(p) } else { pages.remove(&p) };
            if !ok {
                return Err(format!(
                    "{kind:?} at {:#x}+{}: page {p:#x} {}",
                    e.addr.0,
                    e.size,
                    if add { "already in" } else { "not in" }
                ));
            }
        }
    }
    let mut snap = BTreeSet::new();
    for s in alloc.snapshot() {
        for p in (s.address.0..s.address.0 + s.size).step_by(P as usize) {
            snap.insert(p);
        }
    }
    if snap != pages {
        let a: Vec<_> = snap.difference(&pages).map(|p| format!("{p:#x}")).collect();
        let b: Vec<_> = pages.difference(&snap).map(|p| format!("{p:#x}")).collect();
        return Err(format!("in the snapshot only: {a:?}; in the trace only: {b:?}"));
    }
    Ok(())
}

/// Three streams allocating and freeing under gated kernels (page moves, releases, the
/// ladder), with `fault` armed on the device from the start: after every step the invariants
/// hold, the history's map/unmap entries give the snapshot, the sanitizer sees nothing; once the
/// fault is cleared `empty_cache` returns everything, counted as the device counted it.
fn faulty_workload(cfg: &str, fault: &dyn Fn(&SimDevice)) -> Result<(), String> {
    let (dev, alloc) = setup(cfg, 48 * MIB);
    let opener = Opener::new(&dev);
    let streams: Vec<StreamId> = (0..3).map(|_| dev.create_stream().unwrap()).collect();
    let mut live: Vec<tidepool::Buffer<SimDevice>> = Vec::new();
    alloc.record_history(tidepool::HistoryOptions::new(1 << 20));
    fault(&dev);
    for round in 0..10u64 {
        for (i, &s) in streams.iter().enumerate() {
            let sz = (1 + (round * 5 + i as u64 * 3) % 13) * 2 * MIB - 5;
            if let Ok(b) = alloc.alloc(sz, s) {
                let (k, open) = gated_write(b.ptr(), sz, i as u8);
                dev.launch(s, k).unwrap();
                opener.add(open);
                live.push(b);
            }
            alloc.check_invariants().map_err(|e| format!("round {round} alloc: {e}"))?;
        }
        let mut keep = Vec::new();
        for (j, b) in live.drain(..).enumerate() {
            if (j + round as usize).is_multiple_of(3) { keep.push(b) } else { drop(b) }
        }
        live = keep;
        alloc.check_invariants().map_err(|e| format!("round {round} free: {e}"))?;
        if round % 3 == 2 {
            let _ = alloc.empty_cache();
            alloc.check_invariants().map_err(|e| format!("round {round} empty: {e}"))?;
        }
        let v = dev.violations();
        if !v.is_empty() {
            return Err(format!("round {round}: {v:?}"));
        }
        trace_matches(&alloc).map_err(|e| format!("round {round} trace: {e}"))?;
    }
    clear_faults(&dev);
    drop(live);
    alloc.empty_cache().map_err(|e| format!("final empty: {e}"))?;
    alloc.check_invariants()?;
    opener.finish();
    dev.synchronize().unwrap();
    if alloc.reserved_bytes() != 0 {
        return Err(format!("reserved {} after empty_cache", alloc.reserved_bytes()));
    }
    // The allocator's counts are the device's.
    let s = alloc.stats();
    let d = dev.vm_counters();
    let ours =
        (s.num_device_map, s.num_device_unmap, s.num_physical_create, s.num_physical_release);
    if ours != (d.maps, d.unmaps, d.creates, d.releases) {
        return Err(format!("counted {ours:?}, the device {d:?}"));
    }
    gone_cleanly(&dev, alloc)
}

#[test]
fn device_refusals_on_three_busy_streams_leave_every_view_consistent() {
    let only = std::env::var("ONLY_CFG").ok();
    let mut failures = Vec::new();
    for cfg in [
        "",
        "cross_stream:wait_event",
        "expandable_stitching:true",
        "expandable_stitching:true,cross_stream:wait_event",
        "release_threshold_mb:4",
    ] {
        if only.as_deref().is_some_and(|o| o != cfg) {
            continue;
        }
        let top: u64 = std::env::var("TOP_N").ok().and_then(|v| v.parse().ok()).unwrap_or(8);
        for n in 1..top {
            let kinds = refusals(n);
            for (name, f) in kinds.iter() {
                if let Err(e) = faulty_workload(cfg, &**f) {
                    failures.push(format!("{cfg} {name} {n}: {e}"));
                }
            }
        }
    }
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}

/// [`faulty_workload`] around stitches: holes, a stitched block, its reuse, another stream's
/// growth, `empty_cache` (a refused stitch unmapping: `stitching.rs`).
fn stitch_workload(cfg: &str, fault: &dyn Fn(&SimDevice)) -> Result<(), String> {
    let (dev, alloc) = setup(cfg, 64 * MIB);
    let opener = Opener::new(&dev);
    alloc.record_history(tidepool::HistoryOptions::new(1 << 20));
    let s0 = StreamId::DEFAULT;
    let s1 = dev.create_stream().unwrap();
    fault(&dev);
    let chk = |alloc: &Allocator<SimDevice>, what: &str| -> Result<(), String> {
        alloc.check_invariants().map_err(|e| format!("{what}: {e}"))?;
        trace_matches(alloc).map_err(|e| format!("{what} trace: {e}"))?;
        let v = dev.violations();
        if !v.is_empty() {
            return Err(format!("{what}: {v:?}"));
        }
        Ok(())
    };
    for round in 0..3 {
        let sizes = [8, 16, 8, 16, 8];
        let mut bufs: Vec<_> = sizes.iter().map(|&m| alloc.alloc(m * MIB, s0).ok()).collect();
        chk(&alloc, "holes")?;
        for i in [0, 2, 4] {
            if let Some(b) = bufs[i].take() {
                let (k, open) = gated_write(b.ptr(), b.len(), 1);
                dev.launch(s0, k).unwrap();
                opener.add(open);
                drop(b);
            }
        }
        chk(&alloc, "freed")?;
        let st = alloc.alloc(24 * MIB, s0).ok();
        chk(&alloc, "stitch")?;
        if let Some(b) = &st {
            let (k, open) = gated_write(b.ptr(), b.len(), 2);
            dev.launch(s0, k).unwrap();
            opener.add(open);
        }
        drop(st);
        chk(&alloc, "stitch freed")?;
        let again = alloc.alloc(24 * MIB, s0).ok();
        chk(&alloc, "again")?;
        // Another stream wants the memory.
        let other = alloc.alloc(12 * MIB, s1).ok();
        chk(&alloc, "other")?;
        drop(again);
        drop(other);
        drop(bufs);
        chk(&alloc, "all freed")?;
        if round == 1 {
            let _ = alloc.empty_cache();
            chk(&alloc, "empty")?;
        }
    }
    clear_faults(&dev);
    alloc.empty_cache().map_err(|e| format!("final empty: {e}"))?;
    chk(&alloc, "final")?;
    opener.finish();
    dev.synchronize().unwrap();
    if alloc.reserved_bytes() != 0 {
        return Err(format!("reserved {} after empty_cache", alloc.reserved_bytes()));
    }
    gone_cleanly(&dev, alloc)
}

#[test]
fn device_refusals_around_stitches_leave_every_view_consistent() {
    let mut failures = Vec::new();
    for cfg in [
        "expandable_stitching:true,fast_cache:false",
        "expandable_stitching:true,cross_stream:wait_event,release_threshold_mb:8",
    ] {
        let top: u64 = std::env::var("TOP_N").ok().and_then(|v| v.parse().ok()).unwrap_or(8);
        for n in 0..top {
            let kinds = refusals(n);
            for (name, f) in kinds.iter() {
                if let Err(e) = stitch_workload(cfg, &**f) {
                    failures.push(format!("{cfg} {name} {n}: {e}"));
                }
            }
        }
    }
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}
