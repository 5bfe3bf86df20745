//! Regressions for stream-order holes that were reachable from safe code (issue 14), one test per
//! finding, each on the asynchronous SimDevice with its sanitizer and kernels that really run.
//! Unfinished work is made with gates (a kernel blocks until the test opens it).

use std::sync::mpsc;
use std::sync::{Arc, Mutex};
use tidepool::MIB;
use tidepool::device::{Access, AccessKind, Kernel, Launch, SimDevice};
use tidepool::{Allocator, Config, Device, DeviceAddr, StreamId};

const N: u64 = 4096;
const S0: StreamId = StreamId::DEFAULT;

fn device() -> (Arc<SimDevice>, StreamId, StreamId) {
    let dev = Arc::new(SimDevice::backed(256 * MIB));
    let a = dev.create_stream().unwrap();
    let b = dev.create_stream().unwrap();
    (dev, a, b)
}

fn allocator(dev: &Arc<SimDevice>) -> Allocator<SimDevice> {
    Allocator::new(dev.clone(), Config::default()).unwrap()
}

fn write(ptr: DeviceAddr, byte: u8) -> Kernel {
    Kernel::new("write", vec![Access { ptr, bytes: N, kind: AccessKind::Write }], move |m| {
        m.write(ptr, &[byte; N as usize]).unwrap();
    })
}

/// A kernel that waits for the returned gate, then reads `[ptr, ptr + N)` into the slot.
fn gated_read(ptr: DeviceAddr) -> (Kernel, mpsc::Sender<()>, Arc<Mutex<Vec<u8>>>) {
    let (open, gate) = mpsc::channel::<()>();
    let slot = Arc::new(Mutex::new(Vec::new()));
    let out = slot.clone();
    let k = Kernel::new("gated_read", vec![Access { ptr, bytes: N, kind: AccessKind::Read }], {
        move |m| {
            let _ = gate.recv();
            let mut v = vec![0u8; N as usize];
            m.read(ptr, &mut v).unwrap();
            *out.lock().unwrap() = v;
        }
    });
    (k, open, slot)
}

/// Makes `stream` wait (on the device) for the work enqueued on `after` so far.
fn order(dev: &SimDevice, stream: StreamId, after: StreamId) {
    let e = dev.create_event().unwrap();
    dev.record_event(e, after).unwrap();
    dev.wait_event(stream, e).unwrap();
}

/// Finding 1: `free_batch` given a buffer of another allocator must not free its block id in
/// this allocator's pool (where the same id names a live block: the next allocation would alias
/// it). The foreign buffer is refused with an error (and freed by its own allocator).
#[test]
fn free_batch_refuses_a_buffer_of_another_allocator() {
    let (dev, _, _) = device();
    let mine = allocator(&dev);
    let theirs = allocator(&dev);
    let live = mine.alloc(N, S0).unwrap(); // block ids of both pools start alike
    let foreign = theirs.alloc(N, S0).unwrap();
    let result = format!("{:?}", mine.free_batch(vec![foreign]));
    let next = mine.alloc(N, S0).unwrap();
    assert_ne!(next.ptr(), live.ptr(), "the next allocation aliases a live buffer");
    assert_eq!(dev.violations(), vec![]);
    assert!(result.contains("ForeignBuffer"), "refused with an error, got {result}");
    mine.check_invariants().unwrap();
    theirs.check_invariants().unwrap();
    assert_eq!(theirs.allocated_bytes(), 0, "its own allocator freed it");
    drop((live, next));
    drop((mine, theirs));
    assert!(dev.live_segments().is_empty(), "nothing leaked");
}

