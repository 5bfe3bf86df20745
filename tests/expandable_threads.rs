//! Expandable segments (`expandable_segments:true`) under several threads: what one thread
//! reads or does while another is in the middle of a growth, a release or a ladder. Every
//! interleaving is forced with gated kernels and the device's count of blocked host waits
//! (no sleeps), so each test asserts exact figures.

mod common;

use common::gated;
use std::sync::Arc;
use tidepool::device::{AccessKind, Launch, SimDevice};
use tidepool::{Allocator, Config, Device, MIB, MemoryStats};

/// Waits (spinning, no timing) until a thread is blocked in a host wait on the device; fails
/// if `other` ended first.
fn until_blocked<T>(dev: &SimDevice, other: &std::thread::ScopedJoinHandle<'_, T>) {
    while dev.blocked_host_waits() == 0 {
        assert!(!other.is_finished(), "the other thread ended without waiting");
        std::thread::yield_now();
    }
}

/// The expandable segments' figures of `s` with the reserved bytes they go with.
fn vm_figures(s: &MemoryStats) -> (u64, u64, u64, u64, u64) {
    let reserved = s.blocks.reserved_bytes.all.current;
    (reserved, s.num_device_map, s.num_device_unmap, s.num_physical_create, s.num_physical_release)
}

/// `stats()` is one consistent copy: the expandable segments' counters (maps, unmaps, creates,
/// releases) go with the reserved bytes of the same moment. A growth whose second map is
/// refused, and whose rollback's unmap of the first chunk is refused too, keeps that chunk
/// mapped (free in the pool) and publishes its counters; its request then climbs the
/// out-of-memory ladder, which waits on the host for a block still used by a gated kernel.
/// A reader on another thread meanwhile sees the figures the last lock section left — one
/// small page mapped, 2 MiB reserved — not the new counters against the old reserved bytes
/// (before: 2 maps and 3 creates, 1 release, against 2 MiB reserved: a 64 MiB mapping that
/// no reserved byte counted). Once the ladder is through, the request is served and every
/// figure is the device's.
#[test]
fn a_reader_sees_the_vm_counters_with_the_reserved_bytes_of_the_same_moment() {
    let dev = Arc::new(SimDevice::backed(256 * MIB));
    let config = Config::default().with_expandable_segments(true);
    let alloc = Allocator::new(dev.clone(), config).unwrap();
    let (s, t) = (dev.create_stream().unwrap(), dev.create_stream().unwrap());
    // A small block used by a gated kernel on `t`, freed: pending on `t`'s event.
    let x = alloc.alloc(MIB, s).unwrap();
    let (k, open) = gated(x.ptr(), MIB, AccessKind::Write);
    dev.launch(t, k).unwrap();
    x.record_stream(t).unwrap();
    drop(x);
    let before = vm_figures(&alloc.stats());
    assert_eq!(before, (2 * MIB, 1, 0, 1, 0));
    // 66 MiB: chunks of 32 pages and 1 page. The second map refused, then the unmap of the
    // first one in the rollback.
    dev.fail_nth_vm_map(Some(2));
    dev.fail_nth_vm_unmap(Some(1));
    std::thread::scope(|sc| {
        let grower = sc.spawn(|| alloc.alloc(66 * MIB, s).map(|b| b.ptr()));
        until_blocked(&dev, &grower); // the ladder waits for the pending block's event
        let seen = vm_figures(&alloc.stats());
        open.send(()).unwrap();
        grower.join().unwrap().unwrap();
        assert_eq!(seen, before, "a torn read");
    });
    let s_ = alloc.stats();
    let vm = dev.vm_counters();
    assert_eq!(
        vm_figures(&s_),
        (dev.physical_bytes(), vm.maps, vm.unmaps, vm.creates, vm.releases),
    );
    alloc.check_invariants().unwrap();
    assert_eq!(dev.violations(), vec![]);
    drop(alloc);
    common::assert_no_leak(&dev);
}
