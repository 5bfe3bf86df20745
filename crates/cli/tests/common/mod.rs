//! What the `tidepool` binary's test files share (a module, not a test target): running the
//! binary, its standard error as text, and a scratch folder per test.

#![allow(dead_code)] // each test target uses part of it

use std::process::{Command, Output};

/// Runs the built `tidepool` binary with `args`.
pub fn tidepool(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_tidepool")).args(args).output().expect("run tidepool")
}

/// What it wrote to standard error.
pub fn stderr(o: &Output) -> String {
    String::from_utf8_lossy(&o.stderr).into_owned()
}

/// A folder for one test's files (`test` names it), removed when dropped (pass or fail).
pub fn scratch(test: &str) -> tempfile::TempDir {
    tempfile::Builder::new().prefix(&format!("tidepool-cli-{test}-")).tempdir().unwrap()
}
