//! The `tidepool` command line: `demo` (see `demo.rs`) here, everything else in
//! [`tidepool::trace::cli`].
mod demo;

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    if args.first().map(String::as_str) == Some("demo") {
        let code =
            demo::run(&args[1..], &mut std::io::stdout().lock(), &mut std::io::stderr().lock());
        std::process::exit(code);
    }
    tidepool::trace::cli::main()
}
