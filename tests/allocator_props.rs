//! proptest: random programs of allocations (small, large and huge), frees in random order,
//! `record_stream`, `empty_cache` and injected device failures. After every step the pool's
//! invariants hold, the allocator agrees with the device and with a reference model of the live
//! buffers; at the end, dropping every buffer and the allocator leaves no segment on the device.
//! With expandable segments, reserved bytes are the device's physical bytes, buffers lie in
//! mapped pages, and nothing is left mapped, created or reserved at the end. Half the programs
//! run with the device's sanitizer off, where hits and frees take the inlined paths.

use proptest::prelude::*;
use std::sync::Arc;
use tidepool::MIB;
use tidepool::device::{SimConfig, SimDevice};
use tidepool::{AllocError, Allocator, Buffer, Config, Device, Residency, StreamId};

#[derive(Clone, Debug)]
enum Op {
    Alloc { bytes: u64, stream: usize, persistent: bool },
    Free(usize),
    RecordStream { buffer: usize, stream: usize },
    EmptyCache,
    FailNextMalloc,
    FailMallocsAbove(u64),
    FailNthVmCreate(u64),
    FailNthVmMap(u64),
    ClearFaults,
}

fn size() -> impl Strategy<Value = u64> {
    prop_oneof![
        4 => 0u64..=4096,                      // tiny
        4 => 4096u64..=MIB,                    // small pool
        3 => MIB + 1..=10 * MIB,               // large pool, shared segments
        1 => 10 * MIB..=60 * MIB,              // own segments
    ]
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        10 => (size(), 0usize..3, any::<bool>()).prop_map(|(bytes, stream, persistent)| Op::Alloc { bytes, stream, persistent }),
        7 => any::<prop::sample::Index>().prop_map(|i| Op::Free(i.index(usize::MAX))),
        2 => (any::<prop::sample::Index>(), 0usize..3).prop_map(|(i, s)| Op::RecordStream { buffer: i.index(usize::MAX), stream: s }),
        1 => Just(Op::EmptyCache),
        1 => Just(Op::FailNextMalloc),
        1 => (1u64..40).prop_map(|m| Op::FailMallocsAbove(m * MIB)),
        1 => (1u64..4).prop_map(Op::FailNthVmCreate),
        1 => (1u64..4).prop_map(Op::FailNthVmMap),
        1 => Just(Op::ClearFaults),
    ]
}

fn config() -> impl Strategy<Value = Config> {
    prop_oneof![
        Just(Config::default()),
        Just(Config::parse("max_split_size_mb:32").unwrap()),
        Just(Config::parse("roundup_power2_divisions:4").unwrap()),
        Just(Config::parse("cross_stream:wait_event").unwrap()),
        Just(Config::parse("expandable_segments:true").unwrap()),
        Just(Config::parse("expandable_segments:true,cross_stream:wait_event").unwrap()),
        Just(Config::parse("expandable_segments:true,release_threshold_mb:4").unwrap()),
        // Oversize free blocks at a run's end serve smaller requests, and range blocks split.
        Just(Config::parse("expandable_segments:true,max_split_size_mb:32").unwrap()),
    ]
}

struct Live {
    buf: Buffer<SimDevice>,
    bytes: u64,
    stream: StreamId,
}

fn check(
    dev: &SimDevice,
    alloc: &Allocator<SimDevice>,
    live: &[Live],
) -> Result<(), TestCaseError> {
    alloc.check_invariants().map_err(TestCaseError::fail)?;
    prop_assert_eq!(dev.violations(), vec![]);
    let s = alloc.stats();
    let segs = dev.live_segments();
    let seg_bytes = segs.iter().map(|s| s.1).sum::<u64>();
    prop_assert_eq!(s.blocks.reserved_bytes.all.current, seg_bytes + dev.physical_bytes());
    let maps = dev.live_mappings();
    if maps.is_empty() {
        prop_assert_eq!(s.blocks.segment.all.current, segs.len() as u64);
    }
    prop_assert_eq!(
        s.blocks.allocated_bytes.all.current,
        live.iter().map(|l| l.buf.block_size()).sum::<u64>()
    );
    prop_assert_eq!(
        s.blocks.allocation.all.current,
        live.iter().filter(|l| !l.buf.is_empty()).count() as u64
    );
    // Live buffers never overlap and lie inside a device segment.
    let mut ranges: Vec<(u64, u64)> = live
        .iter()
        .filter(|l| !l.buf.is_empty())
        .map(|l| (l.buf.ptr().0, l.buf.block_size()))
        .collect();
    ranges.sort_unstable();
    for w in ranges.windows(2) {
        prop_assert!(w[0].0 + w[0].1 <= w[1].0, "live buffers overlap");
    }
    for &(p, n) in &ranges {
        let mapped = |lo: u64, hi: u64| {
            let mut cur = lo;
            while cur < hi {
                match maps.iter().find(|&&(a, sz)| a.0 <= cur && cur < a.0 + sz) {
                    Some(&(a, sz)) => cur = a.0 + sz,
                    None => return false,
                }
            }
            true
        };
        prop_assert!(
            segs.iter().any(|&(b, sz)| b.0 <= p && p + n <= b.0 + sz) || mapped(p, p + n),
            "buffer outside every segment and mapping"
        );
    }
    for l in live {
        prop_assert_eq!(l.buf.len(), l.bytes);
        prop_assert_eq!(l.buf.stream(), l.stream);
        prop_assert!(l.buf.block_size() >= l.bytes);
    }
    Ok(())
}

