//! What the host's TCP stack must agree to for the programs' SYN cookies, read from its
//! sysctls (those of the agent's network namespace) and its interfaces' MTU.
//!
//! The programs make a cookie with the host's own secret, and the host builds the connection
//! from the client's ACK (`cookie_v4_check`): it must take cookies at all, must decode the
//! options the SYN-ACK promised in its timestamp, and must pick the window scale that the
//! SYN-ACK announced. [`HostTcp::terms`] derives what the programs may promise, and
//! [`HostTcp::findings`] says what an operator should change.

use std::{fs, io, os::fd::AsRawFd, path::Path};

use thiserror::Error;

#[derive(Debug, Error)]
pub enum HostTcpError {
    #[error("reading {path}")]
    Sysctl {
        path: String,
        #[source]
        source: io::Error,
    },
    #[error("{path} holds `{text}`, not a number")]
    NotANumber { path: String, text: String },
    #[error("reading the MTU of {interface}")]
    Mtu {
        interface: String,
        #[source]
        source: io::Error,
    },
}

/// The sysctls SYN cookies depend on.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct HostTcp {
    /// `net.ipv4.tcp_syncookies`: 2 lets the kernel make a cookie for any listener; 1 only
    /// for one whose queue is full; 0 never.
    pub syncookies: u64,
    /// `net.ipv4.tcp_timestamps`: 2 is timestamps without a per-connection secret offset,
    /// which lets a cookie's timestamp carry its options.
    pub timestamps: u64,
    pub sack: bool,
    pub window_scaling: bool,
    /// The largest of `net.ipv4.tcp_rmem` (its third field).
    pub tcp_rmem_max: u64,
    /// `net.core.rmem_max`.
    pub rmem_max: u64,
}

/// What a cookie's SYN-ACK may offer on this host.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct CookieTerms {
    pub mss_v4: u16,
    pub mss_v6: u16,
    pub wscale: u8,
    /// Whether the SYN-ACK may carry a timestamp with the client's options in it.
    pub timestamps: bool,
}

impl Default for CookieTerms {
    /// Before anything is read: the smallest MSS every path carries, and no options.
    fn default() -> Self {
        Self {
            mss_v4: 536,
            mss_v6: 1220,
            wscale: 0,
            timestamps: false,
        }
    }
}

/// The largest window scale TCP allows (RFC 7323).
const MAX_WSCALE: u32 = 14;

impl HostTcp {
    /// Reads the sysctls of the calling thread's network namespace.
    pub fn read() -> Result<Self, HostTcpError> {
        Self::read_from(Path::new("/proc/sys"))
    }

    fn read_from(root: &Path) -> Result<Self, HostTcpError> {
        let read = |name: &str| -> Result<String, HostTcpError> {
            let path = root.join(name);
            fs::read_to_string(&path).map_err(|source| HostTcpError::Sysctl {
                path: path.display().to_string(),
                source,
            })
        };
        let number = |name: &str, text: &str| -> Result<u64, HostTcpError> {
            text.trim().parse().map_err(|_| HostTcpError::NotANumber {
                path: root.join(name).display().to_string(),
                text: text.trim().to_string(),
            })
        };
        let value = |name: &str| number(name, &read(name)?);
        let rmem = "net/ipv4/tcp_rmem";
        let rmem_text = read(rmem)?;
        Ok(Self {
            syncookies: value("net/ipv4/tcp_syncookies")?,
            timestamps: value("net/ipv4/tcp_timestamps")?,
            sack: value("net/ipv4/tcp_sack")? != 0,
            window_scaling: value("net/ipv4/tcp_window_scaling")? != 0,
            tcp_rmem_max: number(rmem, rmem_text.split_whitespace().last().unwrap_or(""))?,
            rmem_max: value("net/core/rmem_max")?,
        })
    }

    /// The window scale the host picks for a connection it builds from a cookie, as
    /// `tcp_select_initial_window` does for a listener with no receive buffer of its own
    /// (`SO_RCVBUF` on the listener lowers it; README says so).
    pub fn wscale(&self) -> u8 {
        let space = self
            .tcp_rmem_max
            .max(self.rmem_max)
            .min(u64::from(u16::MAX) << MAX_WSCALE);
        (space.max(1).ilog2().saturating_sub(15)).min(MAX_WSCALE) as u8
    }

    /// What a cookie's SYN-ACK may offer, with `mtu` the smallest MTU of the protected
    /// interfaces.
    pub fn terms(&self, mtu: u32) -> CookieTerms {
        let mss = |header: u32| mtu.saturating_sub(header).clamp(536, u32::from(u16::MAX)) as u16;
        CookieTerms {
            mss_v4: mss(40),
            mss_v6: mss(60).max(1220),
            wscale: if self.window_scaling {
                self.wscale()
            } else {
                0
            },
            timestamps: self.timestamps == 2,
        }
    }