/// Finding 2: `record_stream` given a buffer of another allocator must leave this allocator's
/// tables alone (it recorded the use under the buffer's block id, where it named another block)
/// and say so; recorded with its own allocator, the use holds the block until the other stream's
/// read completed.
#[test]
fn record_stream_refuses_a_buffer_of_another_allocator() {
    let (dev, a, b) = device();
    let mine = allocator(&dev);
    let theirs = allocator(&dev);
    // A large block of `mine` under the same block id as `buf` below (frees of large blocks go
    // through the slow path, where recorded uses are looked up).
    let big = mine.alloc(3 * MIB, a).unwrap();
    let buf = theirs.alloc(3 * MIB, a).unwrap();
    let p = buf.ptr();
    dev.launch(a, write(p, 0x5A)).unwrap();
    order(&dev, b, a);
    let (k, open, got) = gated_read(p);
    dev.launch(b, k).unwrap();
    let result = format!("{:?}", mine.record_stream(&buf, b));
    let records = dev.counters().event_records;
    drop(big);
    assert_eq!(dev.counters().event_records, records, "`mine` recorded a use it never had");
    assert!(result.contains("ForeignBuffer"), "refused with an error, got {result}");
    // Recorded with the right allocator, the block waits for the read on `b`.
    let _ = theirs.record_stream(&buf, b);
    drop(buf);
    let again = theirs.alloc(3 * MIB, a).unwrap();
    dev.launch(a, write(again.ptr(), 0xEE)).unwrap();
    open.send(()).unwrap();
    dev.synchronize().unwrap();
    assert_eq!(*got.lock().unwrap(), vec![0x5A; N as usize], "the read saw its own bytes");
    assert_eq!(dev.violations(), vec![]);
    drop(again);
    mine.check_invariants().unwrap();
    theirs.check_invariants().unwrap();
    drop((mine, theirs));
    assert!(dev.live_segments().is_empty());
}

/// Unknown streams are refused on every entry point, before anything is reserved or recorded.
/// (An allocation on a stream that never existed used to succeed: its segment was keyed to a
/// phantom stream that cross-stream reuse then took as drained.)
#[test]
fn every_entry_point_refuses_a_stream_that_does_not_exist() {
    let (dev, a, _) = device();
    let alloc = allocator(&dev);
    let ghost = StreamId(77);
    let unknown = |r: String| assert!(r.contains("UnknownStream(StreamId(77))"), "got {r}");
    unknown(format!("{:?}", alloc.alloc(N, ghost).err()));
    unknown(format!("{:?}", alloc.alloc(3 * MIB, ghost).err()));
    unknown(format!("{:?}", alloc.alloc(0, ghost).err()));
    unknown(format!("{:?}", alloc.alloc_in(N, ghost, tidepool::Residency::Persistent).err()));
    assert!(dev.live_segments().is_empty(), "nothing reserved for a phantom stream");
    let buf = alloc.alloc(N, a).unwrap();
    unknown(format!("{:?}", alloc.record_stream(&buf, ghost)));
    unknown(format!("{:?}", alloc.release_stream(ghost)));
    unknown(format!("{:?}", alloc.destroy_stream(ghost)));
    {
        let scope = alloc.named_scope("ghost", ghost);
        unknown(format!("{:?}", scope.alloc(N).err()));
        unknown(format!("{:?}", scope.alloc_unbound(N).err()));
    }
    {
        let scope = alloc.scope(a);
        let x = scope.alloc(N).unwrap();
        unknown(format!("{:?}", x.record_stream(ghost)));
    }
    // A destroyed stream is unknown too.
    let c = dev.create_stream().unwrap();
    drop(alloc.alloc(N, c).unwrap());
    alloc.destroy_stream(c).unwrap();
    let r = format!("{:?}", alloc.alloc(N, c).err());
    assert!(r.contains("UnknownStream"), "got {r}");
    drop(buf);
    alloc.check_invariants().unwrap();
    assert_eq!(dev.violations(), vec![]);
}