proptest! {
    // `PROPTEST_CASES` raises the count for a long hunt.
    #![proptest_config(ProptestConfig {
        cases: std::env::var("PROPTEST_CASES").ok().and_then(|c| c.parse().ok()).unwrap_or(200),
        ..ProptestConfig::default()
    })]

    #[test]
    fn random_programs_keep_every_invariant(
        config in config(),
        quiet in any::<bool>(),
        ops in prop::collection::vec(op(), 1..120),
    ) {
        // Half the programs on a device with its sanitizer off, as on a real GPU: only there do
        // hits and frees take the inlined paths (the sanitizer's hooks send them down the whole
        // path).
        let sim = SimConfig { capacity: 256 * MIB, backed: false, sanitize: !quiet };
        let dev = Arc::new(SimDevice::with_config(sim));
        let streams = [StreamId::DEFAULT, dev.create_stream().unwrap(), dev.create_stream().unwrap()];
        let alloc = Allocator::new(dev.clone(), config).unwrap();
        let mut live: Vec<Live> = Vec::new();
        for op in ops {
            match op {
                Op::Alloc { bytes, stream, persistent } => {
                    let residency = if persistent { Residency::Persistent } else { Residency::Transient };
                    match alloc.alloc_in(bytes, streams[stream], residency) {
                        Ok(buf) => live.push(Live { buf, bytes, stream: streams[stream] }),
                        Err(AllocError::OutOfMemory(r)) => {
                            // Refused only if even the largest free block could not serve it.
                            prop_assert_eq!(r.requested, bytes);
                            prop_assert!(r.reserved <= 256 * MIB);
                        }
                        Err(e) => prop_assert!(false, "unexpected error {e}"),
                    }
                }
                Op::Free(i) if !live.is_empty() => {
                    let i = i % live.len();
                    live.swap_remove(i);
                }
                Op::RecordStream { buffer, stream } if !live.is_empty() => {
                    let l = &live[buffer % live.len()];
                    alloc.record_stream(&l.buf, streams[stream]).unwrap();
                }
                Op::EmptyCache => alloc.empty_cache().unwrap(),
                Op::FailNextMalloc => dev.fail_nth_malloc(Some(1)),
                Op::FailMallocsAbove(b) => dev.fail_mallocs_above(Some(b)),
                Op::FailNthVmCreate(n) => dev.fail_nth_vm_create(Some(n)),
                Op::FailNthVmMap(n) => dev.fail_nth_vm_map(Some(n)),
                Op::ClearFaults => {
                    dev.fail_nth_malloc(None);
                    dev.fail_mallocs_above(None);
                    dev.fail_nth_vm_create(None);
                    dev.fail_nth_vm_map(None);
                }
                Op::Free(_) | Op::RecordStream { .. } => {}
            }
            check(&dev, &alloc, &live)?;
        }
        live.clear();
        alloc.synchronize().unwrap();
        check(&dev, &alloc, &live)?;
        let s = alloc.stats();
        prop_assert_eq!(s.blocks.active_bytes.all.current, 0);
        prop_assert_eq!(s.blocks.requested_bytes.all.current, 0);
        drop(alloc);
        prop_assert!(dev.live_segments().is_empty(), "leaked {:?}", dev.live_segments());
        prop_assert_eq!(dev.counters().mallocs, dev.counters().frees);
        prop_assert_eq!(dev.live_mappings(), vec![]);
        prop_assert_eq!((dev.physical_bytes(), dev.live_physical(), dev.virtual_bytes()), (0, 0, 0));
        let v = dev.vm_counters();
        prop_assert_eq!((v.creates, v.maps, v.reserves), (v.releases, v.unmaps, v.frees));
    }
}
