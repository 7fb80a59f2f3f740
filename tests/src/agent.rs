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
    ns.run(|| {
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

/// A running agent; killed on drop. Its log lines are collected as they come.
pub struct AgentProcess {
    child: Child,
    lines: Receiver<String>,
    log: Arc<Mutex<Vec<String>>>,
    reader: Option<std::thread::JoinHandle<()>>,
    /// Holds the agent's own state file (`LIMITER_STATE_FILE`), so no agent of a test reads
    /// the bans another test left, nor the host's; a test that restarts an agent on the same
    /// state passes `--state-file`, which wins.
    _state: tempfile::TempDir,
}

impl AgentProcess {
    /// `limiter run ARGS` inside `ns`'s network namespace. Only the network namespace is
    /// entered (`ip netns exec` would also remount /sys, hiding the BPF filesystem and so
    /// every pin).
    pub fn start(ns: &Netns, args: &[impl AsRef<std::ffi::OsStr>]) -> Result<Self> {
        Self::spawn(ns, args, &[], false)
    }

    /// [`start`](Self::start) with `env` added to the agent's environment (`NOTIFY_SOCKET`,
    /// `WATCHDOG_USEC`, as systemd would set them).
    pub fn start_with_env(
        ns: &Netns,
        args: &[impl AsRef<std::ffi::OsStr>],
        env: &[(&str, &std::ffi::OsStr)],
    ) -> Result<Self> {
        Self::spawn(ns, args, env, false)
    }

    /// [`start`](Self::start) with the `UNAME26` personality, which survives exec: `uname`
    /// tells the agent it runs on Linux 2.6, as a kernel below its floor would.
    pub fn start_on_linux_2_6(ns: &Netns, args: &[impl AsRef<std::ffi::OsStr>]) -> Result<Self> {
        Self::spawn(ns, args, &[], true)
    }

    fn spawn(
        ns: &Netns,
        args: &[impl AsRef<std::ffi::OsStr>],
        env: &[(&str, &std::ffi::OsStr)],
        linux_2_6: bool,
    ) -> Result<Self> {
        use nix::sys::personality::{self, Persona};
        use std::os::unix::process::CommandExt;
        let netns = std::fs::File::open(format!("/run/netns/{}", ns.name()))?;
        let mut command = Command::new(binary());
        // SAFETY: only async-signal-safe work between fork and exec: one setns call, and two
        // personality calls.
        unsafe {
            command.pre_exec(move || {
                nix::sched::setns(&netns, nix::sched::CloneFlags::CLONE_NEWNET)?;
                if linux_2_6 {
                    personality::set(personality::get()? | Persona::UNAME26)?;
                }
                Ok(())
            });
        }
        let state = tempfile::tempdir().context("a directory for the agent's state file")?;
        let mut child = command
            .arg("run")
            .args(args)
            .env("LIMITER_LOG", "info,limiter=debug")
            .env("LIMITER_STATE_FILE", state.path().join("state.json"))
            .envs(env.iter().copied())
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
            _state: state,
        })
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