/// `destroy_stream` that the device refuses (the default stream) changes nothing: the default
/// stream keeps its cache and its lock-free fast path.
#[test]
fn a_refused_destroy_stream_changes_nothing() {
    let (dev, _, _) = device();
    let alloc = allocator(&dev);
    drop(alloc.alloc(N, S0).unwrap()); // cached on the default stream
    let cached = alloc.stats().cached_fast_bytes;
    assert_eq!(cached, N);
    assert!(alloc.destroy_stream(S0).is_err());
    assert_eq!(alloc.stats().cached_fast_bytes, cached, "the cache was flushed");
    let locks = alloc.global_lock_acquisitions();
    for _ in 0..3 {
        drop(alloc.alloc(N, S0).unwrap());
    }
    assert_eq!(alloc.global_lock_acquisitions(), locks, "the default stream lost its fast path");
    alloc.check_invariants().unwrap();
}

/// Opens `gate` from another thread after a short while (for host syncs that wait on it).
fn open_later(gate: mpsc::Sender<()>) -> std::thread::JoinHandle<()> {
    std::thread::spawn(move || {
        std::thread::sleep(std::time::Duration::from_millis(150));
        let _ = gate.send(());
    })
}

/// A `wait_event` the device refuses must not leak the allocator's pooled event (cross-stream
/// reuse under `wait_event` returned before putting it back).
#[test]
fn a_failed_wait_event_returns_its_event_to_the_pool() {
    let (dev, a, b) = device();
    let alloc = Allocator::new(dev.clone(), Config::parse("cross_stream:wait_event").unwrap());
    let alloc = alloc.unwrap();
    drop(alloc.alloc(N, a).unwrap()); // a free segment of `a`, for `b` to take
    dev.fail_event_waits(true);
    let mut kept = Vec::new();
    for _ in 0..3 {
        kept.push(alloc.alloc(N, b)); // `b` cannot wait on `a`: fresh memory (or an error)
    }
    dev.fail_event_waits(false);
    drop(kept);
    alloc.check_invariants().unwrap();
    drop(alloc);
    assert_eq!(dev.live_events(), 0, "the allocator leaked events");
    assert_eq!(dev.violations(), vec![]);
}

/// A `record_event` the device refuses on a stream that still uses a freed block must not be
/// taken as "that stream is gone": the free waits for it on the host instead, so the block is
/// not handed out while the other stream's read is still running.
#[test]
fn a_failed_record_event_is_not_a_skipped_wait() {
    let (dev, a, b) = device();
    let alloc = allocator(&dev);
    let buf = alloc.alloc(N, a).unwrap();
    let p = buf.ptr();
    dev.launch(a, write(p, 0x77)).unwrap();
    order(&dev, b, a);
    let (k, open, got) = gated_read(p);
    dev.launch(b, k).unwrap();
    let _ = alloc.record_stream(&buf, b);
    dev.fail_event_records(true);
    let opener = open_later(open);
    drop(buf); // cannot record on `b`: must wait for `b` on the host
    dev.fail_event_records(false);
    let again = alloc.alloc(N, a).unwrap();
    dev.launch(a, write(again.ptr(), 0x11)).unwrap();
    opener.join().unwrap();
    dev.synchronize().unwrap();
    assert_eq!(dev.violations(), vec![], "the block was handed out while `b` still read it");
    assert_eq!(*got.lock().unwrap(), vec![0x77; N as usize]);
    drop(again);
    alloc.check_invariants().unwrap();
}

