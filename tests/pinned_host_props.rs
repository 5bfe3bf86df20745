//! proptest: random programs over pinned host buffers on the asynchronous SimDevice — allocate
//! (by size class), fill, upload to and download from per-stream device buffers, read back,
//! drop, hold or release streams with gates, process events, empty the cache — checked against
//! a byte model. Copies really run later than they are enqueued (behind gates), so a block reused
//! too early, a slice handed out over a running copy, or two copies racing on one buffer shows
//! up as wrong bytes or a sanitizer violation. After every step the allocator's figures match a
//! recount; after the run nothing leaks.

use proptest::prelude::*;
mod common;
use common::device_bytes;
use std::sync::Arc;
use std::sync::mpsc;
use tidepool::MIB;
use tidepool::device::{Access, AccessKind, Kernel, Launch, SimDevice};
use tidepool::{Allocator, Buffer, Config, Device, HostAllocator, PinnedBuffer, StreamId};

const STREAMS: usize = 3;
/// Bytes of each stream's device buffer (≥ the largest pinned request).
const DEV_BYTES: u64 = 5000;

#[derive(Clone, Debug)]
enum Op {
    Alloc { bytes: u64, fill: u8 },
    Fill { buffer: usize, fill: u8 },
    Upload { buffer: usize, stream: usize },
    Download { buffer: usize, stream: usize },
    Check(usize),
    Drop(usize),
    Gate(usize),
    Open(usize),
    ProcessEvents,
    EmptyCache,
}

fn op() -> impl Strategy<Value = Op> {
    let idx = || any::<prop::sample::Index>().prop_map(|i| i.index(usize::MAX));
    prop_oneof![
        6 => (prop_oneof![1u64..=600, 1000u64..=5000], any::<u8>())
            .prop_map(|(bytes, fill)| Op::Alloc { bytes, fill }),
        2 => (idx(), any::<u8>()).prop_map(|(buffer, fill)| Op::Fill { buffer, fill }),
        5 => (idx(), 0..STREAMS).prop_map(|(buffer, stream)| Op::Upload { buffer, stream }),
        4 => (idx(), 0..STREAMS).prop_map(|(buffer, stream)| Op::Download { buffer, stream }),
        2 => idx().prop_map(Op::Check),
        4 => idx().prop_map(Op::Drop),
        3 => (0..STREAMS).prop_map(Op::Gate),
        2 => (0..STREAMS).prop_map(Op::Open),
        1 => Just(Op::ProcessEvents),
        1 => Just(Op::EmptyCache),
    ]
}

