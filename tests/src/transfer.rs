//! Bulk transfers over real TCP between a pair's namespaces, and what each side's handshake
//! agreed (`TCP_INFO`): how the tests prove a cookie connection keeps its options, and how
//! the flood bench times one against a normal connection.

use std::{
    io::{Read, Write},
    net::{IpAddr, Shutdown, SocketAddr, TcpListener},
    os::fd::AsRawFd,
    sync::mpsc,
    time::{Duration, Instant},
};

use anyhow::{Context, Result, ensure};

use crate::netns::{Netns, SERVER_V4, connect};

/// What TCP agreed for a connection: its options and both window scales.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Agreed {
    pub timestamps: bool,
    pub sack: bool,
    pub window_scaling: bool,
    /// The scale this end applies to the peer's windows, and the one it announced for its own.
    pub snd_wscale: u8,
    pub rcv_wscale: u8,
}

pub fn agreed(socket: &impl AsRawFd) -> std::io::Result<Agreed> {
    // SAFETY: a plain C struct, all zeros valid; the kernel fills at most `len` bytes of it.
    let mut info: libc::tcp_info = unsafe { std::mem::zeroed() };
    let mut len = std::mem::size_of::<libc::tcp_info>() as libc::socklen_t;
    // SAFETY: `info` and `len` outlive the call, and `len` is `info`'s size.
    let rc = unsafe {
        libc::getsockopt(
            socket.as_raw_fd(),
            libc::IPPROTO_TCP,
            libc::TCP_INFO,
            (&raw mut info).cast(),
            &mut len,
        )
    };
    if rc != 0 {
        return Err(std::io::Error::last_os_error());
    }
    // `tcpi_options`: TCPI_OPT_TIMESTAMPS 1, TCPI_OPT_SACK 2, TCPI_OPT_WSCALE 4.
    Ok(Agreed {
        timestamps: info.tcpi_options & 1 != 0,
        sack: info.tcpi_options & 2 != 0,
        window_scaling: info.tcpi_options & 4 != 0,
        snd_wscale: info.tcpi_snd_rcv_wscale & 0xF,
        rcv_wscale: info.tcpi_snd_rcv_wscale >> 4,
    })
}

/// A listener on the server's address in `ns` that reads each connection to its end, for
/// `rounds` connections, and reports for each what TCP agreed on its side, the bytes read,
/// and when the last arrived. Each read waits at most 20 s.
pub struct Sink {
    pub addr: SocketAddr,
    received: mpsc::Receiver<std::io::Result<(Agreed, usize, Instant)>>,
}

impl Sink {
    pub fn new(ns: &Netns, rounds: usize) -> Result<Self> {
        let listener = ns.run(|| TcpListener::bind((SERVER_V4, 0)))??;
        let addr = listener.local_addr()?;
        let (tx, received) = mpsc::channel();
        std::thread::spawn(move || {
            let mut buffer = vec![0u8; 1 << 16];
            for _ in 0..rounds {
                let mut read = || {
                    let (mut conn, _) = listener.accept()?;
                    let server = agreed(&conn)?;
                    conn.set_read_timeout(Some(Duration::from_secs(20)))?;
                    let mut total = 0usize;
                    loop {
                        match conn.read(&mut buffer)? {
                            0 => return Ok((server, total, Instant::now())),
                            n => total += n,
                        }
                    }
                };
                if tx.send(read()).is_err() {
                    return;
                }
            }
        });
        Ok(Self { addr, received })
    }
}

/// One transfer's rate and what both sides agreed.
pub struct Transfer {
    /// Bytes a second, from the first write to the sink's last read.
    pub rate: f64,
    pub client: Agreed,
    pub server: Agreed,
}

/// Sends `data` from `src` in `client` to `sink`, and waits (at most 30 s) for the sink to
/// have read all of it.
pub fn transfer(client: &Netns, src: IpAddr, sink: &Sink, data: &[u8]) -> Result<Transfer> {
    let mut conn = connect(client, src, sink.addr)?.context("connecting")?;
    conn.set_write_timeout(Some(Duration::from_secs(20)))?;
    let client_side = agreed(&conn)?;
    let started = Instant::now();
    conn.write_all(data)?;
    conn.shutdown(Shutdown::Write)?;
    let (server_side, total, ended) = sink
        .received
        .recv_timeout(Duration::from_secs(30))
        .context("the sink read nothing in 30 s")??;
    ensure!(
        total == data.len(),
        "the sink read {total} of {} bytes",
        data.len()
    );
    Ok(Transfer {
        rate: data.len() as f64 / (ended - started).as_secs_f64(),
        client: client_side,
        server: server_side,
    })
}
