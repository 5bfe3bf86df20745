//! Writes the seed corpora of the fuzz targets: `cargo run -p tidepool-fuzzing --example fuzz_seeds --
//! fuzz/corpus` (from the repository root).
//!
//! ```text
//!   fuzz/corpus/allocator_ops/seed-*  hand-written scenarios (cross-stream reuse, OOM ladder,
//!                                     injected faults, stream destroy, config switches, scopes:
//!                                     repeated and diverging named runs, escapes freed in the
//!                                     next run or later, used on other streams, …) and
//!                                     pseudo-random programs over every capacity × config, and
//!                                     with scope operations over every capacity
//!   fuzz/corpus/config_parse/seed-*   every key with good, bad and edge values, combinations
//!   fuzz/corpus/trace_parse/seed-*    slices of the shipped traces (plain and gzipped), RMM logs,
//!                                     the PyTorch snapshot fixture and cuts of it, broken inputs
//! ```
//!
//! Seeds are named after what they hold; a run overwrites seeds of the same name and leaves other
//! files (inputs the fuzzer found, kept after `cargo fuzz cmin`) alone.

use flate2::Compression;
use flate2::read::GzDecoder;
use flate2::write::GzEncoder;
use std::io::{Read, Write};
use std::path::{Path, PathBuf};
use tidepool::hooks::KEYS;
use tidepool::{MAX_REQUEST, MIB};
use tidepool_fuzzing::program::{
    CAPACITIES, CONFIGS, FAIL_ABOVE, MAX_OPS, Op, Program, SLEEPS_US, STREAM_SLOTS,
};

fn main() -> std::io::Result<()> {
    let out = PathBuf::from(std::env::args().nth(1).unwrap_or_else(|| "fuzz/corpus".into()));
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let mut n = 0;
    for (target, seeds) in [
        ("allocator_ops", allocator_seeds()),
        ("config_parse", config_seeds()),
        ("trace_parse", trace_seeds(root)?),
    ] {
        let dir = out.join(target);
        std::fs::create_dir_all(&dir)?;
        for (name, bytes) in &seeds {
            std::fs::write(dir.join(format!("seed-{name}")), bytes)?;
        }
        println!("{target}: {} seeds in {}", seeds.len(), dir.display());
        n += seeds.len();
    }
    println!("{n} seeds");
    Ok(())
}

fn alloc(bytes: u64, stream: u8) -> Op {
    Op::Alloc { bytes, stream, persistent: false }
}

fn keep(bytes: u64, stream: u8) -> Op {
    Op::Alloc { bytes, stream, persistent: true }
}

fn launch(index: u8, stream: u8) -> Op {
    Op::Launch { index, stream, write: true, sleep_us: 5 }
}

/// The sizes of the three unbound buffers of one [`scope_run`]; the last one escapes.
const RUN_A: [u64; 3] = [8 * MIB, 2 * MIB + 1, 3 * MIB];
const RUN_B: [u64; 3] = [700, 12 * MIB, 3 * MIB];

/// One run of a scope on `stream` (named or not), with `base` older buffers at the front of
/// the live list: an unbound buffer of `sizes[0]` and one of 4096 bytes (used by a kernel), a
/// burst of bound buffers drawn from `seed`, the first freed, one of `sizes[1]`, the second
/// freed, one of `sizes[2]` (which escapes), the third freed, exit.
fn scope_run(base: u8, stream: u8, named: bool, sizes: [u64; 3], seed: u32) -> Vec<Op> {
    use Op::*;
    vec![
        ScopeEnter { stream, named },
        ScopeAlloc { bytes: sizes[0] },
        ScopeAlloc { bytes: 4096 },
        Launch { index: base + 1, stream, write: true, sleep_us: 1 },
        ScopeBurst { n: 6, seed },
        Free { index: base },
        ScopeAlloc { bytes: sizes[1] },
        Free { index: base },
        ScopeAlloc { bytes: sizes[2] },
        Free { index: base },
        ScopeExit,
    ]
}

/// A named run on the default stream: `scope_run(base, 0, true, sizes, 42)`.
fn named_run(base: u8, sizes: [u64; 3]) -> Vec<Op> {
    scope_run(base, 0, true, sizes, 42)
}

/// `runs` concatenated.
fn seq(runs: Vec<Vec<Op>>) -> Vec<Op> {
    runs.concat()
}

fn scenario(capacity: u8, config: u8, ops: Vec<Op>) -> Vec<u8> {
    encode(&Program {
        capacity,
        config,
        explicit_teardown: false,
        late_streams: false,
        quiet: false,
        handles_first: false,
        ops,
    })
}

/// Encodes a program whose operands are all in range (it decodes back to itself).
fn encode(p: &Program) -> Vec<u8> {
    let bytes = p.encode();
    assert_eq!(&Program::decode(&bytes), p, "an operand out of range");
    bytes
}

