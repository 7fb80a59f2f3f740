//! The real `limiter` binary, run inside a test's namespace with its own pin directory.

use std::{
    io::{BufRead, BufReader},
    path::{Path, PathBuf},
    process::{Child, Command, ExitStatus, Stdio},
    sync::{
        Arc, Mutex,
        atomic::{AtomicU32, Ordering},
        mpsc::{self, Receiver},
    },
    time::{Duration, Instant},
};

use std::ffi::{OsStr, OsString};

use anyhow::{Context, Result, bail};
use limiter::datapath::Maps;

use crate::netns::Netns;

/// The agent binary: `LIMITER_BIN` (set by `cargo xtask test`), else the release build.
pub fn binary() -> PathBuf {
    std::env::var_os("LIMITER_BIN").map_or_else(
        || Path::new(env!("CARGO_MANIFEST_DIR")).join("../target/release/limiter"),
        PathBuf::from,
    )
}

/// Multiplies the startup deadline where the machine is known to be slower than the ones the
/// tests were written on: `cargo xtask test-kernels` sets it in its emulated guests, where the
/// kernel (the verifier above all) runs many times slower. A positive integer; unset is 1.
pub const SLOWDOWN_VAR: &str = "LIMITER_TEST_SLOWDOWN";

/// How long an agent may take to load, verify and attach its programs before a test gives up
/// on it: 20 s, times [`SLOWDOWN_VAR`]. A bound for failing, not a measured figure.
pub fn startup_deadline() -> Duration {
    let slowdown = match std::env::var(SLOWDOWN_VAR) {
        Err(std::env::VarError::NotPresent) => 1,
        Ok(text) => match text.trim().parse::<u32>() {
            Ok(n) if n > 0 => n,
            _ => panic!("{SLOWDOWN_VAR}={text:?}: expected a positive integer"),
        },
        Err(error) => panic!("{SLOWDOWN_VAR}: {error}"),
    };
    Duration::from_secs(20) * slowdown
}

/// A pin directory of this test's own under /sys/fs/bpf, detached and removed on drop.
pub struct PinDir(pub PathBuf);

impl PinDir {
    pub fn new() -> Self {
        static NEXT: AtomicU32 = AtomicU32::new(0);
        let n = NEXT.fetch_add(1, Ordering::Relaxed);
        Self(PathBuf::from(format!(
            "/sys/fs/bpf/limiter-test-{}-{n}",
            std::process::id()
        )))
    }

    pub fn arg(&self) -> &str {
        self.0.to_str().expect("UTF-8 pin path")
    }

    /// The pinned maps, as the operator commands read them.
    pub fn maps(&self) -> Maps {
        Maps::open_pinned(&self.0).expect("opening the pinned maps")
    }

    pub fn global(&self) -> u64 {
        self.maps().global_connections().unwrap()
    }

