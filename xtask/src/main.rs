//! `cargo xtask`: the only entry point a fresh machine needs.
//!
//! Every command that builds calls [`setup::ensure`] first, so a machine with nothing but
//! rustup and a stable toolchain gets the pinned nightly and `bpf-linker` on first use.
//!
//! Modules import only those below them: `kernels` and `test` → `package` → `build` →
//! `cross` → `setup` → `cmd` → `paths`.

mod bpffs;
mod build;
mod cmd;
mod cross;
mod kernels;
mod package;
mod paths;
mod setup;
mod test;

use anyhow::Result;
use clap::{Parser, Subcommand};

#[derive(Parser)]
#[command(
    name = "cargo xtask",
    about = "limiter's build, run, test and bench commands"
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Install what is missing: the pinned nightly with rust-src, bpf-linker, cargo-deb, the
    /// tools the tests drive (iproute2, mosquitto, systemd-analyze, promtool, redis-server,
    /// redis-cli), and what test-kernels needs (qemu, busybox, cpio, Debian's kernel packages).
    Setup,
    /// Build the eBPF object and the agent (release) into target/release/limiter, or with
    /// `--target aarch64` into target/aarch64-unknown-linux-gnu/release/limiter.
    Build {
        /// Cross-build the agent for this target (the eBPF object is the same).
        #[arg(long, value_enum)]
        target: Option<cross::Target>,
    },
    /// Build, then run `limiter run` as root with the given arguments.
    Run {
        /// Arguments passed to `limiter run`.
        #[arg(trailing_var_arg = true, allow_hyphen_values = true)]
        args: Vec<String>,
    },
    /// Build the Debian package (agent, mosquitto plugin, unit, config, man page).
    Package,
    /// Formatting, clippy, unit tests, the eBPF build and the privileged tests.
    Test,
    /// The differential test (kernel against its reference model) at length, as root.
    Fuzz {
        /// Frames in all, split between the differential test's seven configurations.
        #[arg(long, default_value_t = 2_000_000)]
        frames: u64,
        /// The PRNG seed; from the clock if not given (printed either way).
        #[arg(long)]
        seed: Option<u64>,
    },
    /// Boot the agent and the privileged tests on every supported kernel this machine can
    /// get (the host's, and Debian's under qemu); prints a kernel × result table.
    TestKernels {
        /// Only this architecture's rows (the host's kernel counts as amd64).
        #[arg(long, value_enum)]
        arch: Option<kernels::Arch>,
    },
    /// Benchmarks that print figures beside an anchor measured in the same run.
    Bench {
        /// Also write the run's figures into `docs/benchmarks.md`, in place of the suite's
        /// section there.
        #[arg(long, global = true)]
        write: bool,
        #[command(subcommand)]
        suite: BenchSuite,
    },
}

#[derive(Subcommand)]
enum BenchSuite {
    /// Nanoseconds per packet of each datapath path under BPF_PROG_TEST_RUN.
    Kernel,
    /// Application-layer checks per second, in process and over the Unix socket.
    App,
    /// CPU time per SYN of a SYN flood over a veth. By default to a closed port: limiter beside
    /// a drop-everything XDP program, the kernel alone, nftables and iptables, from 1 and 10,000
    /// sources unless told otherwise. With `--spoofed`, from a fresh random source per SYN to a
    /// listening port: limiter's SYN cookies beside the floor, limiter without cookies, the
    /// kernel's own cookies and iptables SYNPROXY.
    Flood {
        /// The closed-port flood's numbers of source addresses, one table row each (the
        /// bench's default: 1 and 10,000).
        #[arg(long, value_delimiter = ',', conflicts_with = "spoofed")]
        sources: Vec<u32>,
        /// The spoofed flood SYN cookies are for, instead of the closed port.
        #[arg(long)]
        spoofed: bool,
    },
}

fn main() -> Result<()> {
    match Cli::parse().command {
        Command::Setup => {
            setup::ensure()?;
            setup::ensure_cargo_deb()?;
            setup::ensure_test_tools()?;
            setup::ensure_bench_tools()?;
            kernels::setup()?;
            println!(
                "setup: the pinned nightly, its components, bpf-linker, cargo-deb, the test and bench tools and the boot-test kernels are in place"
            );
            Ok(())
        }
        Command::Build { target: None } => build::all().map(|_| ()),
        Command::Build {
            target: Some(target),
        } => build::cross(target).map(|_| ()),
        Command::Run { args } => build::run(&args),
        Command::Package => package::build().map(|_| ()),
        Command::Test => test::run(),
        Command::Fuzz { frames, seed } => test::fuzz(frames, seed),
        Command::TestKernels { arch } => kernels::run(arch),
        Command::Bench { write, suite } => {
            let page = match write {
                true => Some((paths::benchmarks_page(), test::measured_commit()?)),
                false => None,
            };
            let page = page.as_ref();
            match suite {
                BenchSuite::Kernel => test::bench_kernel(page),
                BenchSuite::App => test::bench_app(page),
                BenchSuite::Flood { sources, spoofed } => {
                    test::bench_flood(&sources, spoofed, page)
                }
            }
        }
    }
}
