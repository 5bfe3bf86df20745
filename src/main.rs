//! The `tidepool` command line; see [`tidepool::trace::cli`].
fn main() {
    tidepool::trace::cli::main()
}