    /// Waits (bounded) until the pinned global count reads `want`; returns the last reading.
    pub fn wait_global(&self, want: u64, within: Duration) -> u64 {
        let deadline = Instant::now() + within;
        loop {
            let now = self.global();
            if now == want || Instant::now() > deadline {
                return now;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }
}

impl Default for PinDir {
    fn default() -> Self {
        Self::new()
    }
}

impl Drop for PinDir {
    fn drop(&mut self) {
        let _ = limiter::datapath::detach(&self.0, None);
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// One HTTP request to an agent's listener at `url` inside `ns`, made from a thread in that
/// namespace; the status and the body, or `None` when nothing answered.
pub fn http_in(
    ns: &Netns,
    method: reqwest::Method,
    url: &str,
    token: Option<&str>,
    body: Option<serde_json::Value>,
) -> Option<(u16, String)> {
    http_in_named(ns.name(), method, url, token, body)
}

fn http_in_named(
    ns: &str,
    method: reqwest::Method,
    url: &str,
    token: Option<&str>,
    body: Option<serde_json::Value>,
) -> Option<(u16, String)> {
    crate::netns::run_in(ns, || {
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap();
        runtime.block_on(async {
            let client = reqwest::Client::builder()
                .no_proxy()
                .timeout(Duration::from_secs(10))
                .build()
                .unwrap();
            let mut request = client.request(method, url);
            if let Some(token) = token {
                request = request.bearer_auth(token);
            }
            if let Some(body) = body {
                request = request.json(&body);
            }
            let answer = request.send().await.ok()?;
            Some((answer.status().as_u16(), answer.text().await.ok()?))
        })
    })
    .unwrap()
}

/// The HTTP address every test agent listens on, inside its own network namespace; a test
/// that runs several agents in one namespace gives each its own with [`AgentBuilder::http`].
pub const TEST_HTTP: &str = "127.0.0.1:9090";

/// The one way a test starts `limiter run`: the base flags every test agent needs (its
/// interface, pin directory, broker socket, HTTP address and a state file of its own) are set
/// here, so a new startup flag reaches every test at once; a test adds only what it is about.
pub struct AgentBuilder<'a> {
    ns: &'a Netns,
    iface: String,
    pins: PathBuf,
    socket: Option<PathBuf>,
    http: String,
    args: Vec<OsString>,
    env: Vec<(OsString, OsString)>,
    linux_2_6: bool,
    private_mounts: bool,
}

impl<'a> AgentBuilder<'a> {
    /// The broker socket, instead of one in a directory of the agent's own.
    pub fn socket(mut self, path: impl Into<PathBuf>) -> Self {
        self.socket = Some(path.into());
        self
    }

    /// The HTTP listener's address, instead of [`TEST_HTTP`].
    pub fn http(mut self, addr: impl Into<String>) -> Self {
        self.http = addr.into();
        self
    }

    /// More `limiter run` flags, after the base ones (a later flag wins).
    pub fn args<I, S>(mut self, args: I) -> Self
    where
        I: IntoIterator<Item = S>,
        S: AsRef<OsStr>,
    {
        self.args
            .extend(args.into_iter().map(|a| a.as_ref().to_owned()));
        self
    }

    /// A variable added to the agent's environment (`NOTIFY_SOCKET`, `WATCHDOG_USEC`, as
    /// systemd would set them, or a `LIMITER_*` setting).
    pub fn env(mut self, name: impl AsRef<OsStr>, value: impl AsRef<OsStr>) -> Self {
        self.env
            .push((name.as_ref().to_owned(), value.as_ref().to_owned()));
        self
    }

    /// Started with the `UNAME26` personality, which survives exec: `uname` tells the agent
    /// it runs on Linux 2.6, as a kernel below its floor would.
    pub fn on_linux_2_6(mut self) -> Self {
        self.linux_2_6 = true;
        self
    }

    /// Started as `ip netns exec` starts a command: in a private mount namespace with a /sys of
    /// its own, where the host's BPF filesystem is not mounted.
    pub fn in_private_mount_namespace(mut self) -> Self {
        self.private_mounts = true;
        self
    }

    /// The agent, started and not waited for (a test of a refused start waits for its exit).
    pub fn start(self) -> Result<AgentProcess> {
        AgentProcess::spawn(self)
    }

    /// The agent, once it logged that it is ready; fails with its log if it does not within
    /// [`startup_deadline`].
    pub fn ready(self) -> Result<AgentProcess> {
        let agent = self.start()?;
        agent.wait_for("limiter is ready", startup_deadline())?;
        Ok(agent)
    }
}

/// A mount namespace of the caller's own whose /sys is a fresh sysfs, without the host's BPF
/// filesystem: what `ip netns exec` gives a command. Runs between fork and exec.
fn private_sys() -> nix::Result<()> {
    use nix::mount::{MntFlags, MsFlags, mount, umount2};
    nix::sched::unshare(nix::sched::CloneFlags::CLONE_NEWNS)?;
    mount(
        None::<&str>,
        "/",
        None::<&str>,
        MsFlags::MS_REC | MsFlags::MS_SLAVE,
        None::<&str>,
    )?;
    umount2("/sys", MntFlags::MNT_DETACH)?;
    mount(
        Some("sysfs"),
        "/sys",
        Some("sysfs"),
        MsFlags::empty(),
        None::<&str>,
    )
}

/// A running agent; killed on drop. Its log lines are collected as they come.
pub struct AgentProcess {
    child: Child,
    lines: Receiver<String>,
    log: Arc<Mutex<Vec<String>>>,
    reader: Option<std::thread::JoinHandle<()>>,
    socket: PathBuf,
    http: String,
    netns: String,
    /// Holds the agent's broker socket (unless the test chose its own) and its own state file
    /// (`LIMITER_STATE_FILE`), so no agent of a test reads the bans another test left, nor the
    /// host's; a test that restarts an agent on the same state passes `--state-file`, which wins.
    _dir: tempfile::TempDir,
}

impl AgentProcess {
    /// The builder for `limiter run` on `iface` inside `ns`'s network namespace, pinning under
    /// `pins`. Only the network namespace is entered (`ip netns exec` would also remount /sys,
    /// hiding the BPF filesystem and so every pin).
    pub fn builder<'a>(ns: &'a Netns, iface: &str, pins: &PinDir) -> AgentBuilder<'a> {
        AgentBuilder {
            ns,
            iface: iface.to_owned(),
            pins: pins.0.clone(),
            socket: None,
            http: TEST_HTTP.to_owned(),
            args: Vec::new(),
            env: Vec::new(),
            linux_2_6: false,
            private_mounts: false,
        }
    }

    fn spawn(spec: AgentBuilder<'_>) -> Result<Self> {
        use nix::sys::personality::{self, Persona};
        use std::os::unix::process::CommandExt;
        let netns = std::fs::File::open(format!("/run/netns/{}", spec.ns.name()))?;
        let (linux_2_6, private_mounts) = (spec.linux_2_6, spec.private_mounts);
        let mut command = Command::new(binary());
        // SAFETY: only async-signal-safe work between fork and exec: system calls (setns, the
        // personality, and what `ip netns exec` does to the mounts).
        unsafe {
            command.pre_exec(move || {
                nix::sched::setns(&netns, nix::sched::CloneFlags::CLONE_NEWNET)?;
                if linux_2_6 {
                    personality::set(personality::get()? | Persona::UNAME26)?;
                }
                if private_mounts {
                    private_sys()?;
                }
                Ok(())
            });
        }
        let dir = tempfile::tempdir().context("a directory for the agent's socket and state")?;
        let socket = spec
            .socket
            .unwrap_or_else(|| dir.path().join("limiter.sock"));
        let mut child = command
            .arg("run")
            .arg("--iface")
            .arg(&spec.iface)
            .arg("--pin-dir")
            .arg(&spec.pins)
            .arg("--socket")
            .arg(&socket)
            .arg("--http")
            .arg(&spec.http)
            .args(&spec.args)
            .env("LIMITER_LOG", "info,limiter=debug")
            .env("LIMITER_STATE_FILE", dir.path().join("state.json"))
            .envs(spec.env.iter().map(|(k, v)| (k, v)))
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .with_context(|| format!("starting {}", binary().display()))?;
        let stderr = child.stderr.take().context("no stderr")?;
        let (tx, lines) = mpsc::channel();
        let log = Arc::new(Mutex::new(Vec::new()));
        let keep = Arc::clone(&log);
        let reader = std::thread::spawn(move || {
            for line in BufReader::new(stderr).lines().map_while(Result::ok) {
                keep.lock().unwrap().push(line.clone());
                // The receiver may be gone; the log keeps every line regardless.
                let _ = tx.send(line);
            }
        });
        Ok(Self {
            child,
            lines,
            log,
            reader: Some(reader),
            socket,
            http: spec.http,
            netns: spec.ns.name().to_owned(),
            _dir: dir,
        })
    }

    /// The broker socket the agent serves.
    pub fn socket(&self) -> &Path {
        &self.socket
    }

    /// `path` on the agent's HTTP listener, as a URL to request from inside its namespace.
    pub fn url(&self, path: &str) -> String {
        format!("http://{}{path}", self.http)
    }

    /// One HTTP request to the agent's listener for `path`, from inside its namespace; the
    /// status and the body, or `None` when nothing answered.
    pub fn http(
        &self,
        method: reqwest::Method,
        path: &str,
        token: Option<&str>,
        body: Option<serde_json::Value>,
    ) -> Option<(u16, String)> {
        http_in_named(&self.netns, method, &self.url(path), token, body)
    }

    /// Waits for a log line containing `needle`, failing after `within`.
    pub fn wait_for(&self, needle: &str, within: Duration) -> Result<String> {
        let deadline = Instant::now() + within;
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            match self.lines.recv_timeout(left) {
                Ok(line) if line.contains(needle) => return Ok(line),
                Ok(_) => {}
                Err(_) => bail!(
                    "no log line with {needle:?} within {within:?}; the log:\n{}",
                    self.log()
                ),
            }
        }
    }