fn allocator_seeds() -> Vec<(String, Vec<u8>)> {
    use Op::*;
    let named: Vec<(&str, Vec<u8>)> = vec![
        (
            "same-stream-reuse",
            scenario(
                1,
                0,
                vec![alloc(1000, 0), Free { index: 0 }, alloc(1000, 0), Inspect { summary: true }],
            ),
        ),
        (
            "zero-and-absurd",
            scenario(
                1,
                0,
                vec![
                    alloc(0, 0),
                    alloc(u64::MAX, 1),
                    alloc(MAX_REQUEST, 0),
                    alloc(MAX_REQUEST + 1, 2),
                    Free { index: 0 },
                ],
            ),
        ),
        (
            "split-and-coalesce",
            scenario(
                1,
                0,
                vec![
                    alloc(512, 0),
                    alloc(1024, 0),
                    alloc(4096, 0),
                    Free { index: 1 },
                    Free { index: 0 },
                    alloc(1536, 0),
                    Free { index: 0 },
                    Free { index: 0 },
                    EmptyCache,
                ],
            ),
        ),
        (
            "large-pool",
            scenario(
                1,
                0,
                vec![
                    alloc(3 * MIB, 0),
                    alloc(5 * MIB, 0),
                    Free { index: 0 },
                    alloc(2 * MIB + 1, 0),
                    alloc(12 * MIB, 0),
                    Free { index: 2 },
                    EmptyCache,
                ],
            ),
        ),
        (
            "record-stream-strict",
            scenario(
                1,
                0,
                vec![
                    alloc(4096, 1),
                    launch(0, 2),
                    Free { index: 0 },
                    alloc(4096, 0),
                    alloc(4096, 1),
                    Synchronize,
                ],
            ),
        ),
        (
            "record-stream-wait-event",
            scenario(
                1,
                1,
                vec![
                    alloc(3 * MIB, 1),
                    launch(0, 2),
                    launch(0, 0),
                    Free { index: 0 },
                    alloc(3 * MIB, 2),
                    EmptyCache,
                    Synchronize,
                ],
            ),
        ),
        (
            "cross-stream-segment",
            scenario(
                1,
                1,
                vec![
                    alloc(12 * MIB, 1),
                    Free { index: 0 },
                    Sleep { stream: 1, sleep_us: 5 },
                    alloc(12 * MIB, 2),
                    Free { index: 0 },
                    alloc(12 * MIB, 0),
                ],
            ),
        ),
        (
            "oom-ladder",
            scenario(
                0,
                0,
                vec![
                    alloc(30 * MIB, 0),
                    alloc(30 * MIB, 1),
                    Free { index: 0 },
                    alloc(40 * MIB, 2),
                    alloc(60 * MIB, 0),
                    alloc(100 * MIB, 0),
                ],
            ),
        ),
        (
            "oom-with-pending",
            scenario(
                0,
                0,
                vec![
                    alloc(40 * MIB, 1),
                    launch(0, 2),
                    Free { index: 0 },
                    alloc(40 * MIB, 0),
                    FailEventQueries { on: true },
                    alloc(40 * MIB, 1),
                ],
            ),
        ),
        (
            "fail-nth-malloc",
            scenario(
                1,
                0,
                vec![
                    FailNthMalloc { n: 1 },
                    alloc(1000, 0),
                    FailNthMalloc { n: 2 },
                    alloc(3 * MIB, 0),
                    alloc(12 * MIB, 1),
                    alloc(100, 2),
                ],
            ),
        ),
        (
            "fail-above",
            scenario(
                1,
                0,
                vec![
                    FailMallocsAbove { limit: Some(2 * MIB) },
                    alloc(100, 0),
                    alloc(3 * MIB, 0),
                    FailMallocsAbove { limit: None },
                    alloc(3 * MIB, 0),
                ],
            ),
        ),
        (
            "fail-event-queries",
            scenario(
                1,
                0,
                vec![
                    FailEventQueries { on: true },
                    alloc(4096, 1),
                    launch(0, 2),
                    Free { index: 0 },
                    alloc(4096, 2),
                    EmptyCache,
                    FailEventQueries { on: false },
                    EmptyCache,
                ],
            ),
        ),
        (
            "destroy-with-live",
            scenario(
                1,
                0,
                vec![
                    alloc(4096, 1),
                    alloc(3 * MIB, 1),
                    launch(0, 2),
                    DestroyStream { stream: 1 },
                    Free { index: 0 },
                    alloc(4096, 2),
                    Free { index: 0 },
                    alloc(3 * MIB, 0),
                ],
            ),
        ),
        (
            "destroy-default",
            scenario(
                1,
                0,
                vec![
                    alloc(4096, 0),
                    Free { index: 0 },
                    DestroyStream { stream: 0 },
                    alloc(4096, 0),
                ],
            ),
        ),
        (
            "destroy-user-stream",
            scenario(
                1,
                0,
                vec![
                    alloc(4096, 2),
                    launch(0, 1),
                    Free { index: 0 },
                    DestroyStream { stream: 1 },
                    alloc(4096, 1),
                    DestroyStream { stream: 2 },
                ],
            ),
        ),
        (
            "release-stream",
            scenario(
                1,
                0,
                vec![
                    alloc(4096, 1),
                    alloc(3 * MIB, 1),
                    Free { index: 0 },
                    Free { index: 0 },
                    ReleaseStream { stream: 1 },
                    alloc(4096, 2),
                ],
            ),
        ),
        (
            "persistent-survives",
            scenario(
                1,
                0,
                vec![
                    keep(3 * MIB, 0),
                    alloc(3 * MIB, 0),
                    Free { index: 0 },
                    Free { index: 0 },
                    EmptyCache,
                    ReleasePersistent,
                ],
            ),
        ),
        (
            "config-switch",
            scenario(
                1,
                0,
                vec![
                    alloc(1000, 0),
                    SetConfig { config: 3 },
                    alloc(1_200_000, 0),
                    SetConfig { config: 8 },
                    alloc(300, 0),
                    SetConfig { config: 2 },
                    alloc(50 * MIB, 0),
                    Free { index: 3 },
                    alloc(30 * MIB, 0),
                ],
            ),
        ),
        (
            "max-split",
            scenario(
                2,
                2,
                vec![
                    alloc(64 * MIB, 0),
                    Free { index: 0 },
                    alloc(45 * MIB, 0),
                    alloc(2 * MIB, 0),
                    Free { index: 0 },
                ],
            ),
        ),
        (
            "memory-limit",
            scenario(
                2,
                6,
                vec![
                    alloc(60 * MIB, 0),
                    alloc(30 * MIB, 1),
                    alloc(30 * MIB, 0),
                    Free { index: 0 },
                    alloc(30 * MIB, 0),
                ],
            ),
        ),
        ("memory-fraction", scenario(1, 7, vec![alloc(100 * MIB, 0), alloc(100 * MIB, 0)])),
        (
            "small-segments",
            scenario(
                1,
                8,
                vec![alloc(300, 0), alloc(MIB, 0), alloc(MIB + 1, 0), alloc(11 * MIB, 0)],
            ),
        ),
        (
            "wait-event-ops",
            scenario(
                1,
                1,
                vec![
                    alloc(4096, 1),
                    Sleep { stream: 1, sleep_us: 5 },
                    WaitEvent { from: 1, to: 2 },
                    launch(0, 2),
                    DeviceSynchronize,
                    Free { index: 0 },
                ],
            ),
        ),
        (
            "many-streams-churn",
            scenario(
                2,
                5,
                (0..40)
                    .map(|i| {
                        if i % 3 == 2 {
                            Free { index: i }
                        } else {
                            alloc(512 << (i % 14), i % STREAM_SLOTS)
                        }
                    })
                    .collect(),
            ),
        ),
        (
            "graph-capture-outside-ladder",
            // A buffer freed after a use on another stream (its free waits on an event), then a
            // capture during which the other stream asks for more than the device has left:
            // the expandable out-of-memory ladder, which a capture forbids to wait.
            scenario(
                0,
                9,
                vec![
                    alloc(8 << 20, 2),
                    launch(0, 1),
                    Free { index: 0 },
                    Capture { stream: 1, fork: 0, bytes: 16 << 20, launches: 1, panics: false },
                    EmptyCache,
                ],
            ),
        ),
        (
            "graph-capture-forked",
            // A live buffer used on the side stream first; then captures with and without a
            // forked stream, under ordinary and expandable segments, replayed.
            scenario(
                1,
                0,
                vec![
                    alloc(4096, 1),
                    launch(0, 2),
                    Capture { stream: 1, fork: 2, bytes: 4096, launches: 2, panics: false },
                    Capture { stream: 2, fork: 0, bytes: 3 << 20, launches: 1, panics: false },
                    SetConfig { config: 9 },
                    Capture { stream: 2, fork: 1, bytes: 700_000, launches: 2, panics: false },
                    Free { index: 0 },
                    EmptyCache,
                ],
            ),
        ),
        (
            "throw-on-oom-and-no-split",
            // `throw_on_cudamalloc_oom` under a 96 MiB cap on a 1 GiB device: a third 40 MiB
            // request is refused at once, the cache kept, and served once a buffer went; then
            // with expandable segments under half the device, a third 200 MiB growth refused;
            // then captures into graph pools that never split (4 MiB + stream 2 ≡ 0 mod 3) and
            // that do.
            scenario(
                2,
                19,
                vec![
                    alloc(40 << 20, 0),
                    alloc(40 << 20, 1),
                    alloc(40 << 20, 0),
                    Free { index: 0 },
                    alloc(40 << 20, 0),
                    SetConfig { config: 20 },
                    alloc(200 << 20, 2),
                    alloc(200 << 20, 2),
                    alloc(200 << 20, 2),
                    Capture { stream: 2, fork: 0, bytes: 4 << 20, launches: 2, panics: false },
                    Capture { stream: 1, fork: 2, bytes: 4 << 20, launches: 1, panics: false },
                    EmptyCache,
                ],
            ),
        ),
        (
            "graph-capture-panics",
            // Capture bodies that panic (`Allocator::capture`): forked and joined back, left
            // forked, not forked; then an ordinary capture on the same streams, and a live
            // buffer used on both.
            scenario(
                1,
                0,
                vec![
                    alloc(4096, 1),
                    Capture { stream: 1, fork: 2, bytes: 4096, launches: 1, panics: true },
                    Capture { stream: 2, fork: 1, bytes: 3 << 20, launches: 0, panics: true },
                    SetConfig { config: 9 },
                    Capture { stream: 2, fork: 0, bytes: 700_000, launches: 2, panics: true },
                    Capture { stream: 1, fork: 2, bytes: 4096, launches: 2, panics: false },
                    launch(0, 2),
                    Free { index: 0 },
                    EmptyCache,
                ],
            ),
        ),
        (
            "handles-first",
            // Buffers of both allocators, used on other streams, an escaped unbound scope
            // buffer and a capture's pool gone before: the handles go first, and the closed
            // allocators must return each segment or page as its last buffer goes.
            encode(&Program {
                capacity: 1,
                config: 1,
                explicit_teardown: false,
                late_streams: false,
                quiet: false,
                handles_first: true,
                ops: vec![
                    alloc(4096, 0),
                    alloc(3 << 20, 1),
                    alloc(12 << 20, 2),
                    RecordStream { index: 1, stream: 2 },
                    launch(1, 2),
                    ScopeEnter { stream: 1, named: true },
                    ScopeAlloc { bytes: 2 << 20 },
                    ScopeExit,
                    Other { index: 9, action: 0 },
                    Capture { stream: 1, fork: 2, bytes: 4096, launches: 1, panics: false },
                    alloc(6 << 20, 2),
                    Free { index: 0 },
                ],
            }),
        ),
        (
            "huge-device",
            scenario(
                3,
                0,
                vec![
                    alloc(16 << 30, 0),
                    alloc(1 << 40, 1),
                    alloc(40 << 30, 2),
                    Free { index: 0 },
                    alloc(30 << 30, 0),
                ],
            ),
        ),
    ];
    let mut seeds: Vec<(String, Vec<u8>)> =
        named.into_iter().chain(scope_seeds()).map(|(n, b)| (n.to_string(), b)).collect();
    seeds.push((
        "explicit-teardown".into(),
        encode(&Program {
            capacity: 1,
            config: 1,
            explicit_teardown: true,
            late_streams: false,
            quiet: false,
            handles_first: false,
            ops: vec![keep(3 * MIB, 1), alloc(12 * MIB, 2), alloc(100, 0)],
        }),
    ));
    // Streams past the 64 fast-path slots (the harness's head start): the slots re-tagged for
    // the program's streams, buffers that outlived their streams freed after the re-tag, a
    // destroyed stream's slot taken again, the default stream's slot shared.
    for (name, config, teardown) in
        [("late-streams", 0, false), ("late-streams-expandable", 9, true)]
    {
        let ops = vec![
            alloc(4096, 1),
            alloc(4096, 2),
            Free { index: 2 },
            alloc(4096, 1),
            Free { index: 0 },
            launch(0, 2),
            Free { index: 0 },
            DestroyStream { stream: 1 },
            alloc(4096, 1),
            alloc(3 * MIB, 1),
            DestroyStream { stream: 2 },
            alloc(4096, 2),
            alloc(4096, 0),
            Free { index: 1 },
            alloc(8192, 2),
        ];
        let p = Program {
            capacity: 1,
            config,
            explicit_teardown: teardown,
            late_streams: true,
            quiet: false,
            handles_first: false,
            ops,
        };
        seeds.push((name.into(), encode(&p)));
    }
    // Pseudo-random programs over every capacity × config, mixing every operation.
    let mut rng = 0x9e37_79b9_7f4a_7c15u64;
    let mut next = move || {
        rng ^= rng << 13;
        rng ^= rng >> 7;
        rng ^= rng << 17;
        rng
    };
    for capacity in 0..CAPACITIES.len() as u8 {
        for config in 0..CONFIGS.len() as u8 {
            let ops = (0..24)
                .map(|_| {
                    let r = next();
                    let (a, b) = ((r >> 8) as u8, (r >> 16) as u8 % STREAM_SLOTS);
                    let sleep_us = SLEEPS_US[(r >> 24) as usize % SLEEPS_US.len()];
                    match r % 20 {
                        0..=5 => {
                            let sizes = [
                                0,
                                1,
                                700,
                                64 << 10,
                                MIB,
                                MIB + 1,
                                5 * MIB,
                                11 * MIB,
                                48 * MIB,
                                1 << 30,
                            ];
                            Op::Alloc {
                                bytes: sizes[(r >> 32) as usize % sizes.len()],
                                stream: b,
                                persistent: r & 1 << 40 != 0,
                            }
                        }
                        6..=9 => Free { index: a },
                        10..=11 => {
                            Launch { index: a, stream: b, write: r & 1 << 41 != 0, sleep_us }
                        }
                        12 => RecordStream { index: a, stream: b },
                        13 => WaitEvent { from: b, to: a % STREAM_SLOTS },
                        14 => Sleep { stream: b, sleep_us },
                        15 => [
                            Synchronize,
                            EmptyCache,
                            ReleasePersistent,
                            DeviceSynchronize,
                            Inspect { summary: true },
                        ][a as usize % 5]
                            .clone(),
                        16 => [ReleaseStream { stream: b }, DestroyStream { stream: b }]
                            [a as usize % 2]
                            .clone(),
                        17 => SetConfig { config: a % CONFIGS.len() as u8 },
                        18 => [FailNthMalloc { n: a % 5 }, FailEventQueries { on: a & 1 == 1 }]
                            [b as usize % 2]
                            .clone(),
                        _ => FailMallocsAbove { limit: FAIL_ABOVE[a as usize % FAIL_ABOVE.len()] },
                    }
                })
                .collect();
            let p = Program {
                capacity,
                config,
                explicit_teardown: next() & 1 == 1,
                late_streams: false,
                quiet: false,
                handles_first: false,
                ops,
            };
            seeds.push((format!("random-cap{capacity}-config{config}"), encode(&p)));
        }
    }
    // Pseudo-random programs with scopes: runs of a few scope templates, repeated with small
    // changes, escapes freed at random, other operations between.
    for capacity in 0..CAPACITIES.len() as u8 {
        for variant in 0..3u8 {
            let mut ops = Vec::new();
            while ops.len() < 44 {
                let r = next();
                let (a, b) = ((r >> 8) as u8, (r >> 16) as u8 % STREAM_SLOTS);
                match r % 12 {
                    0..=5 => {
                        let sizes = if r & 1 << 20 == 0 { RUN_A } else { RUN_B };
                        let stream = if variant == 0 { 0 } else { b };
                        let mut run = scope_run(a % 3, stream, r & 1 << 21 == 0, sizes, 42);
                        if r & 3 << 22 == 0 {
                            run.truncate(5 + (a as usize % 5)); // diverges, stays open
                        }
                        ops.extend(run);
                    }
                    6..=8 => ops.push(Free { index: a }),
                    9 => ops.push(Launch { index: a, stream: b, write: true, sleep_us: 1 }),
                    10 => ops.push(RecordStream { index: a, stream: b }),
                    _ => ops.push(
                        [EmptyCache, Synchronize, SetConfig { config: a % 3 }, ScopeExit]
                            [b as usize % 4]
                            .clone(),
                    ),
                }
            }
            ops.truncate(MAX_OPS);
            let p = Program {
                capacity,
                config: variant,
                explicit_teardown: next() & 1 == 1,
                late_streams: false,
                quiet: false,
                handles_first: false,
                ops,
            };
            seeds.push((format!("random-scoped-cap{capacity}-{variant}"), encode(&p)));
        }
    }
    seeds
}

