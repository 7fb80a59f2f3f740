//! A real mosquitto broker with the limiter plugin, run inside a test's namespace, and its
//! command-line clients run from another namespace.

use std::{
    io::{BufRead, BufReader},
    path::{Path, PathBuf},
    process::{Child, Command, Output, Stdio},
    sync::{Arc, Mutex},
    time::{Duration, Instant},
};

use anyhow::{Context, Result, bail};

use crate::netns::Netns;

/// The plugin: `LIMITER_MOSQUITTO_PLUGIN` (set by `cargo xtask test`), else the release build.
pub fn plugin() -> PathBuf {
    std::env::var_os("LIMITER_MOSQUITTO_PLUGIN")
        .map(PathBuf::from)
        .unwrap_or_else(|| {
            Path::new(env!("CARGO_MANIFEST_DIR")).join("../target/release/liblimiter_mosquitto.so")
        })
}

/// The MQTT port the broker listens on inside its namespace.
pub const PORT: u16 = 1883;

/// The broker's own login check.
#[derive(Clone, Copy)]
pub enum Logins<'a> {
    /// `allow_anonymous false` and a password file with these (name, password).
    PasswordFile(&'a [(&'a str, &'a str)]),
    /// `allow_anonymous true`, no password file: mosquitto checks no login of its own.
    Anonymous,
}

/// Writes `dir/passwords` with `users`; returns its path.
fn write_passwords(dir: &Path, users: &[(&str, &str)]) -> Result<PathBuf> {
    let passwords = dir.join("passwords");
    std::fs::write(&passwords, "")?;
    for (user, password) in users {
        let out = Command::new("mosquitto_passwd")
            .arg("-b")
            .arg(&passwords)
            .args([user, password])
            .output()
            .context("running mosquitto_passwd (Debian package mosquitto)")?;
        if !out.status.success() {
            bail!("mosquitto_passwd: {}", String::from_utf8_lossy(&out.stderr));
        }
    }
    Ok(passwords)
}

/// A running broker; killed on drop. Its log (stderr) is collected as it comes.
pub struct Broker {
    child: Child,
    log: Arc<Mutex<Vec<String>>>,
}

impl Broker {
    /// Writes a password file with `users` (name, password), an ACL file granting every
    /// user everything (mosquitto 2.0 denies when every ACL callback defers), and a
    /// mosquitto.conf loading the plugin with `plugin_opts` (`key value` pairs, without the
    /// `plugin_opt_` prefix), all in `dir`; then starts mosquitto in `ns`.
    pub fn start(
        ns: &Netns,
        listen: std::net::IpAddr,
        dir: &Path,
        users: &[(&str, &str)],
        plugin_opts: &[(&str, &str)],
    ) -> Result<Self> {
        Self::start_with(ns, listen, dir, Logins::PasswordFile(users), plugin_opts)
    }

    /// As [`Broker::start`], with the broker's own login check chosen by `logins`.
    pub fn start_with(
        ns: &Netns,
        listen: std::net::IpAddr,
        dir: &Path,
        logins: Logins,
        plugin_opts: &[(&str, &str)],
    ) -> Result<Self> {
        let acl = dir.join("acl");
        std::fs::write(&acl, "pattern readwrite #\n")?;
        let login_conf = match logins {
            Logins::PasswordFile(users) => format!(
                "allow_anonymous false\npassword_file {}\n",
                write_passwords(dir, users)?.display()
            ),
            Logins::Anonymous => "allow_anonymous true\n".to_owned(),
        };
        let mut conf = format!(
            "listener {PORT} {listen}\n{login_conf}acl_file {}\n\
             user root\nlog_dest stderr\nlog_type all\nplugin {}\n",
            acl.display(),
            plugin().display()
        );
        for (key, value) in plugin_opts {
            conf.push_str(&format!("plugin_opt_{key} {value}\n"));
        }
        let conf_path = dir.join("mosquitto.conf");
        std::fs::write(&conf_path, conf)?;

        let mut child = ns
            .command("mosquitto")?
            .arg("-c")
            .arg(&conf_path)
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .context("starting mosquitto (Debian package mosquitto)")?;
        let stderr = child.stderr.take().context("no stderr")?;
        let log = Arc::new(Mutex::new(Vec::new()));
        let keep = Arc::clone(&log);
        std::thread::spawn(move || {
            for line in BufReader::new(stderr).lines().map_while(Result::ok) {
                keep.lock().unwrap().push(line);
            }
        });
        let broker = Self { child, log };
        broker.wait_for("running", 1, Duration::from_secs(10))?;
        Ok(broker)
    }

    /// How many log lines contain `needle`.
    pub fn count(&self, needle: &str) -> usize {
        self.log
            .lock()
            .unwrap()
            .iter()
            .filter(|l| l.contains(needle))
            .count()
    }

    /// Waits until `n` log lines contain `needle`, failing after `within`.
    pub fn wait_for(&self, needle: &str, n: usize, within: Duration) -> Result<()> {
        let deadline = Instant::now() + within;
        while self.count(needle) < n {
            if Instant::now() > deadline {
                bail!(
                    "fewer than {n} broker log lines with {needle:?} within {within:?}; the log:\n{}",
                    self.log()
                );
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        Ok(())
    }

    pub fn log(&self) -> String {
        self.log.lock().unwrap().join("\n")
    }
}

impl Drop for Broker {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Runs a mosquitto client (`mosquitto_pub`, `mosquitto_sub`) in `ns`, bound to `from`,
/// connecting to `broker`, killed after `limit`.
pub fn client(
    ns: &Netns,
    program: &str,
    from: std::net::IpAddr,
    broker: std::net::IpAddr,
    args: &[&str],
    limit: Duration,
) -> Result<Output> {
    ns.command("timeout")?
        .arg(format!("{}", limit.as_secs_f64()))
        .arg(program)
        .args(["-h", &broker.to_string(), "-p", &PORT.to_string()])
        .args(["-A", &from.to_string()])
        .args(args)
        .stdin(Stdio::null())
        .output()
        .with_context(|| format!("running {program} (Debian package mosquitto-clients)"))
}
