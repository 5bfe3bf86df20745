//! The `tidepool` command line.
fn main() {
    eprintln!("tidepool: not yet wired");
}
