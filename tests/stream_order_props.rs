//! proptest: random multi-stream programs (alloc, free, record_stream, kernels with random
//! delays touching buffers, wait_event, stream destroy) under both cross-stream policies, on the
//! asynchronous SimDevice. Kernels follow PyTorch's protocol for the user's side of stream order:
//! a stream first waits for every other stream that used the buffer (its owner included), and a
//! use on a stream other than the owner is announced with `record_stream`. After each run: zero sanitizer violations, the
//! pool's invariants, and no leaked segment. Each policy runs with expandable segments off and
//! on (then also: no mapping, physical allocation or virtual range left on the device).

use proptest::prelude::*;
use std::sync::Arc;
use std::time::Duration;
use tidepool::MIB;
use tidepool::device::{Access, AccessKind, Kernel, Launch, SimDevice};
use tidepool::{Allocator, Buffer, Config, Device, StreamId};

#[derive(Clone, Debug)]
enum Op {
    Alloc { bytes: u64, stream: usize },
    Free(usize),
    RecordStream { buffer: usize, stream: usize },
    Launch { buffer: usize, stream: usize, delay_us: u64, write: bool },
    WaitEvent { from: usize, to: usize },
    Destroy(usize),
    EmptyCache,
}

fn op() -> impl Strategy<Value = Op> {
    let idx = || any::<prop::sample::Index>().prop_map(|i| i.index(usize::MAX));
    prop_oneof![
        8 => (prop_oneof![1u64..=8192, MIB..=3 * MIB, 10 * MIB..=12 * MIB], 0usize..4)
            .prop_map(|(bytes, stream)| Op::Alloc { bytes, stream }),
        6 => idx().prop_map(Op::Free),
        2 => (idx(), 0usize..4).prop_map(|(buffer, stream)| Op::RecordStream { buffer, stream }),
        6 => (idx(), 0usize..4, 0u64..300, any::<bool>())
            .prop_map(|(buffer, stream, delay_us, write)| Op::Launch { buffer, stream, delay_us, write }),
        2 => (0usize..4, 0usize..4).prop_map(|(from, to)| Op::WaitEvent { from, to }),
        1 => (1usize..4).prop_map(Op::Destroy),
        1 => Just(Op::EmptyCache),
    ]
}

fn run(policy: &str, ops: Vec<Op>) -> Result<(), TestCaseError> {
    let dev = Arc::new(SimDevice::new(512 * MIB));
    let streams: Vec<StreamId> = std::iter::once(StreamId::DEFAULT)
        .chain((0..3).map(|_| dev.create_stream().unwrap()))
        .collect();
    let mut alive = [true; 4];
    let alloc = Allocator::new(dev.clone(), Config::parse(policy).unwrap()).unwrap();
    // Each live buffer with the streams that have touched it.
    let mut live: Vec<(Buffer<SimDevice>, Vec<StreamId>)> = Vec::new();
    for op in ops {
        match op {
            Op::Alloc { bytes, stream } if alive[stream] => {
                if let Ok(b) = alloc.alloc(bytes, streams[stream]) {
                    let owner = b.stream();
                    live.push((b, vec![owner]));
                }
            }
            Op::Free(i) if !live.is_empty() => {
                let n = live.len();
                drop(live.swap_remove(i % n));
            }
            Op::RecordStream { buffer, stream } if !live.is_empty() && alive[stream] => {
                let n = live.len();
                alloc.record_stream(&live[buffer % n].0, streams[stream]).unwrap();
            }
            Op::Launch { buffer, stream, delay_us, write } if !live.is_empty() && alive[stream] => {
                let n = live.len();
                let (b, users) = &mut live[buffer % n];
                let s = streams[stream];
                for &u in users.iter().filter(|&&u| u != s) {
                    let e = dev.create_event().unwrap();
                    if dev.record_event(e, u).is_ok() {
                        dev.wait_event(s, e).unwrap();
                    }
                    dev.destroy_event(e).unwrap();
                }
                if s != b.stream() {
                    alloc.record_stream(b, s).unwrap();
                }
                if !users.contains(&s) {
                    users.push(s);
                }
                let kind = if write { AccessKind::Write } else { AccessKind::Read };
                let k = Kernel {
                    name: "touch",
                    accesses: vec![Access { ptr: b.ptr(), bytes: b.len().max(1), kind }],
                    sleep: Duration::from_micros(delay_us),
                    body: None,
                    replay: None,
                };
                if !b.is_empty() {
                    dev.launch(s, k).unwrap();
                }
            }
            Op::WaitEvent { from, to } if alive[from] && alive[to] => {
                let e = dev.create_event().unwrap();
                dev.record_event(e, streams[from]).unwrap();
                dev.wait_event(streams[to], e).unwrap();
                dev.destroy_event(e).unwrap();
            }
            Op::Destroy(i) if alive[i] => {
                alloc.destroy_stream(streams[i]).unwrap();
                alive[i] = false;
            }
            Op::EmptyCache => alloc.empty_cache().unwrap(),
            _ => {}
        }
        alloc.check_invariants().map_err(TestCaseError::fail)?;
        prop_assert_eq!(dev.violations(), vec![]);
    }
    live.clear();
    alloc.synchronize().unwrap();
    dev.synchronize().unwrap();
    alloc.check_invariants().map_err(TestCaseError::fail)?;
    prop_assert_eq!(alloc.stats().blocks.active_bytes.all.current, 0);
    prop_assert_eq!(dev.violations(), vec![]);
    prop_assert_eq!(dev.kernel_failures(), vec![]);
    drop(alloc);
    prop_assert!(dev.live_segments().is_empty(), "leaked {:?}", dev.live_segments());
    prop_assert_eq!(dev.live_mappings(), vec![]);
    prop_assert_eq!((dev.physical_bytes(), dev.live_physical(), dev.virtual_bytes()), (0, 0, 0));
    prop_assert_eq!(dev.violations(), vec![]);
    Ok(())
}

proptest! {
    // `PROPTEST_CASES` raises the count for a long hunt.
    #![proptest_config(ProptestConfig {
        cases: std::env::var("PROPTEST_CASES").ok().and_then(|c| c.parse().ok()).unwrap_or(48),
        ..ProptestConfig::default()
    })]

    #[test]
    fn strict_programs_are_stream_ordered(ops in prop::collection::vec(op(), 1..80)) {
        run("cross_stream:strict", ops)?;
    }

    #[test]
    fn wait_event_programs_are_stream_ordered(ops in prop::collection::vec(op(), 1..80)) {
        run("cross_stream:wait_event", ops)?;
    }

    #[test]
    fn strict_expandable_programs_are_stream_ordered(ops in prop::collection::vec(op(), 1..80)) {
        run("cross_stream:strict,expandable_segments:true", ops)?;
    }

    #[test]
    fn wait_event_expandable_programs_are_stream_ordered(ops in prop::collection::vec(op(), 1..80)) {
        run("cross_stream:wait_event,expandable_segments:true", ops)?;
    }

    #[test]
    fn trimming_expandable_programs_are_stream_ordered(ops in prop::collection::vec(op(), 1..80)) {
        run("cross_stream:wait_event,expandable_segments:true,release_threshold_mb:0", ops)?;
    }
}