/// Scenarios with scopes (see [`scope_run`] for the live list each run leaves: its escape).
fn scope_seeds() -> Vec<(&'static str, Vec<u8>)> {
    use Op::*;
    let free0 = || vec![Free { index: 0 }];
    vec![
        (
            // Each escape is freed before the next run: runs 2.. follow the plan.
            "scope-named-repeat",
            scenario(
                1,
                0,
                seq(vec![
                    named_run(0, RUN_A),
                    free0(),
                    named_run(0, RUN_A),
                    free0(),
                    named_run(0, RUN_A),
                    free0(),
                    named_run(0, RUN_A),
                ]),
            ),
        ),
        (
            // The previous escape is freed inside the next run (after it opened).
            "scope-escape-freed-in-next-run",
            scenario(
                1,
                0,
                seq(vec![
                    named_run(0, RUN_A),
                    vec![ScopeEnter { stream: 0, named: true }, Free { index: 0 }],
                    named_run(0, RUN_A)[1..].to_vec(),
                    vec![ScopeEnter { stream: 0, named: true }, Free { index: 0 }],
                    named_run(0, RUN_A)[1..].to_vec(),
                    free0(),
                    named_run(0, RUN_A),
                ]),
            ),
        ),
        (
            // Escapes freed two runs later: their slices stay pinned for a run.
            "scope-late-escape-free",
            scenario(
                1,
                0,
                seq(vec![
                    named_run(0, RUN_A),
                    named_run(1, RUN_A),
                    free0(),
                    named_run(1, RUN_A),
                    free0(),
                    named_run(1, RUN_A),
                    free0(),
                    free0(),
                    named_run(0, RUN_A),
                ]),
            ),
        ),
        (
            // Runs that diverge from the plan (other sizes, another burst), relearn, repeat.
            "scope-diverging-runs",
            scenario(
                1,
                0,
                seq(vec![
                    named_run(0, RUN_A),
                    free0(),
                    named_run(0, RUN_B),
                    free0(),
                    named_run(0, RUN_B),
                    free0(),
                    scope_run(0, 0, true, RUN_B, 7),
                    free0(),
                    named_run(0, RUN_A),
                ]),
            ),
        ),
        (
            // An escape used on other streams (record_stream, kernels) while later runs plan.
            "scope-escape-record-stream",
            scenario(
                1,
                0,
                seq(vec![
                    named_run(0, RUN_A),
                    vec![
                        RecordStream { index: 0, stream: 1 },
                        Launch { index: 0, stream: 2, write: true, sleep_us: 5 },
                    ],
                    named_run(1, RUN_A),
                    vec![Launch { index: 1, stream: 1, write: false, sleep_us: 5 }],
                    free0(),
                    named_run(1, RUN_A),
                    free0(),
                    free0(),
                    named_run(0, RUN_A),
                    vec![Launch { index: 0, stream: 1, write: true, sleep_us: 1 }],
                    free0(),
                    named_run(0, RUN_A),
                ]),
            ),
        ),
        (
            // Named scopes on several streams (one plan each) and anonymous ones between.
            "scope-streams",
            scenario(
                1,
                1,
                seq(vec![
                    scope_run(0, 1, true, RUN_A, 1),
                    scope_run(1, 2, true, RUN_B, 2),
                    scope_run(2, 0, false, RUN_A, 3),
                    vec![Launch { index: 1, stream: 0, write: true, sleep_us: 5 }],
                    free0(),
                    free0(),
                    scope_run(1, 1, true, RUN_A, 1),
                    free0(),
                    scope_run(1, 2, false, RUN_B, 2),
                    free0(),
                    free0(),
                ]),
            ),
        ),
        (
            // Configuration switches inside and between runs; a cache flush between runs.
            "scope-config-switch",
            scenario(
                1,
                0,
                seq(vec![
                    named_run(0, RUN_A),
                    vec![ScopeEnter { stream: 0, named: true }, ScopeAlloc { bytes: 1_200_000 }],
                    vec![SetConfig { config: 3 }, ScopeAlloc { bytes: 1_200_000 }],
                    vec![ScopeBurst { n: 8, seed: 9 }, SetConfig { config: 8 }],
                    vec![ScopeBurst { n: 8, seed: 9 }, ScopeExit, EmptyCache],
                    vec![Free { index: 0 }, Free { index: 0 }, Free { index: 0 }],
                    named_run(0, RUN_A),
                    vec![ReleaseStream { stream: 0 }, Synchronize],
                    free0(),
                    named_run(0, RUN_A),
                ]),
            ),
        ),
        (
            // A stream destroyed with a scope open on it (the scope ends first), escapes left.
            "scope-destroy-stream",
            scenario(
                1,
                0,
                seq(vec![
                    scope_run(0, 1, true, RUN_A, 5),
                    vec![ScopeEnter { stream: 1, named: true }, ScopeAlloc { bytes: 8 * MIB }],
                    vec![DestroyStream { stream: 1 }, ScopeAlloc { bytes: 4096 }],
                    vec![Free { index: 0 }, DestroyStream { stream: 1 }],
                    scope_run(1, 1, true, RUN_A, 5),
                    vec![Free { index: 0 }, Free { index: 0 }, EmptyCache],
                ]),
            ),
        ),
        (
            // A small device: regions and bursts run out of memory.
            "scope-oom",
            scenario(
                0,
                0,
                seq(vec![
                    named_run(0, [30 * MIB, 20 * MIB, 12 * MIB]),
                    vec![Alloc { bytes: 20 * MIB, stream: 1, persistent: false }],
                    named_run(2, [30 * MIB, 20 * MIB, 12 * MIB]),
                    vec![Free { index: 0 }, Free { index: 1 }],
                    named_run(1, [30 * MIB, 20 * MIB, 12 * MIB]),
                    vec![ScopeEnter { stream: 0, named: true }, ScopeAlloc { bytes: 60 * MIB }],
                ]),
            ),
        ),
        (
            // Injected faults while the plan's region is made and served.
            "scope-faults",
            scenario(
                1,
                0,
                seq(vec![
                    vec![FailNthMalloc { n: 2 }],
                    named_run(0, RUN_A),
                    vec![FailMallocsAbove { limit: Some(2 * MIB) }, Free { index: 0 }],
                    named_run(0, RUN_B),
                    vec![FailMallocsAbove { limit: None }, FailNthMalloc { n: 1 }],
                    free0(),
                    named_run(0, RUN_B),
                    vec![FailEventQueries { on: true }, RecordStream { index: 0, stream: 1 }],
                    free0(),
                    named_run(0, RUN_B),
                ]),
            ),
        ),
        (
            // Zero-byte and absurd scoped requests; a scope left open at the end.
            "scope-zero-and-absurd",
            encode(&Program {
                capacity: 2,
                config: 0,
                explicit_teardown: true,
                late_streams: false,
                quiet: false,
                handles_first: false,
                ops: vec![
                    ScopeEnter { stream: 2, named: true },
                    ScopeAlloc { bytes: 0 },
                    ScopeAlloc { bytes: u64::MAX },
                    ScopeAlloc { bytes: MAX_REQUEST + 1 },
                    ScopeAlloc { bytes: 1 << 40 },
                    ScopeAlloc { bytes: 512 },
                    ScopeBurst { n: 1, seed: 0 },
                    ScopeExit,
                    ScopeEnter { stream: 2, named: true },
                    ScopeAlloc { bytes: 0 },
                    ScopeAlloc { bytes: 512 },
                    ScopeBurst { n: 1, seed: 0 },
                ],
            }),
        ),
        (
            // The second allocator: its buffers used with use_on, and buffers of each given to
            // the other in free_batch, record_stream and use_on (all refused).
            "two-allocators-foreign",
            scenario(
                1,
                1,
                vec![
                    alloc(4096, 1),
                    Other { index: 9, action: 0 },
                    Other { index: 18, action: 0 },
                    Other { index: 2, action: 2 },
                    Other { index: 11, action: 2 },
                    Other { index: 0, action: 4 },
                    Other { index: 1, action: 3 },
                    alloc(4096, 1),
                    Other { index: 0, action: 3 },
                    Other { index: 0, action: 1 },
                    alloc(4096, 1),
                ],
            ),
        ),
        (
            // Planned scoped buffers read on another stream and forgotten, run after run.
            "scope-forget-used",
            scenario(
                1,
                0,
                (0..3)
                    .flat_map(|_| {
                        vec![
                            ScopeEnter { stream: 1, named: true },
                            Sleep { stream: 2, sleep_us: 5 },
                            ScopeForget { bytes: 4096, used: true, stream: 2 },
                            ScopeBurst { n: 2, seed: 3 },
                            ScopeForget { bytes: 3 << 20, used: false, stream: 0 },
                            ScopeExit,
                            alloc(4096, 1),
                        ]
                    })
                    .collect(),
            ),
        ),
    ]
}

