//! Loom models of tidepool's lock-free protocols live in `tests/`; run them with
//! `RUSTFLAGS="--cfg loom" cargo test -p tidepool-loom-tests --release`.