/// Finding 3: a planned scoped buffer used on another stream (`record_stream`) and then
/// `mem::forget`ten never reaches the scoped free path, so the scope's exit must order the
/// region after its recorded uses before the region goes back to the pool (the run relearns).
#[test]
fn a_forgotten_planned_buffer_used_on_another_stream_orders_the_scope_exit() {
    let (dev, a, b) = device();
    let alloc = allocator(&dev);
    {
        let scope = alloc.named_scope("forget", a);
        drop(scope.alloc(N).unwrap()); // learns [alloc, free]
    }
    let (open, got);
    {
        let scope = alloc.named_scope("forget", a);
        let x = scope.alloc(N).unwrap();
        assert!(x.is_planned());
        dev.launch(a, write(x.ptr(), 0x42)).unwrap();
        order(&dev, b, a);
        let (k, o, g) = gated_read(x.ptr());
        dev.launch(b, k).unwrap();
        (open, got) = (o, g);
        let _ = x.record_stream(b);
        std::mem::forget(x); // its free never happens; the run relearns at exit
    }
    let y = alloc.alloc(N, a).unwrap(); // may be the region's memory, back in the pool
    dev.launch(a, write(y.ptr(), 0x99)).unwrap();
    open.send(()).unwrap();
    dev.synchronize().unwrap();
    assert_eq!(dev.violations(), vec![], "handed out while `b` still read it");
    assert_eq!(*got.lock().unwrap(), vec![0x42; N as usize], "`b` read `a`'s later write");
    drop(y);
    alloc.check_invariants().unwrap();
    drop(alloc);
    assert!(dev.live_segments().is_empty());
}

/// A forgotten planned slice goes back to the sanitizer at exit (the memory is reused by the
/// next run, which repeats the plan exactly): no "handed out twice" on the next hand-out.
#[test]
fn a_forgotten_planned_slice_is_taken_back_at_exit() {
    let (dev, a, _) = device();
    let alloc = allocator(&dev);
    for run in 0..4 {
        let scope = alloc.named_scope("leaky", a);
        let x = scope.alloc(N).unwrap();
        assert_eq!(x.is_planned(), run > 0);
        std::mem::forget(x);
    }
    assert_eq!(dev.violations(), vec![]);
    alloc.check_invariants().unwrap();
    drop(alloc);
    assert!(dev.live_segments().is_empty());
}

/// Finding 4: an unbound planned buffer freed on another thread while its scope is open must
/// order its stream after the buffer's other streams *before* the scope can see the free: the
/// scope's next planned allocation reuses the slice at once. Contention on the global lock
/// (here `empty_cache`, blocked in a segment release while a gated kernel runs) used to hold the
/// freeing thread between the two, with the free already visible.
#[test]
fn a_cross_thread_unbound_free_is_ordered_before_the_scope_can_reuse_its_slice() {
    assert_eq!(cross_thread_unbound_free(false), vec![], "u's slice was reused while `b` read it");
}

/// The same with the fix reverted (`Broken::UnboundFreeOrder`): the sanitizer sees the reuse.
#[test]
fn the_sanitizer_catches_a_cross_thread_unbound_free_ordered_late() {
    let v = cross_thread_unbound_free(true);
    assert!(v.iter().any(|v| v.op == "handout"), "not caught: {v:?}");
}

fn cross_thread_unbound_free(broken: bool) -> Vec<tidepool::device::Violation> {
    use std::thread::{sleep, spawn};
    use std::time::Duration;
    let (dev, a, b) = device();
    let alloc = allocator(&dev);
    alloc.set_broken(tidepool::hooks::Broken::UnboundFreeOrder, broken);
    {
        let scope = alloc.named_scope("unbound", a);
        drop(scope.alloc_unbound(N).unwrap());
        drop(scope.alloc_unbound(N).unwrap()); // learns: the second reuses the first's slice
    }
    drop(alloc.alloc(3 * MIB, a).unwrap()); // a free segment for `empty_cache` to release
    let scope = alloc.named_scope("unbound", a);
    let u = scope.alloc_unbound(N).unwrap();
    assert!(u.is_planned());
    dev.launch(a, write(u.ptr(), 0x33)).unwrap();
    order(&dev, b, a);
    let (k, open, got) = gated_read(u.ptr());
    dev.launch(b, k).unwrap();
    let _ = alloc.record_stream(&u, b);
    // Holds the global lock until the gate opens: the release waits for the device to idle.
    let trimmer = {
        let alloc = alloc.clone();
        spawn(move || alloc.empty_cache().unwrap())
    };
    sleep(Duration::from_millis(100));
    let freer = spawn(move || drop(u));
    sleep(Duration::from_millis(100));
    let opener = spawn(move || {
        sleep(Duration::from_millis(300));
        open.send(()).unwrap();
    });
    let v = scope.alloc_unbound(N).unwrap(); // planned into u's slice only if ordered
    dev.launch(a, write(v.ptr(), 0x44)).unwrap();
    for t in [trimmer, freer, opener] {
        t.join().unwrap();
    }
    dev.synchronize().unwrap();
    if !broken {
        assert_eq!(*got.lock().unwrap(), vec![0x33; N as usize]);
    }
    drop(v);
    drop(scope);
    alloc.check_invariants().unwrap();
    dev.violations()
}

