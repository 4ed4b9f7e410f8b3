//! The `kvtier` command line.

mod cli;

// The linker keeps a crate's tier registrations only when the binary names the crate.
use tier_cpu as _;
use tier_disk as _;
use tier_example as _;
use tier_p2p as _;
use tier_redis as _;

fn main() -> std::process::ExitCode {
    cli::main()
}