fn run(ops: Vec<Op>, broken: bool) -> Result<(), TestCaseError> {
    let dev = Arc::new(SimDevice::backed(64 * MIB));
    let streams: Vec<StreamId> = std::iter::once(StreamId::DEFAULT)
        .chain((1..STREAMS).map(|_| dev.create_stream().unwrap()))
        .collect();
    let alloc = Allocator::new(dev.clone(), Config::default()).unwrap();
    let pinned = HostAllocator::new(dev.clone());
    pinned.set_broken_skip_events(broken);
    // Each stream's device buffer and its modelled bytes.
    let gpu: Vec<Buffer<SimDevice>> =
        streams.iter().map(|&s| alloc.alloc(DEV_BYTES, s).unwrap()).collect();
    let mut gpu_model = vec![vec![0u8; DEV_BYTES as usize]; STREAMS];
    for (b, &s) in gpu.iter().zip(&streams) {
        let zero = Kernel::new(
            "zero",
            vec![Access { ptr: b.ptr(), bytes: DEV_BYTES, kind: AccessKind::Write }],
            {
                let p = b.ptr();
                move |m| m.write(p, &[0u8; DEV_BYTES as usize]).unwrap()
            },
        );
        dev.launch(s, zero).unwrap();
    }
    let mut gates: Vec<Option<mpsc::Sender<()>>> = (0..STREAMS).map(|_| None).collect();
    let open_all = |gates: &mut Vec<Option<mpsc::Sender<()>>>| {
        for g in gates.iter_mut() {
            if let Some(tx) = g.take() {
                let _ = tx.send(());
            }
        }
    };
    let mut live: Vec<(PinnedBuffer<SimDevice>, Vec<u8>)> = Vec::new();
    for op in ops {
        match op {
            Op::Alloc { bytes, fill } => {
                let mut b = pinned.alloc(bytes).unwrap();
                prop_assert_eq!(b.block_size(), bytes.next_power_of_two().max(512));
                // A new buffer has no copy recorded: writing never waits (gates stay closed).
                prop_assert!(b.pending_streams().is_empty());
                b.as_mut_slice().unwrap().fill(fill);
                live.push((b, vec![fill; bytes as usize]));
            }
            Op::Fill { buffer, fill } if !live.is_empty() => {
                open_all(&mut gates); // as_mut_slice may wait for a held copy
                let n = live.len();
                let (b, model) = &mut live[buffer % n];
                b.as_mut_slice().unwrap().fill(fill);
                model.fill(fill);
            }
            Op::Upload { buffer, stream } if !live.is_empty() => {
                let n = live.len();
                let (b, model) = &mut live[buffer % n];
                b.upload(&gpu[stream]).unwrap();
                gpu_model[stream][..model.len()].copy_from_slice(model);
            }
            Op::Download { buffer, stream } if !live.is_empty() => {
                let n = live.len();
                let (b, model) = &mut live[buffer % n];
                b.download(&gpu[stream]).unwrap();
                let len = model.len();
                model.copy_from_slice(&gpu_model[stream][..len]);
            }
            Op::Check(i) if !live.is_empty() => {
                open_all(&mut gates); // as_slice may wait for a held download
                let n = live.len();
                let (b, model) = &live[i % n];
                prop_assert_eq!(b.as_slice().unwrap(), &model[..]);
            }
            Op::Drop(i) if !live.is_empty() => {
                let n = live.len();
                drop(live.swap_remove(i % n));
            }
            Op::Gate(s) if gates[s].is_none() => {
                let (tx, rx) = mpsc::channel::<()>();
                dev.launch(
                    streams[s],
                    Kernel::new("gate", vec![], move |_| {
                        let _ = rx.recv();
                    }),
                )
                .unwrap();
                gates[s] = Some(tx);
            }
            Op::Open(s) => {
                if let Some(tx) = gates[s].take() {
                    let _ = tx.send(());
                }
            }
            Op::ProcessEvents => pinned.process_events().unwrap(),
            Op::EmptyCache => pinned.empty_cache().unwrap(),
            _ => {}
        }
        pinned.check_invariants().map_err(TestCaseError::fail)?;
        prop_assert_eq!(dev.violations(), vec![]);
    }
    open_all(&mut gates);
    for (b, model) in &live {
        prop_assert_eq!(b.as_slice().unwrap(), &model[..]);
    }
    for (b, model) in gpu.iter().zip(&gpu_model) {
        prop_assert_eq!(&device_bytes(&dev, b), model);
    }
    drop(live);
    dev.synchronize().unwrap();
    pinned.empty_cache().unwrap();
    prop_assert_eq!(pinned.stats().reserved_bytes.current, 0);
    prop_assert_eq!(dev.host_reserved_bytes(), 0);
    prop_assert_eq!(dev.violations(), vec![]);
    prop_assert_eq!(dev.kernel_failures(), vec![]);
    Ok(())
}

proptest! {
    // `PROPTEST_CASES` raises the count for a long hunt.
    #![proptest_config(ProptestConfig {
        cases: std::env::var("PROPTEST_CASES").ok().and_then(|c| c.parse().ok()).unwrap_or(64),
        ..ProptestConfig::default()
    })]

    #[test]
    fn random_pinned_programs_keep_bytes_and_stream_order(ops in prop::collection::vec(op(), 1..60)) {
        run(ops, false)?;
    }
}

/// The same checks catch the deliberately broken mode (blocks reused without waiting for their
/// copies' events) on a program that reuses a block while its upload is held.
#[test]
fn the_checks_catch_the_broken_mode() {
    let program = vec![
        Op::Gate(1),
        Op::Alloc { bytes: 512, fill: 1 },
        Op::Upload { buffer: 0, stream: 1 },
        Op::Drop(0),
        Op::Alloc { bytes: 512, fill: 2 },
    ];
    run(program.clone(), false).unwrap();
    let err = run(program, true).expect_err("the broken mode must be caught");
    assert!(err.to_string().contains("host write"), "{err}");
}