/// A kernel that waits for the returned gate, then writes `byte` over `[ptr, ptr + N)`.
fn gated_write(ptr: DeviceAddr, byte: u8) -> (Kernel, mpsc::Sender<()>) {
    let (open, gate) = mpsc::channel::<()>();
    let k = Kernel::new("gated_write", vec![Access { ptr, bytes: N, kind: AccessKind::Write }], {
        move |m| {
            let _ = gate.recv();
            m.write(ptr, &[byte; N as usize]).unwrap();
        }
    });
    (k, open)
}

/// A kernel that reads `[ptr, ptr + N)` into the returned slot.
fn read(ptr: DeviceAddr) -> (Kernel, Arc<Mutex<Vec<u8>>>) {
    let slot = Arc::new(Mutex::new(Vec::new()));
    let out = slot.clone();
    let k = Kernel::new("read", vec![Access { ptr, bytes: N, kind: AccessKind::Read }], move |m| {
        let mut v = vec![0u8; N as usize];
        m.read(ptr, &mut v).unwrap();
        *out.lock().unwrap() = v;
    });
    (k, slot)
}

/// Finding 5 (the logic behind `CudaBuffer`'s cudarc `DevicePtr`): `use_on(stream, access)`
/// makes the using stream wait for the owner's last write, and records the use, so the block
/// is not reused before the use completed. Here: written on `a` (gated, still running), read on
/// `b`, freed, and `a` allocates again. Returns (violations, bytes `b` read).
fn read_on_another_stream(
    broken: bool,
) -> (Vec<tidepool::device::Violation>, Vec<u8>, DeviceAddr, DeviceAddr) {
    let (dev, a, b) = device();
    let alloc = allocator(&dev);
    alloc.set_broken(tidepool::hooks::Broken::UseOn, broken);
    let buf = alloc.alloc(N, a).unwrap();
    let p = buf.ptr();
    let (k, open) = gated_write(p, 0x5A);
    dev.launch(a, k).unwrap();
    buf.use_on(b, AccessKind::Read).unwrap();
    let (k, open_b, got) = gated_read(p);
    dev.launch(b, k).unwrap();
    drop(buf);
    let again = alloc.alloc(N, a).unwrap();
    let q = again.ptr();
    dev.launch(a, write(q, 0x11)).unwrap();
    open.send(()).unwrap();
    open_b.send(()).unwrap();
    dev.synchronize().unwrap();
    drop(again);
    alloc.check_invariants().unwrap();
    let bytes = got.lock().unwrap().clone();
    (dev.violations(), bytes, p, q)
}

#[test]
fn use_on_another_stream_waits_for_the_owners_write_and_holds_the_block() {
    let (violations, bytes, p, q) = read_on_another_stream(false);
    assert_eq!(violations, vec![]);
    assert_eq!(bytes, vec![0x5A; N as usize], "`b` read before `a`'s write landed");
    assert_ne!(p, q, "the block was reused while `b` still read it");
}

/// Without it (what `CudaBuffer` did: the stream argument ignored), the sanitizer sees both
/// holes: `b` reads memory `a` is still writing, and `a` gets the block back while `b` reads.
#[test]
fn the_sanitizer_catches_a_use_on_another_stream_that_is_not_ordered() {
    let (violations, _, p, q) = read_on_another_stream(true);
    assert!(violations.iter().any(|v| v.op == "kernel gated_read"), "{violations:?}");
    assert!(violations.iter().any(|v| v.op == "handout"), "{violations:?}");
    assert_eq!(p, q);
}