fn config_seeds() -> Vec<(String, Vec<u8>)> {
    let mut seeds: Vec<String> = vec![
        String::new(),
        " , ,".into(),
        "max_split_size_mb:256,roundup_power2_divisions:4".into(),
        "max_split_size_mb:256, roundup_power2_divisions:8,min_block_size:1024,small_size_mb:2,small_segment_mb:4,large_segment_mb:40,min_large_alloc_mb:20,round_large_mb:4,memory_limit_mb:4096,per_process_memory_fraction:0.5,cross_stream:wait_event,".into(),
        "max_split_size_mb".into(),
        "max_split_size_mb:20".into(),
        "small_size_mb:16".into(),
        "min_large_alloc_mb:1".into(),
        "bogus:1".into(),
        "max_split_size:256".into(),
        "cross_stream:lazy".into(),
        "cross_stream : wait_event".into(),
        "\u{feff}cross_stream:strict".into(),
        "per_process_memory_fraction:NaN".into(),
        "per_process_memory_fraction:inf".into(),
        "per_process_memory_fraction:1e-320".into(),
        "per_process_memory_fraction:-0".into(),
        "min_block_size:1,roundup_power2_divisions:64".into(),
        "min_block_size:1048576,small_size_mb:1".into(),
        "round_large_mb:1024,min_large_alloc_mb:65536,large_segment_mb:65536".into(),
        "max_split_size_mb:268435456,memory_limit_mb:268435456".into(),
        "max_split_size_mb:268435457".into(),
        "memory_limit_mb:99999999999999999999".into(),
        "roundup_power2_divisions:0x10".into(),
        "max_split_size_mb:+64".into(),
        "a:b:c".into(),
        ":".into(),
        ",,:,,".into(),
        "cross_stream:wait_event,cross_stream:strict".into(),
    ];
    let values = [
        "0",
        "1",
        "2",
        "3",
        "4",
        "20",
        "64",
        "1024",
        "65536",
        "-1",
        "1.5",
        "abc",
        "",
        " 8 ",
        "18446744073709551616",
        "0.5",
        "strict",
        "wait_event",
    ];
    for (key, _) in KEYS {
        for v in values {
            seeds.push(format!("{key}:{v}"));
        }
    }
    seeds.into_iter().enumerate().map(|(i, s)| (format!("{i:03}"), s.into_bytes())).collect()
}

