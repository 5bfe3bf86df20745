//! Fuzz target `allocator_ops`: a program of allocator, stream, scope and fault-injection
//! operations, run on the sanitized SimDevice (or with the sanitizer off, bit 2 of the flags
//! byte, as on a real GPU) and checked against a reference model after every step.
//! The harness is `tidepool_fuzzing::allocator_ops`, so `cargo test` replays the corpus too.
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| tidepool_fuzzing::allocator_ops(data));
