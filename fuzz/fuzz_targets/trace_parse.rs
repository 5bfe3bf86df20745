//! Fuzz target `trace_parse`: arbitrary bytes into every trace reader (tidepool CSV, RMM log,
//! PyTorch pickle, gzip), which must give a valid trace or an error, never a panic.
//! The harness is `tidepool_fuzzing::trace_parse`, so `cargo test` replays the corpus too.
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| tidepool_fuzzing::trace_parse(data));
