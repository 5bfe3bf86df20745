//! Expandable segments: the paths that unmap and release pages, reviewed as users break them
//! (release thresholds crossed by mixed residencies, faults in the middle of releases, kernels
//! still running on other streams), with exact device figures after every step.
//!
//! Ranges are reserved from the simulated address space in order, each twice the device's
//! capacity: the first one a test makes starts at `SIM_BASE`. Pages are 2 MiB.

mod common;

use common::assert_no_leak;
use std::sync::Arc;
use tidepool::MIB;
use tidepool::device::{SIM_BASE, SimDevice};
use tidepool::{Allocator, Config, DeviceAddr, Residency, StreamId};

const P: u64 = 2 * MIB;
const CAP: u64 = 64 * MIB;

fn setup(config: &str, capacity: u64) -> (Arc<SimDevice>, Allocator<SimDevice>) {
    let dev = Arc::new(SimDevice::backed(capacity));
    let config = Config::parse(config).unwrap().with_expandable_segments(true);
    let alloc = Allocator::new(dev.clone(), config).unwrap();
    (dev, alloc)
}

/// `reserved_bytes` is what the device has mapped, and the invariants hold.
fn consistent(dev: &SimDevice, alloc: &Allocator<SimDevice>) {
    let mapped: u64 = dev.live_mappings().iter().map(|&(_, n)| n).sum();
    assert_eq!(alloc.reserved_bytes(), mapped);
    assert_eq!(dev.physical_bytes(), mapped);
    alloc.check_invariants().unwrap();
    assert_eq!(dev.violations(), vec![]);
}

/// A stream's free persistent memory, reused in part, must not hide its transient range's
/// frees from `release_threshold`: the trim remembered the stream's free bytes at its last
/// check (persistent ones included) and skipped every check until they grew past that figure.
#[test]
fn reused_persistent_memory_does_not_hide_frees_from_the_release_threshold() {
    let (dev, alloc) = setup("release_threshold_mb:4", CAP);
    let s0 = StreamId::DEFAULT;
    // The persistent range is made first (at SIM_BASE), the transient one above it.
    let w = alloc.alloc_in(16 * MIB, s0, Residency::Persistent).unwrap();
    assert_eq!(w.ptr(), DeviceAddr(SIM_BASE));
    let x = alloc.alloc(10 * MIB, s0).unwrap();
    assert_eq!(x.ptr(), DeviceAddr(SIM_BASE + 2 * CAP));
    assert_eq!(alloc.reserved_bytes(), 13 * P);
    // Weights unloaded: 16 MiB free on the stream, all persistent (never trimmed).
    drop(w);
    assert_eq!(alloc.reserved_bytes(), 13 * P);
    consistent(&dev, &alloc);
    // New weights take 10 MiB of them; 6 MiB stay free.
    let w2 = alloc.alloc_in(10 * MIB, s0, Residency::Persistent).unwrap();
    assert_eq!(w2.ptr(), DeviceAddr(SIM_BASE));
    let s = alloc.stats();
    assert_eq!(s.blocks.reserved_bytes.persistent.current, 8 * P);
    assert_eq!(s.blocks.reserved_bytes.transient.current, 5 * P);
    // The activation goes: its range holds 10 MiB free, above the 4 MiB threshold, in one
    // 5-page chunk, which goes whole.
    let unmaps = alloc.stats().num_device_unmap;
    drop(x);
    let s = alloc.stats();
    assert_eq!(s.blocks.reserved_bytes.transient.current, 0);
    assert_eq!(s.blocks.reserved_bytes.persistent.current, 8 * P);
    assert_eq!((s.num_device_unmap, s.num_physical_release), (unmaps + 1, 1));
    assert_eq!(alloc.expandable_ranges()[1].mapped_bytes, 0);
    consistent(&dev, &alloc);
    drop(w2);
    drop(alloc);
    assert_no_leak(&dev);
}