    pub fn log(&self) -> String {
        self.log.lock().unwrap().join("\n")
    }

    /// Sends `signal` once the agent handles it (its handlers are installed a moment after
    /// it logs readiness; a signal before that would kill it).
    pub fn signal(&self, signal: nix::sys::signal::Signal) {
        let pid = self.child.id();
        let bit = 1u64 << (signal as i32 - 1);
        let caught = || {
            std::fs::read_to_string(format!("/proc/{pid}/status"))
                .ok()
                .and_then(|status| {
                    let mask = status.lines().find_map(|l| l.strip_prefix("SigCgt:"))?;
                    u64::from_str_radix(mask.trim(), 16).ok()
                })
                .is_some_and(|mask| mask & bit != 0)
        };
        let deadline = Instant::now() + Duration::from_secs(10);
        while !caught() && Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(5));
        }
        let pid = nix::unistd::Pid::from_raw(pid as i32);
        nix::sys::signal::kill(pid, signal).expect("signalling the agent");
    }

    /// Waits for the agent to exit, failing after `within`.
    pub fn wait_exit(&mut self, within: Duration) -> Result<ExitStatus> {
        let deadline = Instant::now() + within;
        loop {
            if let Some(status) = self.child.try_wait()? {
                // The log is complete once the reader has seen the end of stderr.
                if let Some(reader) = self.reader.take() {
                    let _ = reader.join();
                }
                return Ok(status);
            }
            if Instant::now() > deadline {
                bail!(
                    "the agent did not exit within {within:?}; the log:\n{}",
                    self.log()
                );
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    pub fn kill(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Drop for AgentProcess {
    fn drop(&mut self) {
        self.kill();
    }
}
