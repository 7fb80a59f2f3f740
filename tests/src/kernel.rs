//! The datapath loaded for `BPF_PROG_TEST_RUN`: settings given as `limiter run` flags.

use aya::{
    TestRun,
    programs::{SchedClassifier, TestRunOptions, Xdp},
};
use std::sync::Arc;

use clap::Parser;
use limiter::{
    buckets::{Limiter, LimiterConfig, MonotonicClock},
    datapath::{Datapath, Enforcer, LoadOptions, TC_PROGRAM, XDP_PROGRAM, XdpAttachMode},
    services::sweeper::{PassReport, SweepStats, Sweeper},
    settings::{Live, RunArgs, Settings},
};
use limiter_common::{Direction, Reason, Verdict};

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

pub struct Kernel {
    pub dp: Datapath,
}

/// One run of the XDP program.
pub struct XdpRun {
    pub action: u32,
    /// The frame as the program left it (the RST reply for `XDP_TX`).
    pub frame: Vec<u8>,
}

impl Kernel {
    /// Loads the programs (attached nowhere) and applies `flags` to their maps.
    pub fn new(flags: &[&str]) -> Self {
        let settings = settings(flags);
        let mut dp = Datapath::load(LoadOptions {
            flow_table_size: settings.flow_table_size,
            ..LoadOptions::default()
        })
        .expect("loading the programs");
        dp.maps
            .apply(&settings.policy)
            .expect("applying the settings");
        Self { dp }
    }

    pub fn xdp(&self, frame: &[u8]) -> XdpRun {
        xdp_run(&self.dp, frame)
    }

    pub fn tc(&self, frame: &[u8]) -> u32 {
        let prog: &SchedClassifier = self
            .dp
            .ebpf()
            .program(TC_PROGRAM)
            .expect("the TC program")
            .try_into()
            .expect("a TC program");
        prog.test_run(TestRunOptions {
            data_in: Some(frame),
            ..Default::default()
        })
        .expect("BPF_PROG_TEST_RUN")
        .return_value
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
}

/// The programs attached to the server end of a fresh namespace pair, with `flags` applied.
pub struct Attached {
    pub dp: Datapath,
    /// See [`peer`].
    _peer: Datapath,
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
    pub fn new(flags: &[&str]) -> anyhow::Result<Self> {
        let pair = crate::netns::Pair::new()?;
        let settings = settings(flags);
        let dp = pair.server.run(|| {
            let mut dp = Datapath::load(LoadOptions {
                flow_table_size: settings.flow_table_size,
                ..LoadOptions::default()
            })?;
            dp.maps.apply(&settings.policy)?;
            dp.attach(&pair.server_if, XdpAttachMode::Native)?;
            anyhow::Ok(dp)
        })??;
        let peer = peer(&pair)?;
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
    pub fn wait_global(&self, want: u64) -> u64 {
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(5);
        loop {
            let now = self.global();
            if now == want || std::time::Instant::now() > deadline {
                return now;
            }
            std::thread::sleep(std::time::Duration::from_millis(10));
        }
    }
}

/// A real agent's parts (programs loaded, attached nowhere) as `limiter run` wires them, for
/// tests that drive the services directly.
pub struct TestAgent {
    pub enforcer: Arc<Enforcer>,
    pub limiter: Arc<Limiter>,
    pub settings: Live,
    pub sweep: SweepStats,
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

/// Bans from the broker limiter go to this agent's kernel maps, as in `limiter run`.
struct Bans(Arc<Enforcer>);

impl limiter::buckets::Banner for Bans {
    fn ban(
        &self,
        addr: std::net::IpAddr,
        ttl: std::time::Duration,
    ) -> Result<(), limiter::buckets::BanError> {
        self.0
            .ban(addr, ttl)
            .map_err(|e| limiter::buckets::BanError::Failed {
                addr,
                reason: e.to_string(),
            })
    }

    fn unban(&self, addr: std::net::IpAddr) -> Result<bool, limiter::buckets::BanError> {
        self.0
            .unban(addr)
            .map_err(|e| limiter::buckets::BanError::Failed {
                addr,
                reason: e.to_string(),
            })
    }
}

/// A real agent (programs loaded, attached nowhere) with `flags` applied, its broker limiter
/// built from `limiter`, banning through the kernel maps; `pin_dir` as the agent would use it.
pub fn agent(
    flags: &[&str],
    limiter: LimiterConfig,
    pin_dir: Option<std::path::PathBuf>,
) -> TestAgent {
    let settings = settings(flags);
    let datapath = Datapath::load(LoadOptions {
        flow_table_size: settings.flow_table_size,
        pin_dir,
        ..LoadOptions::default()
    })
    .expect("loading the programs");
    let enforcer = Arc::new(Enforcer::new(datapath, settings.policy.clone()));
    enforcer
        .set_policy(settings.policy.clone())
        .expect("applying the settings");
    let limiter = Arc::new(Limiter::new(
        limiter,
        Arc::new(MonotonicClock::new()),
        Arc::new(Bans(Arc::clone(&enforcer))),
    ));
    TestAgent {
        enforcer,
        limiter,
        settings: Live::new(settings),
        sweep: SweepStats::new(),
    }
}
