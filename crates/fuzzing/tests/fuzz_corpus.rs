//! Replays every committed fuzz input through its harness under plain `cargo test`: the seed
//! and minimized corpora in `fuzz/corpus/<target>/` and every crash ever found, kept as a
//! regression input in `fuzz/artifacts/<target>/`. The harnesses are the ones the cargo-fuzz
//! targets call (`tidepool_fuzzing`), so a bug fixed once stays fixed without libFuzzer.

use std::panic::{AssertUnwindSafe, catch_unwind};
use std::path::{Path, PathBuf};

/// Smallest seed corpus accepted per target.
const MIN_CORPUS: usize = 50;

/// The regular files of `dir` (none if it does not exist), in name order.
fn inputs(dir: &Path) -> Vec<PathBuf> {
    let Ok(entries) = std::fs::read_dir(dir) else { return Vec::new() };
    let mut files: Vec<PathBuf> = entries
        .map(|e| e.expect("readable directory entry").path())
        .filter(|p| {
            p.is_file() && !p.file_name().is_some_and(|n| n.to_string_lossy().starts_with('.'))
        })
        .collect();
    files.sort();
    files
}

fn replay(target: &str, harness: fn(&[u8])) {
    let fuzz = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../fuzz");
    let corpus = inputs(&fuzz.join("corpus").join(target));
    let artifacts = inputs(&fuzz.join("artifacts").join(target));
    assert!(
        corpus.len() >= MIN_CORPUS,
        "fuzz/corpus/{target} holds {} inputs, fewer than {MIN_CORPUS}",
        corpus.len()
    );
    let mut failed = Vec::new();
    for path in corpus.iter().chain(&artifacts) {
        let data = std::fs::read(path).expect("readable input");
        if catch_unwind(AssertUnwindSafe(|| harness(&data))).is_err() {
            failed.push(path.display().to_string());
        }
    }
    assert!(failed.is_empty(), "{target}: {} inputs fail:\n{}", failed.len(), failed.join("\n"));
    println!("{target}: replayed {} corpus inputs and {} artifacts", corpus.len(), artifacts.len());
}

#[test]
fn allocator_ops_corpus_and_artifacts() {
    replay("allocator_ops", tidepool_fuzzing::allocator_ops);
}

/// The same inputs on a device with its sanitizer off, as on a real GPU
/// (`Program::quiet`): hits and frees then take the inlined paths that the sanitizer's hooks
/// bypass, and the reference model checks them after every step all the same.
#[test]
fn allocator_ops_corpus_and_artifacts_without_the_sanitizer() {
    use tidepool_fuzzing::program::Program;
    replay("allocator_ops", |data| {
        let program = Program { quiet: true, ..Program::decode(data) };
        if let Err(e) =
            tidepool_fuzzing::run_program(&program, tidepool_fuzzing::Options::default())
        {
            panic!("allocator_ops without the sanitizer: {e}");
        }
    });
}

#[test]
fn config_parse_corpus_and_artifacts() {
    replay("config_parse", tidepool_fuzzing::config_parse);
}

#[test]
fn trace_parse_corpus_and_artifacts() {
    replay("trace_parse", tidepool_fuzzing::trace_parse);
}

/// Artifacts that stand as the test of a fix: each passes (above), and fails with the fix's
/// broken mode on, with the check named here in its failure (or the panic named here: a bug
/// whose symptom is a panic inside the allocator).
#[test]
fn artifacts_catch_their_broken_modes() {
    use tidepool::hooks::Broken;
    let cases = [
        (
            "crash-failed-growth-drops-retiring-moved-pages",
            Broken::UnsettledMoves,
            "reserved_bytes",
        ),
        // A learning run's exit whose join of its runs fails midway laid its region out over
        // bins naming a segment the join had removed: the pool's slab panics.
        ("crash-failed-join-leaves-stale-bins", Broken::StaleJoinBins, "invalid key"),
        // A named scope's run reused a transient block from a persistent ordinary segment
        // (placed there while segments shared free space) after `expandable_segments` was
        // turned on mid-run.
        (
            "crash-scope-reuses-persistent-block-over-ranges",
            Broken::LocalReuseAcrossRanges,
            "sits in a segment of stream 0, Persistent",
        ),
    ];
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../fuzz/artifacts/allocator_ops");
    for (name, mode, check) in cases {
        let data = std::fs::read(dir.join(name)).expect("readable artifact");
        let program = tidepool_fuzzing::program::Program::decode(&data);
        let options = tidepool_fuzzing::Options { broken: Some(mode), ..Default::default() };
        let err = match catch_unwind(AssertUnwindSafe(|| {
            tidepool_fuzzing::run_program(&program, options)
        })) {
            Ok(result) => result.expect_err("the broken mode is caught"),
            Err(panic) => panic
                .downcast_ref::<&str>()
                .map(|s| s.to_string())
                .or_else(|| panic.downcast_ref::<String>().cloned())
                .unwrap_or_default(),
        };
        assert!(err.contains(check), "{name} with {mode:?}: {err}");
    }
}
