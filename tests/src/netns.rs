//! Network namespaces and veth pairs made for one test and removed when it ends.

use std::{
    fs::File,
    net::{Ipv4Addr, Ipv6Addr},
    process::Command,
    sync::atomic::{AtomicU32, Ordering},
    thread,
};

use anyhow::{Context, Result, bail};

use crate::frames::{CLIENT_MAC, SERVER_MAC};
use nix::sched::{CloneFlags, setns};

/// Runs `ip` with the given arguments and fails with its stderr.
pub fn ip(args: &[&str]) -> Result<()> {
    let out = Command::new("ip")
        .args(args)
        .output()
        .context("running ip (iproute2)")?;
    if !out.status.success() {
        bail!(
            "ip {} failed: {}",
            args.join(" "),
            String::from_utf8_lossy(&out.stderr).trim()
        );
    }
    Ok(())
}

/// A short name no other test in any process shares (veth names are limited to 15 bytes).
pub fn unique_name(prefix: &str) -> String {
    static NEXT: AtomicU32 = AtomicU32::new(0);
    let n = NEXT.fetch_add(1, Ordering::Relaxed);
    format!("{prefix}{}x{n}", std::process::id() % 100_000)
}

/// A network namespace, deleted (with the links inside it) on drop.
pub struct Netns {
    name: String,
}

impl Netns {
    pub fn new(prefix: &str) -> Result<Self> {
        let name = unique_name(prefix);
        ip(&["netns", "add", &name])?;
        let ns = Self { name };
        ns.exec(&["ip", "link", "set", "lo", "up"])?;
        Ok(ns)
    }

    pub fn name(&self) -> &str {
        &self.name
    }

    /// Runs a command inside the namespace.
    pub fn exec(&self, cmd: &[&str]) -> Result<()> {
        let mut args = vec!["netns", "exec", &self.name];
        args.extend_from_slice(cmd);
        ip(&args)
    }

    /// A command that will run inside the namespace. Only the network namespace is entered
    /// (`ip netns exec` would also remount /sys, hiding the BPF filesystem).
    pub fn command(&self, program: &str) -> Result<Command> {
        command_in(&self.name, program)
    }

    /// Runs `f` on a thread that has entered this namespace: sockets it creates and
    /// interfaces it names belong to the namespace, while the rest of the test stays outside.
    pub fn run<T: Send>(&self, f: impl FnOnce() -> T + Send) -> Result<T> {
        run_in(&self.name, f)
    }
}

/// [`Netns::command`] for the namespace named `name`.
pub fn command_in(name: &str, program: &str) -> Result<Command> {
    use std::os::unix::process::CommandExt;
    let file = File::open(format!("/run/netns/{name}"))
        .with_context(|| format!("opening namespace {name}"))?;
    let mut command = Command::new(program);
    // SAFETY: only async-signal-safe work between fork and exec: one setns call.
    unsafe {
        command
            .pre_exec(move || setns(&file, CloneFlags::CLONE_NEWNET).map_err(std::io::Error::from));
    }
    Ok(command)
}

/// [`Netns::run`] for the namespace named `name`.
pub fn run_in<T: Send>(name: &str, f: impl FnOnce() -> T + Send) -> Result<T> {
    let file = File::open(format!("/run/netns/{name}"))
        .with_context(|| format!("opening namespace {name}"))?;
    thread::scope(|scope| {
        scope
            .spawn(move || {
                setns(&file, CloneFlags::CLONE_NEWNET).context("entering the namespace")?;
                Ok(f())
            })
            .join()
            .map_err(|_| anyhow::anyhow!("thread in namespace panicked"))?
    })
}

impl Drop for Netns {
    fn drop(&mut self) {
        let _ = ip(&["netns", "del", &self.name]);
    }
}

/// Two namespaces, `server` and `client`, joined by a veth pair with IPv4 and IPv6 addresses.
pub struct Pair {
    pub server: Netns,
    pub client: Netns,
    /// The veth end inside `server`, where the programs under test attach.
    pub server_if: String,
    /// The veth end inside `client`.
    pub client_if: String,
}

/// `02:00:00:00:00:01` for `[2, 0, 0, 0, 0, 1]`.
pub fn mac_text(mac: [u8; 6]) -> String {
    mac.iter()
        .map(|b| format!("{b:02x}"))
        .collect::<Vec<_>>()
        .join(":")
}

pub const SERVER_V4: Ipv4Addr = Ipv4Addr::new(10, 77, 0, 1);
pub const CLIENT_V4: Ipv4Addr = Ipv4Addr::new(10, 77, 0, 2);
pub const SERVER_V6: Ipv6Addr = Ipv6Addr::new(0xfd00, 0x77, 0, 0, 0, 0, 0, 1);
pub const CLIENT_V6: Ipv6Addr = Ipv6Addr::new(0xfd00, 0x77, 0, 0, 0, 0, 0, 2);

