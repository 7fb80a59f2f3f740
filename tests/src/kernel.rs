//! The datapath loaded for `BPF_PROG_TEST_RUN`: settings given as `limiter run` flags.

use aya::{
    TestRun,
    programs::{SchedClassifier, TestRunOptions, Xdp},
};
use std::sync::Arc;

use clap::Parser;
use limiter::{
    buckets::{Limiter, LimiterConfig},
    datapath::{
        Datapath, Enforcer, LoadOptions, PacketCount, TC_PROGRAM, XDP_PROGRAM, XdpAttachMode,
    },
    run,
    services::sweeper::{PassReport, SweepStats, Sweeper},
    settings::{Live, RunArgs, Settings},
};
use limiter_common::{Direction, Reason, Verdict};

use crate::frames::{self, Tcp};

pub const XDP_DROP: u32 = 1;
pub const XDP_PASS: u32 = 2;
pub const XDP_TX: u32 = 3;
pub const TC_ACT_OK: u32 = 0;

#[derive(Parser)]
struct Flags {
    #[command(flatten)]
    run: RunArgs,
}

/// Parses `limiter run` flags into settings, as the agent would.
pub fn settings(flags: &[&str]) -> Settings {
    let mut argv = vec!["limiter"];
    argv.extend_from_slice(flags);
    Flags::try_parse_from(argv)
        .expect("valid flags")
        .run
        .resolve()
        .expect("valid settings")
}

/// How `limiter run` would load the programs for `settings` (table sizes, debug log), with no
/// pins: the datapath is the test's alone and goes with it.
pub fn unpinned(settings: &Settings) -> LoadOptions {
    LoadOptions {
        pin_dir: None,
        ..run::load_options(&settings.restart)
    }
}

/// Runs `frame` through the XDP program of `dp` once.
pub fn xdp_run(dp: &Datapath, frame: &[u8]) -> XdpRun {
    let prog: &Xdp = dp
        .ebpf()
        .program(XDP_PROGRAM)
        .expect("the XDP program")
        .try_into()
        .expect("an XDP program");
    let mut out = vec![0u8; frame.len() + 256];
    let result = prog
        .test_run(TestRunOptions {
            data_in: Some(frame),
            data_out: Some(&mut out),
            ..Default::default()
        })
        .expect("BPF_PROG_TEST_RUN");
    out.truncate(result.data_size_out as usize);
    XdpRun {
        action: result.return_value,
        frame: out,
    }
}

/// Runs one of the agent's helper programs (`limiter_release`, `limiter_adjust`, ...) with
/// `request` as its input, through a shared `dp`, so a test can run it on one thread while
/// another sends frames; returns its answer (one of `limiter_common::helper`'s).
pub fn helper_run<T: aya::Pod>(dp: &Datapath, name: &str, request: &T) -> u32 {
    let prog: &Xdp = dp
        .ebpf()
        .program(name)
        .expect("the helper program")
        .try_into()
        .expect("an XDP program");
    // SAFETY: `T: Pod` is plain data with no padding the compiler adds.
    let bytes = unsafe {
        std::slice::from_raw_parts((request as *const T).cast::<u8>(), std::mem::size_of::<T>())
    };
    prog.test_run(TestRunOptions {
        data_in: Some(bytes),
        ..Default::default()
    })
    .expect("BPF_PROG_TEST_RUN")
    .return_value
}

/// Runs `frame` through the egress TC program of `dp` once; returns the TC action.
pub fn tc_run(dp: &Datapath, frame: &[u8]) -> u32 {
    tc_run_marked(dp, frame, 0)
}

/// Runs `frame` through the egress TC program of `dp` once as an skb carrying `mark`;
/// returns the TC action.
pub fn tc_run_marked(dp: &Datapath, frame: &[u8], mark: u32) -> u32 {
    let prog: &SchedClassifier = dp
        .ebpf()
        .program(TC_PROGRAM)
        .expect("the TC program")
        .try_into()
        .expect("a TC program");
    // The head of a `struct __sk_buff`: `len` and `pkt_type` (zero, as the kernel requires of
    // a test run's context), then `mark`; the kernel reads no further than it is given.
    let mut ctx = [0u8; 12];
    ctx[8..].copy_from_slice(&mark.to_ne_bytes());
    prog.test_run(TestRunOptions {
        data_in: Some(frame),
        ctx_in: Some(&ctx),
        ..Default::default()
    })
    .expect("BPF_PROG_TEST_RUN")
    .return_value
}

/// Runs `syn` through the XDP program of `dp` and, if it passed, the rest of its handshake
/// (the host's SYN-ACK through TC, the client's ACK through XDP), as a client that connects
/// would; returns the SYN's action.
pub fn connect_run(dp: &Datapath, syn: &Tcp) -> u32 {
    let action = xdp_run(dp, &syn.build()).action;
    if action == XDP_PASS {
        let h = handshake(syn, isn(syn.sport));
        tc_run(dp, &h.syn_ack);
        xdp_run(dp, &h.ack);
    }
    action
}

