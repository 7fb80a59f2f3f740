//! An AF_PACKET socket on one interface: for tests and benches that put frames on a veth
//! themselves (spoofed sources, a handshake no kernel socket would make) and read what comes
//! back, such as the host's SYN-ACK to an address no stack in the namespace answers for.

use std::{
    io,
    mem::MaybeUninit,
    os::fd::{AsFd, BorrowedFd, FromRawFd, OwnedFd},
    time::{Duration, Instant},
};

use anyhow::{Context, Result};

/// Bound to one interface of the caller's network namespace, every protocol.
pub struct PacketSocket(socket2::Socket);

impl PacketSocket {
    pub fn bind(iface: &str) -> Result<Self> {
        let protocol = (libc::ETH_P_ALL as u16).to_be();
        // SAFETY: plain socket(2); the descriptor is owned below.
        let fd = unsafe { libc::socket(libc::AF_PACKET, libc::SOCK_RAW, i32::from(protocol)) };
        if fd < 0 {
            return Err(io::Error::last_os_error()).context("AF_PACKET socket");
        }
        // SAFETY: `fd` is a fresh descriptor nothing else owns.
        let socket = socket2::Socket::from(unsafe { OwnedFd::from_raw_fd(fd) });
        let index = nix::net::if_::if_nametoindex(iface)
            .with_context(|| format!("no interface {iface}"))?;
        // SAFETY: an all-zero sockaddr_ll is valid; the fields that matter are set next.
        let mut addr: libc::sockaddr_ll = unsafe { std::mem::zeroed() };
        addr.sll_family = libc::AF_PACKET as u16;
        addr.sll_protocol = protocol;
        addr.sll_ifindex = index as i32;
        // SAFETY: `addr` is a valid sockaddr_ll of the length given.
        let rc = unsafe {
            libc::bind(
                std::os::fd::AsRawFd::as_raw_fd(&socket),
                (&addr as *const libc::sockaddr_ll).cast(),
                std::mem::size_of::<libc::sockaddr_ll>() as u32,
            )
        };
        if rc != 0 {
            return Err(io::Error::last_os_error()).context("binding the AF_PACKET socket");
        }
        Ok(Self(socket))
    }

    /// Sends one whole frame; `false` when the transmit queue is full (`ENOBUFS`), for the
    /// caller to try again within its own bound.
    pub fn send(&self, frame: &[u8]) -> io::Result<bool> {
        match self.0.send(frame) {
            Ok(_) => Ok(true),
            Err(error) if error.raw_os_error() == Some(libc::ENOBUFS) => Ok(false),
            Err(error) => Err(error),
        }
    }

    /// The first frame seen on the interface (either way) that `wanted` accepts, waiting at
    /// most `within`; `None` if none came.
    pub fn receive<T>(
        &self,
        within: Duration,
        mut wanted: impl FnMut(&[u8]) -> Option<T>,
    ) -> io::Result<Option<T>> {
        let deadline = Instant::now() + within;
        let mut buffer = [MaybeUninit::<u8>::uninit(); 2048];
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return Ok(None);
            }
            self.0.set_read_timeout(Some(left))?;
            let size = match self.0.recv(&mut buffer) {
                Ok(size) => size,
                Err(e)
                    if matches!(
                        e.kind(),
                        io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut
                    ) =>
                {
                    return Ok(None);
                }
                Err(e) => return Err(e),
            };
            // SAFETY: `recv` initialised the first `size` bytes.
            let frame = unsafe { std::slice::from_raw_parts(buffer.as_ptr().cast::<u8>(), size) };
            if let Some(found) = wanted(frame) {
                return Ok(Some(found));
            }
        }
    }
}

impl AsFd for PacketSocket {
    fn as_fd(&self) -> BorrowedFd<'_> {
        self.0.as_fd()
    }
}

/// Sends `count` SYNs from random sources in 198.18.0.0/15 out of `ifname` through an
/// AF_PACKET socket (run inside the client's namespace); returns how many were sent. Bounded
/// by count and by thirty seconds.
pub fn spoof_syns(
    ifname: &str,
    count: u32,
    src_mac: [u8; 6],
    dst_mac: [u8; 6],
    dst: std::net::Ipv4Addr,
    port: u16,
) -> u32 {
    use etherparse::PacketBuilder;
    let socket = PacketSocket::bind(ifname).unwrap();
    let deadline = Instant::now() + Duration::from_secs(30);
    let mut state = 0x2545_F491_4F6C_DD1Du64;
    let mut sent = 0;
    let mut frame = Vec::with_capacity(64);
    while sent < count && Instant::now() < deadline {
        state ^= state << 13;
        state ^= state >> 7;
        state ^= state << 17;
        let src = std::net::Ipv4Addr::from(0xC612_0000 | (state as u32 & 0x1_FFFF));
        let sport = 1024 + (state >> 32) as u16 % 60_000;
        frame.clear();
        PacketBuilder::ethernet2(src_mac, dst_mac)
            .ipv4(src.octets(), dst.octets(), 64)
            .tcp(sport, port, (state >> 16) as u32, 64_240)
            .syn()
            .write(&mut frame, &[])
            .unwrap();
        // A full transmit queue: let it drain.
        if socket.send(&frame).unwrap() {
            sent += 1;
        } else {
            std::thread::yield_now();
        }
    }
    sent
}
