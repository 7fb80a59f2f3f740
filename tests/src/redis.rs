//! Real Redis servers for the fleet tests: a standalone server and a three-master Redis
//! Cluster, each `redis-server` started by the test on free loopback ports, with no
//! persistence, and stopped on drop. A server can be killed and restarted on the same port,
//! which is how the tests take Redis away from the agents and give it back.

use std::{
    net::TcpListener,
    path::Path,
    process::{Child, Command, Stdio},
    time::{Duration, Instant},
};

use anyhow::{Context, Result, bail};
use tempfile::TempDir;

use crate::netns::{Netns, command_in, run_in};

/// How long a server gets to answer PING, and a cluster to report `cluster_state:ok`.
const READY_WITHIN: Duration = Duration::from_secs(20);

/// Fails, naming the fix, when the Redis binaries are missing: the fleet tests never skip.
pub fn require_binaries() -> Result<()> {
    for (binary, package) in [
        ("redis-server", "redis-server"),
        ("redis-cli", "redis-tools"),
    ] {
        let found = Command::new(binary)
            .arg("--version")
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .status()
            .is_ok_and(|s| s.success());
        if !found {
            bail!("{binary} is not installed (Debian package {package}): run `cargo xtask setup`");
        }
    }
    Ok(())
}

/// A loopback port free now, whose cluster bus port (port + 10000) is free too.
fn free_port() -> Result<u16> {
    for _ in 0..200 {
        let port = TcpListener::bind("127.0.0.1:0")?.local_addr()?.port();
        if port < 55_000 && TcpListener::bind(("127.0.0.1", port + 10_000)).is_ok() {
            return Ok(port);
        }
    }
    bail!("found no free loopback port pair for redis-server")
}

/// One `redis-server`, killed on drop.
pub struct RedisServer {
    port: u16,
    cluster: bool,
    /// The network namespace it runs in (its loopback), or the test's own.
    netns: Option<String>,
    dir: TempDir,
    child: Option<Child>,
}

impl RedisServer {
    /// A standalone server, answering PING when this returns.
    pub fn start() -> Result<Self> {
        Self::start_as(false, None)
    }

    /// A standalone server on the loopback of the network namespace `ns`, for agents that
    /// run there; this handle still queries it (from a thread inside `ns`).
    pub fn start_in(ns: &Netns) -> Result<Self> {
        Self::start_as(false, Some(ns.name().to_owned()))
    }

    fn start_as(cluster: bool, netns: Option<String>) -> Result<Self> {
        require_binaries()?;
        let mut server = Self {
            // A namespace of the test's own has every port free.
            port: free_port()?,
            cluster,
            netns,
            dir: tempfile::tempdir()?,
            child: None,
        };
        server.spawn()?;
        Ok(server)
    }

    pub fn port(&self) -> u16 {
        self.port
    }

    /// `redis://127.0.0.1:PORT`.
    pub fn url(&self) -> String {
        format!("redis://127.0.0.1:{}", self.port)
    }

    /// Kills the server (SIGKILL: no goodbye to its clients) and waits for it to be gone.
    pub fn kill(&mut self) -> Result<()> {
        if let Some(mut child) = self.child.take() {
            child.kill().context("killing redis-server")?;
            child.wait().context("reaping redis-server")?;
        }
        Ok(())
    }

    /// Stops the server in its tracks (SIGSTOP): connections stay open and nothing answers,
    /// a Redis slower than any timeout.
    pub fn pause(&self) -> Result<()> {
        self.signal(nix::sys::signal::Signal::SIGSTOP)
    }

    /// Lets a paused server go on (SIGCONT).
    pub fn resume(&self) -> Result<()> {
        self.signal(nix::sys::signal::Signal::SIGCONT)
    }

    fn signal(&self, signal: nix::sys::signal::Signal) -> Result<()> {
        let child = self.child.as_ref().context("redis-server is not running")?;
        let pid = nix::unistd::Pid::from_raw(i32::try_from(child.id())?);
        nix::sys::signal::kill(pid, signal).with_context(|| format!("sending {signal}"))?;
        Ok(())
    }

    /// Starts the server again on the same port (empty: nothing was persisted).
    pub fn restart(&mut self) -> Result<()> {
        self.kill()?;
        self.spawn()
    }

