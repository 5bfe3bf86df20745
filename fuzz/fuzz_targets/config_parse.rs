//! Fuzz target `config_parse`: arbitrary text into `Config::parse`, which must give a valid
//! config or a clear error, never a panic.
//! The harness is `tidepool_fuzzing::config_parse`, so `cargo test` replays the corpus too.
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| tidepool_fuzzing::config_parse(data));