    /// What stands between this host and cookies that lose nothing, as an operator should
    /// read it: empty when all is well.
    pub fn findings(&self) -> Vec<String> {
        let mut found = Vec::new();
        if self.syncookies != 2 {
            found.push(format!(
                "net.ipv4.tcp_syncookies is {} (2 needed): the kernel makes a cookie only for a \
                 listener whose queue is full, and other SYNs go to the host's stack",
                self.syncookies
            ));
        }
        if self.timestamps != 2 {
            found.push(format!(
                "net.ipv4.tcp_timestamps is {} (2 needed): cookie connections keep their MSS \
                 but lose window scaling and SACK",
                self.timestamps
            ));
        }
        found
    }
}

/// The MTU of `interface`, asked of the kernel (`SIOCGIFMTU`) in the calling thread's network
/// namespace.
pub fn mtu(interface: &str) -> Result<u32, HostTcpError> {
    let failed = |source| HostTcpError::Mtu {
        interface: interface.to_string(),
        source,
    };
    let name = interface.as_bytes();
    if name.len() >= libc::IFNAMSIZ {
        return Err(failed(io::Error::from(io::ErrorKind::InvalidInput)));
    }
    // A socket only to ask about the interface: it is never bound or used for traffic.
    let socket = std::net::UdpSocket::bind("0.0.0.0:0").map_err(failed)?;
    // SAFETY: a plain C struct, all zeros valid.
    let mut request: libc::ifreq = unsafe { std::mem::zeroed() };
    for (to, from) in request.ifr_name.iter_mut().zip(name) {
        *to = *from as libc::c_char;
    }
    // SAFETY: SIOCGIFMTU reads the name and writes the MTU into the request we own.
    if unsafe { libc::ioctl(socket.as_raw_fd(), libc::SIOCGIFMTU, &mut request) } < 0 {
        return Err(failed(io::Error::last_os_error()));
    }
    // SAFETY: the kernel filled the union's MTU arm.
    Ok(unsafe { request.ifr_ifru.ifru_mtu } as u32)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn host(tcp_rmem_max: u64, rmem_max: u64) -> HostTcp {
        HostTcp {
            syncookies: 2,
            timestamps: 2,
            sack: true,
            window_scaling: true,
            tcp_rmem_max,
            rmem_max,
        }
    }

    #[test]
    fn the_window_scale_is_the_kernels_for_its_largest_buffer() {
        // Debian's defaults: tcp_rmem 4096 131072 6291456, rmem_max 212992.
        assert_eq!(host(6_291_456, 212_992).wscale(), 7);
        assert_eq!(host(4_194_304, 212_992).wscale(), 7);
        assert_eq!(host(65_535, 0).wscale(), 0);
        assert_eq!(host(1 << 40, 0).wscale(), 14);
        let off = HostTcp {
            window_scaling: false,
            ..host(6_291_456, 0)
        };
        assert_eq!(off.terms(1500).wscale, 0);
    }

    #[test]
    fn the_mss_follows_the_mtu() {
        let terms = host(6_291_456, 0).terms(1500);
        assert_eq!((terms.mss_v4, terms.mss_v6), (1460, 1440));
        let tiny = host(6_291_456, 0).terms(576);
        assert_eq!((tiny.mss_v4, tiny.mss_v6), (536, 1220));
        assert_eq!(host(0, 0).terms(65_536).mss_v4, 65_496);
    }

    #[test]
    fn findings_name_the_sysctls_to_change() {
        assert!(host(6_291_456, 0).findings().is_empty());
        let default = HostTcp {
            syncookies: 1,
            timestamps: 1,
            ..host(6_291_456, 0)
        };
        let found = default.findings();
        assert_eq!(found.len(), 2);
        assert!(found[0].contains("net.ipv4.tcp_syncookies is 1"));
        assert!(found[1].contains("net.ipv4.tcp_timestamps is 1"));
        assert!(!default.terms(1500).timestamps);
    }

    #[test]
    fn sysctls_are_read_from_their_files() {
        let dir = tempfile::tempdir().unwrap();
        for (name, value) in [
            ("net/ipv4/tcp_syncookies", "2\n"),
            ("net/ipv4/tcp_timestamps", "1\n"),
            ("net/ipv4/tcp_sack", "1\n"),
            ("net/ipv4/tcp_window_scaling", "1\n"),
            ("net/ipv4/tcp_rmem", "4096\t131072\t6291456\n"),
            ("net/core/rmem_max", "212992\n"),
        ] {
            let path = dir.path().join(name);
            fs::create_dir_all(path.parent().unwrap()).unwrap();
            fs::write(path, value).unwrap();
        }
        let read = HostTcp::read_from(dir.path()).unwrap();
        assert_eq!(read.timestamps, 1);
        assert_eq!(read.tcp_rmem_max, 6_291_456);
        fs::write(dir.path().join("net/ipv4/tcp_sack"), "yes").unwrap();
        let error = HostTcp::read_from(dir.path()).unwrap_err().to_string();
        assert!(error.contains("tcp_sack holds `yes`"), "{error}");
    }
}