    fn spawn(&mut self) -> Result<()> {
        let dir = self.dir.path();
        let mut cmd = match &self.netns {
            Some(ns) => command_in(ns, "redis-server")?,
            None => Command::new("redis-server"),
        };
        cmd.args(["--port", &self.port.to_string(), "--bind", "127.0.0.1"])
            .args(["--save", "", "--appendonly", "no", "--daemonize", "no"])
            .arg("--dir")
            .arg(dir)
            .arg("--logfile")
            .arg(dir.join("redis.log"))
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null());
        if self.cluster {
            cmd.args(["--cluster-enabled", "yes", "--cluster-node-timeout", "2000"])
                .arg("--cluster-config-file")
                .arg(dir.join("nodes.conf"));
        }
        self.child = Some(cmd.spawn().context("starting redis-server")?);
        self.wait_ready()
    }

    fn wait_ready(&mut self) -> Result<()> {
        let deadline = Instant::now() + READY_WITHIN;
        loop {
            if let Some(child) = self.child.as_mut()
                && let Some(status) = child.try_wait()?
            {
                bail!(
                    "redis-server on port {} exited ({status}); its log: {}",
                    self.port,
                    self.log()
                );
            }
            if self.query::<String>(&redis::cmd("PING")).is_ok() {
                return Ok(());
            }
            if Instant::now() > deadline {
                bail!(
                    "redis-server on port {} did not answer PING within {READY_WITHIN:?}; its log: {}",
                    self.port,
                    self.log()
                );
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// One command on a fresh connection to this server alone.
    pub fn query<T: redis::FromRedisValue + Send>(&self, cmd: &redis::Cmd) -> Result<T> {
        let ask = || -> Result<T> {
            let client = redis::Client::open(self.url())?;
            let mut connection = client.get_connection_with_timeout(Duration::from_secs(1))?;
            Ok(cmd.query(&mut connection)?)
        };
        match &self.netns {
            Some(ns) => run_in(ns, ask)?,
            None => ask(),
        }
    }

    fn log(&self) -> String {
        std::fs::read_to_string(self.dir.path().join("redis.log")).unwrap_or_default()
    }

    /// The server's data directory (its log is `redis.log` there).
    pub fn dir(&self) -> &Path {
        self.dir.path()
    }
}

impl Drop for RedisServer {
    fn drop(&mut self) {
        // A paused server would not die of SIGKILL any later, but resume it for its log.
        let _ = self.resume();
        let _ = self.kill();
    }
}

/// A Redis Cluster of `n` masters and no replicas, every slot assigned, `cluster_state:ok`
/// on every node when [`RedisCluster::start`] returns.
pub struct RedisCluster {
    nodes: Vec<RedisServer>,
}

impl RedisCluster {
    pub fn start(masters: usize) -> Result<Self> {
        let nodes = (0..masters)
            .map(|_| RedisServer::start_as(true, None))
            .collect::<Result<Vec<_>>>()?;
        let out = Command::new("redis-cli")
            .arg("--cluster")
            .arg("create")
            .args(nodes.iter().map(|n| format!("127.0.0.1:{}", n.port)))
            .args(["--cluster-replicas", "0", "--cluster-yes"])
            .stdin(Stdio::null())
            .output()
            .context("running redis-cli --cluster create")?;
        if !out.status.success() {
            bail!(
                "redis-cli --cluster create failed: {}{}",
                String::from_utf8_lossy(&out.stdout),
                String::from_utf8_lossy(&out.stderr)
            );
        }
        let cluster = Self { nodes };
        cluster.wait_ok()?;
        Ok(cluster)
    }

    fn wait_ok(&self) -> Result<()> {
        let deadline = Instant::now() + READY_WITHIN;
        loop {
            let ok = self.nodes.iter().all(|node| {
                node.query::<String>(redis::cmd("CLUSTER").arg("INFO"))
                    .is_ok_and(|info| info.contains("cluster_state:ok"))
            });
            if ok {
                return Ok(());
            }
            if Instant::now() > deadline {
                bail!("the cluster did not reach cluster_state:ok within {READY_WITHIN:?}");
            }
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    /// `redis+cluster://127.0.0.1:P1,127.0.0.1:P2,...`, the agent's `cluster.redis`.
    pub fn url(&self) -> String {
        let nodes: Vec<String> = self
            .nodes
            .iter()
            .map(|n| format!("127.0.0.1:{}", n.port))
            .collect();
        format!("redis+cluster://{}", nodes.join(","))
    }

    pub fn nodes(&self) -> &[RedisServer] {
        &self.nodes
    }
}