impl Pair {
    pub fn new() -> Result<Self> {
        let server = Netns::new("lts")?;
        let client = Netns::new("ltc")?;
        let server_if = unique_name("lvs");
        let client_if = unique_name("lvc");
        // Created inside `server`, so nothing of it ever touches the root namespace. The ends
        // carry the MAC addresses `frames` builds with, so a frame a test puts on the wire
        // itself (AF_PACKET) reaches the other end's IP layer.
        let (server_mac, client_mac) = (mac_text(SERVER_MAC), mac_text(CLIENT_MAC));
        server.exec(&[
            "ip",
            "link",
            "add",
            &server_if,
            "address",
            &server_mac,
            "type",
            "veth",
            "peer",
            "name",
            &client_if,
            "address",
            &client_mac,
            "netns",
            client.name(),
        ])?;
        for (ns, ifname, v4, v6) in [
            (&server, &server_if, SERVER_V4, SERVER_V6),
            (&client, &client_if, CLIENT_V4, CLIENT_V6),
        ] {
            ns.exec(&["ip", "addr", "add", &format!("{v4}/24"), "dev", ifname])?;
            ns.exec(&[
                "ip",
                "-6",
                "addr",
                "add",
                &format!("{v6}/64"),
                "dev",
                ifname,
                "nodad",
            ])?;
            ns.exec(&["ip", "link", "set", ifname, "up"])?;
        }
        Ok(Self {
            server,
            client,
            server_if,
            client_if,
        })
    }
}

/// A TCP server inside a namespace that accepts and holds every connection until told to
/// close them, so the connections keep their slots in the kernel's counts.
pub struct Server {
    pub addr: std::net::SocketAddr,
    listener: std::sync::Arc<std::net::TcpListener>,
    conns: std::sync::Arc<std::sync::Mutex<Vec<std::net::TcpStream>>>,
    stop: std::sync::Arc<std::sync::atomic::AtomicBool>,
    thread: Option<thread::JoinHandle<()>>,
}

impl Server {
    pub fn start(ns: &Netns, ip: std::net::IpAddr) -> Result<Self> {
        use std::sync::{Arc, Mutex, atomic::AtomicBool};
        let listener = Arc::new(ns.run(|| std::net::TcpListener::bind((ip, 0)))??);
        listener.set_nonblocking(true)?;
        let addr = listener.local_addr()?;
        let conns = Arc::new(Mutex::new(Vec::new()));
        let stop = Arc::new(AtomicBool::new(false));
        let thread = thread::spawn({
            let conns = Arc::clone(&conns);
            let stop = Arc::clone(&stop);
            let listener = Arc::clone(&listener);
            move || {
                // Runs until the server is dropped.
                while !stop.load(Ordering::Relaxed) {
                    if accept_pending(&listener, &conns) == 0 {
                        thread::sleep(std::time::Duration::from_millis(2));
                    }
                }
            }
        });
        Ok(Self {
            addr,
            listener,
            conns,
            stop,
            thread: Some(thread),
        })
    }

    /// Connections accepted so far (queued ones included).
    pub fn accepted(&self) -> usize {
        accept_pending(&self.listener, &self.conns);
        self.conns.lock().unwrap().len()
    }

    /// Closes every connection, accepting those still queued first (a FIN, or an RST where
    /// data was left unread, from the server's side).
    pub fn close_all(&self) {
        accept_pending(&self.listener, &self.conns);
        self.conns.lock().unwrap().clear();
    }
}

/// Accepts every queued connection; returns how many.
fn accept_pending(
    listener: &std::net::TcpListener,
    conns: &std::sync::Mutex<Vec<std::net::TcpStream>>,
) -> usize {
    let mut conns = conns.lock().unwrap();
    let mut n = 0;
    while let Ok((conn, _)) = listener.accept() {
        conns.push(conn);
        n += 1;
    }
    n
}

impl Drop for Server {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
    }
}

/// Connects from `src` (an address of `ns`) to `dst`, within three seconds.
pub fn connect(
    ns: &Netns,
    src: std::net::IpAddr,
    dst: std::net::SocketAddr,
) -> Result<std::io::Result<std::net::TcpStream>> {
    use socket2::{Domain, Socket, Type};
    ns.run(|| {
        let socket = Socket::new(Domain::for_address(dst), Type::STREAM, None)?;
        socket.bind(&std::net::SocketAddr::new(src, 0).into())?;
        socket.connect_timeout(&dst.into(), std::time::Duration::from_secs(3))?;
        Ok(socket.into())
    })
}