pub struct Kernel {
    pub dp: Datapath,
}

/// One run of the XDP program.
pub struct XdpRun {
    pub action: u32,
    /// The frame as the program left it (the RST reply for `XDP_TX`).
    pub frame: Vec<u8>,
}

/// The handshake's segments after the SYN, as the host and the client send them.
pub struct Handshake {
    pub syn_ack: Vec<u8>,
    pub ack: Vec<u8>,
}

/// The SYN-ACK the host answers `syn` with (ISN `isn`) and the client's ACK of it.
pub fn handshake(syn: &Tcp, isn: u32) -> Handshake {
    let mut syn_ack = syn.reply(frames::Flags {
        syn: true,
        ack: true,
        ..frames::Flags::default()
    });
    syn_ack.seq = isn;
    syn_ack.ack = syn.seq.wrapping_add(1);
    let mut ack = syn.with_flags(frames::Flags {
        ack: true,
        ..frames::Flags::default()
    });
    ack.seq = syn.seq.wrapping_add(1);
    ack.ack = isn.wrapping_add(1);
    ack.tcp_options = false;
    Handshake {
        syn_ack: syn_ack.build(),
        ack: ack.build(),
    }
}

/// A server ISN for the test connection on `port`, spread like a real one.
pub fn isn(port: u16) -> u32 {
    u32::from(port).wrapping_mul(0x9E37_79B9) ^ 0x5A5A_0000
}

impl Kernel {
    /// SYN, the host's SYN-ACK (through the TC program) and the client's ACK; returns the run
    /// of the ACK.
    pub fn connect(&self, syn: &Tcp) -> XdpRun {
        self.xdp(&syn.build());
        let h = handshake(syn, isn(syn.sport));
        self.tc(&h.syn_ack);
        self.xdp(&h.ack)
    }

    /// Loads the programs (attached nowhere) and applies `flags` to their maps.
    pub fn new(flags: &[&str]) -> Self {
        let settings = settings(flags);
        let mut dp = Datapath::load(unpinned(&settings)).expect("loading the programs");
        dp.maps
            .apply(&settings.policy)
            .expect("applying the settings");
        Self { dp }
    }

    pub fn xdp(&self, frame: &[u8]) -> XdpRun {
        xdp_run(&self.dp, frame)
    }

    pub fn tc(&self, frame: &[u8]) -> u32 {
        tc_run(&self.dp, frame)
    }

    /// [`Kernel::tc`] for an skb carrying `mark`.
    pub fn tc_marked(&self, frame: &[u8], mark: u32) -> u32 {
        tc_run_marked(&self.dp, frame, mark)
    }

    pub fn packets(&self, direction: Direction, verdict: Verdict, reason: Reason) -> u64 {
        self.dp.maps.packets(direction, verdict, reason).unwrap()
    }

    pub fn ingress(&self, verdict: Verdict, reason: Reason) -> u64 {
        self.packets(Direction::Ingress, verdict, reason)
    }

    pub fn global(&self) -> u64 {
        self.dp.maps.global_connections().unwrap()
    }

    /// Every packet counter, to show that a path moved none.
    pub fn all_packets(&self) -> Vec<PacketCount> {
        self.dp.maps.packet_counts().unwrap()
    }
}

/// The programs loaded with `flags` applied and attached (native XDP) to the server end of
/// `pair`, from inside its namespace.
pub fn attach_server(pair: &crate::netns::Pair, flags: &[&str]) -> anyhow::Result<Datapath> {
    let settings = settings(flags);
    pair.server.run(|| {
        let mut dp = Datapath::load(unpinned(&settings))?;
        dp.maps.apply(&settings.policy)?;
        dp.attach(&pair.server_if, XdpAttachMode::Native)?;
        anyhow::Ok(dp)
    })?
}

/// The programs attached to the server end of a fresh namespace pair, with `flags` applied.
pub struct Attached {
    pub dp: Datapath,
    /// See [`peer`]; `None` for a bare peer.
    _peer: Option<Datapath>,
    pub pair: crate::netns::Pair,
}

/// Attaches the programs, unconfigured (they protect no port and pass everything), to the
/// client end of `pair`: a veth delivers `XDP_TX` frames only to a peer with NAPI running,
/// which an XDP program on the peer turns on. Keep the result alive as long as the pair.
pub fn peer(pair: &crate::netns::Pair) -> anyhow::Result<Datapath> {
    pair.client.run(|| {
        let mut dp = Datapath::load(LoadOptions::default())?;
        dp.attach(&pair.client_if, XdpAttachMode::Native)?;
        anyhow::Ok(dp)
    })?
}