fn gzip(data: &[u8]) -> Vec<u8> {
    let mut gz = GzEncoder::new(Vec::new(), Compression::default());
    gz.write_all(data).expect("writing to memory");
    gz.finish().expect("writing to memory")
}

fn trace_seeds(root: &Path) -> std::io::Result<Vec<(String, Vec<u8>)>> {
    let mut seeds: Vec<(String, Vec<u8>)> = Vec::new();
    for name in ["mlp_train", "gpt2_train"] {
        let gz = std::fs::read(root.join(format!("../../data/traces/{name}.csv.gz")))?;
        let mut csv = String::new();
        GzDecoder::new(&gz[..]).read_to_string(&mut csv)?;
        let lines: Vec<&str> = csv.lines().collect();
        for n in [2, 5, 12, 30, 80, 200] {
            let slice = lines[..n.min(lines.len())].join("\n") + "\n";
            seeds.push((format!("{name}-head{n}.csv"), slice.clone().into_bytes()));
            if n == 30 || n == 200 {
                seeds.push((format!("{name}-head{n}.csv.gz"), gzip(slice.as_bytes())));
            }
        }
        // A window from the middle: frees of ids allocated before it (invalid on its own).
        let mid = lines.len() / 2;
        let window = std::iter::once(lines[0]).chain(lines[mid..mid + 40].iter().copied());
        seeds.push((
            format!("{name}-middle.csv"),
            (window.collect::<Vec<_>>().join("\n") + "\n").into_bytes(),
        ));
    }
    seeds.push((
        "mlp_train.csv.gz".into(),
        std::fs::read(root.join("../../data/traces/mlp_train.csv.gz"))?,
    ));
    let tp = "seq,op,id,bytes,stream,tag\n";
    for (name, body) in [
        (
            "scopes",
            "0,alloc,0,1024,0,param\n1,scope_enter,0,0,0,step\n2,alloc,1,512,1,act\n3,free,1,512,1,act\n4,scope_exit,0,0,0,step\n",
        ),
        (
            "nested-scopes",
            "0,scope_enter,0,0,0,outer\n1,scope_enter,1,0,0,inner\n2,scope_exit,1,0,0,inner\n3,scope_exit,0,0,0,outer\n",
        ),
        ("unbalanced-scope", "0,scope_enter,0,0,0,s\n"),
        ("double-free", "0,alloc,0,1,0,act\n1,free,0,1,0,act\n2,free,0,1,0,act\n"),
        ("free-unknown", "0,free,9,1,0,act\n"),
        ("size-mismatch", "0,alloc,0,100,0,act\n1,free,0,99,0,act\n"),
        ("bad-number", "0,alloc,0,-1,0,act\n"),
        (
            "huge-sizes",
            "0,alloc,0,18446744073709551615,0,act\n1,alloc,1,18446744073709551615,0,act\n",
        ),
        ("unknown-op", "0,realloc,0,1,0,act\n"),
        ("unknown-tag", "0,alloc,0,1,0,weights\n"),
        ("extra-column", "0,alloc,0,1,0,act,x\n"),
        ("missing-column", "0,alloc,0,1\n"),
        ("crlf", "0,alloc,0,1,0,act\r\n1,free,0,1,0,act\r\n"),
        ("blank-lines", "\n\n0,alloc,0,1,0,act\n\n"),
    ] {
        seeds.push((format!("tidepool-{name}.csv"), format!("{tp}{body}").into_bytes()));
    }
    seeds
        .push(("tidepool-bom.csv".into(), format!("\u{feff}{tp}0,alloc,0,1,0,act\n").into_bytes()));
    let rmm = "Thread,Time,Action,Pointer,Size,Stream\n";
    for (name, body) in [
        (
            "reuse-streams-failure",
            "1979932,14:21:19.998533,allocate,0x7f8a40000000,1024,0x0\n1979932,14:21:19.998601,allocate,0x7f8a40000400,2048,0x5633c0ffee00\n1979932,14:21:19.998700,allocate failure,0x0,1099511627776,0x0\n1980043,14:21:32.661875,free,0x7f8a40000000,1024,0x0\n1980043,14:21:32.661900,allocate,0x7f8a40000000,512,0x7f00aa\n1980043,14:21:32.662000,deallocate,0x7f8a40000400,2048,0x5633c0ffee00\n1980043,14:21:32.662100,allocate,0x7f8a40000800,64,0\n",
        ),
        ("free-unknown", "1,t,free,0x10,8,0x0\n"),
        ("double-alloc", "1,t,allocate,0x10,8,0x0\n1,t,allocate,0x10,8,0x0\n"),
        ("decimal-pointer", "1,t,allocate,4096,8,0\n1,t,free,4096,8,0\n"),
        (
            "huge-size",
            "1,t,allocate,0x1,18446744073709551615,0x7\n1,t,allocate,0x2,18446744073709551615,0x7\n",
        ),
        ("bad-action", "1,t,reallocate,0x1,8,0x0\n"),
    ] {
        seeds.push((format!("rmm-{name}.csv"), format!("{rmm}{body}").into_bytes()));
    }
    let pickle = std::fs::read(root.join("../trace/tests/fixtures/pytorch_snapshot.pickle"))?;
    seeds.push(("pytorch_snapshot.pickle".into(), pickle.clone()));
    seeds.push(("pytorch_snapshot.pickle.gz".into(), gzip(&pickle)));
    for cut in [2, 16, 64, 256, pickle.len() / 2, pickle.len() - 1] {
        seeds.push((format!("pytorch_snapshot-cut{cut}.pickle"), pickle[..cut].to_vec()));
    }
    for (name, bytes) in [
        ("empty", &b""[..]),
        ("gzip-magic-only", b"\x1f\x8b"),
        ("pickle-proto-only", b"\x80\x04"),
        ("pickle-deep-lists", b"\x80\x04]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]."),
        ("pickle-empty-dict", b"\x80\x04}."),
        ("wrong-header", b"a,b,c\n1,2,3\n"),
        ("binary", b"\x00\x01\x02\xff\xfe\xfd"),
    ] {
        seeds.push((name.into(), bytes.to_vec()));
    }
    Ok(seeds)
}
