//! Every deliberate bug (`Broken`, feature `test-hooks`) has a test that turns it on: the
//! stream-order modes through `tests/multi_props.rs` (`Broken::STREAM_ORDER`, each shown to be
//! caught there), every other mode by name in some test file of the workspace. A mode that no
//! test turns on would be a fix whose regression nothing catches.

use std::path::{Path, PathBuf};
use tidepool::hooks::Broken;

/// The Rust files under `dir`, recursively.
fn rust_files(dir: &Path, out: &mut Vec<PathBuf>) {
    let Ok(entries) = std::fs::read_dir(dir) else { return };
    for entry in entries.flatten() {
        let path = entry.path();
        if path.is_dir() {
            rust_files(&path, out);
        } else if path.extension().is_some_and(|e| e == "rs") {
            out.push(path);
        }
    }
}

/// The test sources of the workspace: the core crate's tests, the loom models and every
/// member crate's tests.
fn test_sources() -> Vec<(PathBuf, String)> {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let mut files = Vec::new();
    rust_files(&root.join("tests"), &mut files);
    rust_files(&root.join("loom-tests"), &mut files);
    let crates = std::fs::read_dir(root.join("crates")).expect("crates/ is readable");
    for member in crates.flatten() {
        rust_files(&member.path().join("tests"), &mut files);
    }
    files
        .into_iter()
        .filter(|p| !p.ends_with("broken_modes.rs"))
        .map(|p| {
            let text = std::fs::read_to_string(&p).expect("a test source is readable");
            (p, text)
        })
        .collect()
}

#[test]
fn every_mode_is_listed_once_with_a_bit_of_its_own() {
    let mut bits = 0u64;
    for (i, mode) in Broken::EVERY.iter().enumerate() {
        assert_eq!(mode.position(), i, "{mode:?} is out of place in Broken::EVERY");
        let bit = *mode as u64;
        assert_eq!(bit.count_ones(), 1, "{mode:?} is not one bit");
        assert_eq!(bits & bit, 0, "{mode:?} shares its bit");
        bits |= bit;
    }
    for &mode in Broken::STREAM_ORDER {
        assert!(Broken::EVERY.contains(&mode));
    }
}

#[test]
fn every_mode_is_turned_on_by_a_test() {
    let sources = test_sources();
    assert!(
        sources.iter().any(|(p, _)| p.ends_with("multi_props.rs")),
        "the property test that covers Broken::STREAM_ORDER is missing"
    );
    let untested: Vec<Broken> = Broken::EVERY
        .into_iter()
        .filter(|mode| !Broken::STREAM_ORDER.contains(mode))
        .filter(|mode| {
            let name = format!("Broken::{mode:?}");
            // The name followed by something other than an identifier character, so that
            // `Broken::Gc` would not count for `Broken::GcPersistent`.
            !sources.iter().any(|(_, text)| {
                text.match_indices(&name).any(|(at, _)| {
                    let next = text[at + name.len()..].chars().next();
                    !next.is_some_and(|c| c.is_alphanumeric() || c == '_')
                })
            })
        })
        .collect();
    assert!(untested.is_empty(), "no test turns on {untested:?}");
}