/// A write on another stream, then a read on the owner: the owner waits for that write; and a
/// write on the owner after reads on other streams waits for those reads.
#[test]
fn use_on_orders_the_owner_after_writes_and_reads_on_other_streams() {
    let (dev, a, b) = device();
    let alloc = allocator(&dev);
    let buf = alloc.alloc(N, a).unwrap();
    let p = buf.ptr();
    buf.use_on(b, AccessKind::Write).unwrap();
    let (k, open) = gated_write(p, 0x77);
    dev.launch(b, k).unwrap();
    buf.use_on(a, AccessKind::Read).unwrap();
    let (k, got) = read(p);
    dev.launch(a, k).unwrap();
    // `b` reads, then `a` overwrites: `a` must wait for the read.
    buf.use_on(b, AccessKind::Read).unwrap();
    let (k, got_b) = read(p);
    dev.launch(b, k).unwrap();
    buf.use_on(a, AccessKind::Write).unwrap();
    dev.launch(a, write(p, 0x99)).unwrap();
    open.send(()).unwrap();
    dev.synchronize().unwrap();
    assert_eq!(dev.violations(), vec![]);
    assert_eq!(*got.lock().unwrap(), vec![0x77; N as usize], "`a` read before `b`'s write");
    assert_eq!(*got_b.lock().unwrap(), vec![0x77; N as usize], "`a` overwrote before `b` read");
    // Another allocator's buffer is refused; an unknown stream too.
    let other = allocator(&dev);
    assert_eq!(other.use_on(&buf, b, AccessKind::Read), Err(tidepool::AllocError::ForeignBuffer));
    let ghost = StreamId(77);
    assert_eq!(
        buf.use_on(ghost, AccessKind::Read),
        Err(tidepool::AllocError::UnknownStream(ghost))
    );
    drop(buf);
    alloc.check_invariants().unwrap();
}

/// `min_block_size` below 256 is refused with a clear error (it gave pointers that are not
/// 256-byte aligned, odd ones at 1 B); every accepted configuration hands out 256-byte aligned
/// pointers, from the pool, the stream caches and scope plans.
#[test]
fn min_block_size_below_256_is_refused_and_pointers_stay_256_aligned() {
    for v in [1u64, 2, 64, 128] {
        let r = Config::parse(&format!("min_block_size:{v}"));
        let msg = format!("{r:?}");
        assert!(msg.contains("BadValue") && msg.contains("256"), "min_block_size:{v}: {msg}");
        let mut c = Config::default();
        c.sizing.min_block_size = v;
        assert!(c.validate().is_err(), "min_block_size {v} validated");
    }
    let (dev, a, _) = device();
    let mut c = Config::default();
    c.sizing.min_block_size = 1;
    assert!(Allocator::new(dev.clone(), c).is_err());
    for v in [256u64, 512, 4096] {
        let alloc =
            Allocator::new(dev.clone(), Config::parse(&format!("min_block_size:{v}")).unwrap());
        let alloc = alloc.unwrap();
        let mut ptrs = Vec::new();
        for _ in 0..3 {
            let scope = alloc.named_scope("aligned", a);
            let mut keep = Vec::new();
            for bytes in [1u64, 3, 255, 257, 1000, 4097] {
                keep.push(scope.alloc(bytes).unwrap().ptr());
                let b = alloc.alloc(bytes, a).unwrap();
                ptrs.push(b.ptr());
                drop(b); // cached: the next one comes from the stream cache
            }
            ptrs.extend(keep);
        }
        assert!(alloc.stats().plan_hits > 0, "planned runs are checked too");
        for p in ptrs {
            assert_eq!(p.0 % 256, 0, "min_block_size:{v} handed out {p}");
        }
    }
}