impl Attached {
    /// With a NAPI peer (see [`peer`]).
    pub fn new(flags: &[&str]) -> anyhow::Result<Self> {
        Self::with_peer(flags, true)
    }

    /// With a bare peer: nothing attached to the client's end of the veth.
    pub fn bare(flags: &[&str]) -> anyhow::Result<Self> {
        Self::with_peer(flags, false)
    }

    /// With a NAPI peer, `prepare` run on the namespaces before the programs load (to set the
    /// server's sysctls, which the agent reads as it attaches).
    pub fn prepared(
        flags: &[&str],
        prepare: impl FnOnce(&crate::netns::Pair) -> anyhow::Result<()>,
    ) -> anyhow::Result<Self> {
        let pair = crate::netns::Pair::new()?;
        prepare(&pair)?;
        Self::on(pair, flags, true)
    }

    fn with_peer(flags: &[&str], napi_peer: bool) -> anyhow::Result<Self> {
        Self::on(crate::netns::Pair::new()?, flags, napi_peer)
    }

    fn on(pair: crate::netns::Pair, flags: &[&str], napi_peer: bool) -> anyhow::Result<Self> {
        let dp = attach_server(&pair, flags)?;
        let peer = if napi_peer { Some(peer(&pair)?) } else { None };
        Ok(Self {
            dp,
            _peer: peer,
            pair,
        })
    }

    pub fn global(&self) -> u64 {
        self.dp.maps.global_connections().unwrap()
    }

    /// Waits (bounded) until the kernel's global count reads `want`; returns the last reading.
    /// A client's `connect` returns once its ACK is sent, a moment before XDP counts it.
    pub fn wait_global(&self, want: u64) -> u64 {
        wait_for(want, || self.global())
    }

    /// Waits (bounded) until `src`'s count reads `want`; returns the last reading.
    pub fn wait_source(&self, src: std::net::IpAddr, want: u64) -> u64 {
        wait_for(want, || self.dp.maps.source_connections(src).unwrap())
    }
}

/// Polls `read` (for at most five seconds) until it returns `want`; returns the last reading.
pub fn wait_for<T: PartialEq>(want: T, mut read: impl FnMut() -> T) -> T {
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(5);
    loop {
        let now = read();
        if now == want || std::time::Instant::now() > deadline {
            return now;
        }
        std::thread::sleep(std::time::Duration::from_millis(10));
    }
}

/// A real agent's parts (programs loaded, attached nowhere) as `limiter run` wires them, for
/// tests that drive the services directly.
pub struct TestAgent {
    pub enforcer: Arc<Enforcer>,
    pub limiter: Arc<Limiter>,
    pub settings: Live,
    pub sweep: SweepStats,
    /// Holds the agent's own state file, so no test reads the bans another left, nor the host's.
    _state: tempfile::TempDir,
}

impl std::ops::Deref for TestAgent {
    type Target = Enforcer;

    fn deref(&self) -> &Enforcer {
        &self.enforcer
    }
}

impl TestAgent {
    pub fn settings(&self) -> Settings {
        self.settings.get()
    }

    /// One sweeper pass over this agent with `settings`.
    pub fn sweep_pass(
        &self,
        sweeper: &mut Sweeper,
        settings: &limiter::settings::SweepSettings,
    ) -> Result<PassReport, limiter::datapath::EnforceError> {
        sweeper.pass(&self.enforcer, &self.limiter, &self.sweep, settings)
    }
}

/// A real agent (programs loaded, attached nowhere) with `flags` applied, its broker limiter
/// built from `limiter`, banning through the kernel maps; `pin_dir` as the agent would use it.
pub fn agent(
    flags: &[&str],
    limiter: LimiterConfig,
    pin_dir: Option<std::path::PathBuf>,
) -> TestAgent {
    let state = tempfile::tempdir().expect("a directory for the agent's state file");
    let state_file = state.path().join("state.json");
    let mut all = vec!["--state-file", state_file.to_str().expect("a UTF-8 path")];
    all.extend_from_slice(flags);
    let mut settings = settings(&all);
    settings.broker.limiter = limiter;
    let options = LoadOptions {
        pin_dir,
        ..unpinned(&settings)
    };
    let enforcer = run::load(&settings, options).expect("loading the programs");
    let bans = Arc::new(run::KernelBans(Arc::clone(&enforcer)));
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("a runtime for the start's phases");
    let buckets = runtime
        .block_on(run::fleet(&settings, bans))
        .expect("the broker limiter");
    TestAgent {
        enforcer,
        limiter: buckets.limiter,
        settings: Live::new(settings),
        sweep: SweepStats::new(),
        _state: state,
    }
}
