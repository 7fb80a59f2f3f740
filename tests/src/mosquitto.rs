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
    std::env::var_os("LIMITER_MOSQUITTO_PLUGIN").map_or_else(
        || Path::new(env!("CARGO_MANIFEST_DIR")).join("../target/release/liblimiter_mosquitto.so"),
        PathBuf::from,
    )
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

/// A broker's mosquitto.conf, as a test chooses its security settings.
#[derive(Clone, Copy)]
pub struct Conf<'a> {
    pub port: u16,
    pub allow_anonymous: bool,
    /// A password file with these (name, password), or none.
    pub users: Option<&'a [(&'a str, &'a str)]>,
    /// An ACL file with this text, or none.
    pub acl: Option<&'a str>,
    /// The plugin with these options (`key value` pairs, without the `plugin_opt_` prefix),
    /// or no plugin.
    pub plugin: Option<&'a [(&'a str, &'a str)]>,
}

/// A running broker; killed on drop. Its log (stderr) is collected as it comes.
pub struct Broker {
    child: Child,
    log: Arc<Mutex<Vec<String>>>,
}

impl Broker {
    /// Writes a password file with `users` (name, password), an ACL file granting every
    /// user everything, and a mosquitto.conf loading the plugin with `plugin_opts`, all in
    /// `dir`; then starts mosquitto in `ns`.
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
        let (allow_anonymous, users) = match logins {
            Logins::PasswordFile(users) => (false, Some(users)),
            Logins::Anonymous => (true, None),
        };
        let conf = Conf {
            port: PORT,
            allow_anonymous,
            users,
            acl: Some("pattern readwrite #\n"),
            plugin: Some(plugin_opts),
        };
        Self::start_conf(ns, listen, dir, &conf)
    }

    /// Writes the files `conf` needs and a mosquitto.conf in `dir`; then starts mosquitto
    /// in `ns`, listening on `listen` at `conf.port`.
    pub fn start_conf(
        ns: &Netns,
        listen: std::net::IpAddr,
        dir: &Path,
        conf: &Conf,
    ) -> Result<Self> {
        let mut text = format!(
            "listener {} {listen}\nallow_anonymous {}\nuser root\nlog_dest stderr\nlog_type all\n",
            conf.port, conf.allow_anonymous
        );
        if let Some(users) = conf.users {
            let passwords = write_passwords(dir, users)?;
            text.push_str(&format!("password_file {}\n", passwords.display()));
        }
        if let Some(rules) = conf.acl {
            let acl = dir.join("acl");
            std::fs::write(&acl, rules)?;
            text.push_str(&format!("acl_file {}\n", acl.display()));
        }
        if let Some(opts) = conf.plugin {
            text.push_str(&format!("plugin {}\n", plugin().display()));
            for (key, value) in opts {
                text.push_str(&format!("plugin_opt_{key} {value}\n"));
            }
        }
        let conf_path = dir.join("mosquitto.conf");
        std::fs::write(&conf_path, text)?;

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
/// connecting to `broker` at [`PORT`], killed after `limit`.
pub fn client(
    ns: &Netns,
    program: &str,
    from: std::net::IpAddr,
    broker: std::net::IpAddr,
    args: &[&str],
    limit: Duration,
) -> Result<Output> {
    client_at(ns, program, from, (broker, PORT), args, limit)
}

/// As [`client`], connecting to `broker` (address, port).
pub fn client_at(
    ns: &Netns,
    program: &str,
    from: std::net::IpAddr,
    broker: (std::net::IpAddr, u16),
    args: &[&str],
    limit: Duration,
) -> Result<Output> {
    ns.command("timeout")?
        .arg(format!("{}", limit.as_secs_f64()))
        .arg(program)
        .args(["-h", &broker.0.to_string(), "-p", &broker.1.to_string()])
        .args(["-A", &from.to_string()])
        .args(args)
        .stdin(Stdio::null())
        .output()
        .with_context(|| format!("running {program} (Debian package mosquitto-clients)"))
}

/// Starts a mosquitto client (`mosquitto_sub`, to hold a session) in `ns`, bound to `from`,
/// connecting to `broker` at [`PORT`]; the caller kills it.
pub fn spawn_client(
    ns: &Netns,
    program: &str,
    from: std::net::IpAddr,
    broker: std::net::IpAddr,
    args: &[&str],
) -> Result<Child> {
    ns.command(program)?
        .args(["-h", &broker.to_string(), "-p", &PORT.to_string()])
        .args(["-A", &from.to_string()])
        .args(args)
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .with_context(|| format!("starting {program} (Debian package mosquitto-clients)"))
}