/// A scope run's allocation index is a `u32` with `u32::MAX` reserved (zero-byte buffers): the
/// allocation that would take it is an error, and the run stays usable (its buffers free, the
/// scope exits cleanly). It overflowed after 2³² allocations in one run.
#[test]
fn a_scope_run_cannot_overflow_its_allocation_index() {
    let (dev, a, _) = device();
    let alloc = allocator(&dev);
    {
        // (An anonymous scope: the hook leaves a gap in the run's indices no plan could learn.)
        let scope = alloc.scope(a);
        scope.set_allocation_count(u32::MAX - 2);
        let x = scope.alloc(N).unwrap();
        let y = scope.alloc_unbound(N).unwrap(); // the last index a run can give
        let e = format!("{:?} {:?}", scope.alloc(N).err(), scope.alloc_unbound(N).err());
        assert!(e.matches("TooManyScopeAllocations").count() == 2, "got {e}");
        assert!(scope.alloc(0).is_ok(), "zero-byte buffers take no index");
        drop((x, y));
        drop(scope);
        alloc.check_invariants().unwrap();
        assert_eq!(alloc.allocated_bytes(), alloc.stats().plan_region_bytes, "a block leaked");
    }
    assert_eq!(dev.violations(), vec![]);
}

/// Found by the multi-thread property test: a run that opened under one plan made that plan's
/// region *after* the scope had relearned another plan, and stored it with the new plan, whose
/// offsets reach past it: the next run handed out memory beyond the region (here: a live
/// buffer's). Two runs of one named scope are open at once on one thread to make it happen.
#[test]
fn a_region_is_made_only_for_the_plan_in_force() {
    let (dev, a, _) = device();
    let alloc = allocator(&dev);
    let small = |scope: &tidepool::Scope<'_, SimDevice>| drop(scope.alloc(N).unwrap());
    let large = |scope: &tidepool::Scope<'_, SimDevice>| {
        let x = scope.alloc(N).unwrap();
        let y = scope.alloc(64 * 1024).unwrap();
        drop((x, y));
    };
    {
        let s = alloc.named_scope("plans", a);
        large(&s); // learns P1 (its region made at once)
    }
    {
        let s = alloc.named_scope("plans", a);
        small(&s); // diverges: learns P2 (small), with no region yet
    }
    let z = alloc.named_scope("plans", a); // will follow P2 (no region yet)
    {
        let y = alloc.named_scope("plans", a);
        large(&y); // diverges from P2: learns P3 (large), while Z is open
    }
    small(&z); // Z makes a region for P2 (small)... which must not become P3's
    drop(z);
    let neighbour = alloc.alloc(64 * 1024, a).unwrap();
    dev.launch(a, write(neighbour.ptr(), 0x12)).unwrap();
    for _ in 0..2 {
        let w = alloc.named_scope("plans", a);
        large(&w);
    }
    dev.synchronize().unwrap();
    assert_eq!(dev.violations(), vec![], "a plan served memory outside its region");
    drop(neighbour);
    alloc.check_invariants().unwrap();
    drop(alloc);
    assert!(dev.live_segments().is_empty());
}

/// A stream-cache lane's guard stays on the thread that took it, as `std`'s `MutexGuard`
/// does: a biased guard is its owner thread's (`lane_lock.rs`), and one let go on another
/// thread would let the owner take a second guard while the first is held. A compile-time
/// check: the path below names exactly one impl (so compiles) only where the guard is not
/// `Send`; were it `Send`, both impls would apply and the build would fail as ambiguous.
#[test]
fn a_lane_guard_is_not_send() {
    trait AmbiguousIfSend<A> {
        fn check() {}
    }
    impl<T: ?Sized> AmbiguousIfSend<()> for T {}
    impl<T: ?Sized + Send> AmbiguousIfSend<u8> for T {}
    <tidepool::hooks::LaneGuard<'static, u64> as AmbiguousIfSend<_>>::check();
    // The lock itself is shared between threads (its data only through a guard).
    fn sync<T: Sync + Send>() {}
    sync::<tidepool::hooks::LaneLock<u64>>();
}
