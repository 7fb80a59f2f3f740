//! Loads the embedded kernel programs and attaches them to interfaces.

use std::{
    fs,
    path::{Path, PathBuf},
};

use aya::{
    Ebpf, EbpfLoader, TestRun,
    programs::{
        ProgramError, SchedClassifier, TcAttachType, TestRunOptions, Xdp, XdpMode,
        links::{FdLink, PinnedLink},
        tc::{SchedClassifierLink, SchedClassifierLinkId},
        xdp::{XdpLink, XdpLinkId},
    },
};
use limiter_common::{AdjustRequest, FlowKey, ReleaseRequest, map_names, release};
use thiserror::Error;

use crate::maps::{Maps, MapsError};

/// The kernel object, built by `cargo xtask build` and embedded so the agent is one file.
pub static EBPF_OBJECT: &[u8] = aya::include_bytes_aligned!(env!("LIMITER_EBPF_OBJECT"));

pub const XDP_PROGRAM: &str = "limiter_xdp";
pub const TC_PROGRAM: &str = "limiter_tc";
/// TC ingress: answers the SYNs the XDP program refused with `rst` and marked (see
/// `Config::rst_xdp_tx`).
pub const TC_INGRESS_PROGRAM: &str = "limiter_tc_ingress";
pub const RELEASE_PROGRAM: &str = "limiter_release";
pub const ADJUST_PROGRAM: &str = "limiter_adjust";

#[derive(Debug, Error)]
pub enum LoadError {
    #[error("loading the eBPF object")]
    Load(#[from] aya::EbpfError),
    #[error("program {0} is missing from the eBPF object")]
    MissingProgram(&'static str),
    #[error("preparing program {name}")]
    Program {
        name: &'static str,
        #[source]
        source: ProgramError,
    },
    #[error("attaching {name} to {iface}")]
    Attach {
        name: &'static str,
        iface: String,
        #[source]
        source: ProgramError,
    },
    #[error("finding the default route's interface: {0}")]
    DefaultRoute(String),
    #[error(transparent)]
    Maps(#[from] MapsError),
    #[error("forwarding the kernel log")]
    Log(#[from] aya_log::Error),
    #[error("a helper program returned {0}, which it never should")]
    Release(u32),
    #[error("pin {path}")]
    Pin {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("pinned link {path}")]
    Link {
        path: PathBuf,
        #[source]
        source: aya::programs::links::LinkError,
    },
}

/// How the kernel programs are loaded.
#[derive(Clone, Debug)]
pub struct LoadOptions {
    /// Sizes the flow table and the per-source tables.
    pub flow_table_size: u32,
    /// Sizes the LRU table of half-open connections (SYN seen, handshake not completed).
    pub half_open_size: u32,
    /// Keeps the programs' debug log statements (otherwise the verifier removes them).
    pub kernel_debug: bool,
    /// Where maps and links are pinned. With a pin directory the programs stay attached when
    /// the agent exits or dies, and the next agent adopts the maps (and so every count, ban and
    /// bucket) and swaps its programs into the same links. Without one, everything is this
    /// process's and goes with it.
    pub pin_dir: Option<PathBuf>,
}

impl Default for LoadOptions {
    fn default() -> Self {
        Self {
            flow_table_size: limiter_common::maps::FLOWS.default_entries,
            half_open_size: limiter_common::maps::HALF_OPEN.default_entries,
            kernel_debug: false,
            pin_dir: None,
        }
    }
}

/// The maps whose state must outlive an agent (everything but the log ring buffer).
const PINNED_MAPS: &[&str] = &[
    map_names::CONFIG,
    map_names::PORTS,
    map_names::FLOWS,
    map_names::HALF_OPEN,
    map_names::ACK_HINTS,
    map_names::SOURCE_CONNS,
    map_names::GLOBAL_CONNS,
    map_names::SYN_BUCKETS,
    map_names::BANS,
    map_names::ALLOW_V4,
    map_names::ALLOW_V6,
    map_names::DENY_V4,
    map_names::DENY_V6,
    map_names::STATS,
    map_names::EVENTS,
    map_names::BLOCKED,
];

/// The layout under a pin directory: `maps/<MAP>` shared by every interface, and
/// `<iface>/xdp` and `<iface>/tc` holding one interface's links.
pub mod pins {
    use std::path::{Path, PathBuf};

    pub fn maps(pin_dir: &Path) -> PathBuf {
        pin_dir.join("maps")
    }

    pub fn map(pin_dir: &Path, name: &str) -> PathBuf {
        maps(pin_dir).join(name)
    }

    pub fn links(pin_dir: &Path, iface: &str) -> PathBuf {
        pin_dir.join("links").join(iface)
    }

    pub fn xdp_link(pin_dir: &Path, iface: &str) -> PathBuf {
        links(pin_dir, iface).join("xdp")
    }

    pub fn tc_link(pin_dir: &Path, iface: &str) -> PathBuf {
        links(pin_dir, iface).join("tc")
    }

    pub fn tc_ingress_link(pin_dir: &Path, iface: &str) -> PathBuf {
        links(pin_dir, iface).join("tc_ingress")
    }
}

/// How an interface came to be enforced.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Attachment {
    /// Attached afresh, in this XDP mode.
    New(XdpAttachMode),
    /// The pinned links of an earlier agent now run this agent's programs.
    Adopted,
}

/// How the XDP program attaches: `Auto` tries the driver first and falls back to generic.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum XdpAttachMode {
    Auto,
    Native,
    Skb,
}

/// The loaded programs and their maps; dropping it detaches everything it attached.
pub struct Datapath {
    ebpf: Ebpf,
    pub maps: Maps,
    logger: Option<KernelLogger>,
    pin_dir: Option<PathBuf>,
}

pub type KernelLogger = aya_log::EbpfLogger<&'static dyn log::Log>;

impl Datapath {
    pub fn load(options: LoadOptions) -> Result<Self, LoadError> {
        // aya-log's levels: 0 turns every statement off, 4 keeps debug and above.
        let log_level: u8 = if options.kernel_debug { 4 } else { 0 };
        let mut loader = EbpfLoader::new();
        loader
            .map_max_entries(map_names::FLOWS, options.flow_table_size)
            .map_max_entries(map_names::HALF_OPEN, options.half_open_size)
            .map_max_entries(map_names::SOURCE_CONNS, options.flow_table_size)
            .map_max_entries(map_names::SYN_BUCKETS, options.flow_table_size)
            .map_max_entries(map_names::BLOCKED, options.flow_table_size)
            .override_global(aya_log::LEVEL, &log_level, true);
        if let Some(dir) = &options.pin_dir {
            ensure_bpffs(dir)?;
            let maps = pins::maps(dir);
            std::fs::create_dir_all(&maps)
                .map_err(|source| LoadError::Pin { path: maps, source })?;
            for name in PINNED_MAPS {
                loader.map_pin_path(name, pins::map(dir, name));
            }
        }
        let mut ebpf = loader.load(EBPF_OBJECT)?;
        for name in [XDP_PROGRAM, RELEASE_PROGRAM, ADJUST_PROGRAM] {
            program::<Xdp>(&mut ebpf, name)?
                .load()
                .map_err(|source| LoadError::Program { name, source })?;
        }
        for name in [TC_PROGRAM, TC_INGRESS_PROGRAM] {
            program::<SchedClassifier>(&mut ebpf, name)?
                .load()
                .map_err(|source| LoadError::Program { name, source })?;
        }
        let logger = if options.kernel_debug {
            Some(aya_log::EbpfLogger::init(&mut ebpf)?)
        } else {
            None
        };
        let maps = Maps::take(&mut ebpf)?;
        Ok(Self {
            ebpf,
            maps,
            logger,
            pin_dir: options.pin_dir,
        })
    }

    /// The kernel log's ring buffer, when `kernel_debug` is on; the caller polls it and calls
    /// `flush` whenever it is readable.
    pub fn take_logger(&mut self) -> Option<KernelLogger> {
        self.logger.take()
    }

    /// Removes a flow and releases its slots exactly once, with the kernel's own atomics
    /// (through the release program), so it can never race the datapath into a double
    /// release. Returns whether this call released it.
    pub fn release(&mut self, flow: &FlowKey) -> Result<bool, LoadError> {
        self.run_helper(RELEASE_PROGRAM, &ReleaseRequest { flow: *flow })
    }

    /// Adds `delta` to a source's counter (or the global one), atomically in the kernel.
    pub fn adjust(&mut self, request: &AdjustRequest) -> Result<bool, LoadError> {
        self.run_helper(ADJUST_PROGRAM, request)
    }

    /// Runs one of the helper programs with `request` as its packet.
    fn run_helper<T: aya::Pod>(
        &mut self,
        name: &'static str,
        request: &T,
    ) -> Result<bool, LoadError> {
        // SAFETY: `T: Pod` is plain data with no padding the compiler adds.
        let bytes = unsafe {
            std::slice::from_raw_parts((request as *const T).cast::<u8>(), std::mem::size_of::<T>())
        };
        let result = program::<Xdp>(&mut self.ebpf, name)?
            .test_run(TestRunOptions {
                data_in: Some(bytes),
                ..Default::default()
            })
            .map_err(|source| LoadError::Program { name, source })?;
        match result.return_value {
            release::RELEASED => Ok(true),
            release::ABSENT => Ok(false),
            other => Err(LoadError::Release(other)),
        }
    }

    /// Enforces on `iface`: XDP and TC (answering marked SYNs) on ingress, TC on egress. With a pin directory, links an
    /// earlier agent pinned for `iface` are adopted (their programs swapped for ours, with no
    /// moment unenforced); otherwise the programs are attached and their links pinned.
    pub fn attach(&mut self, iface: &str, mode: XdpAttachMode) -> Result<Attachment, LoadError> {
        let Some(dir) = self.pin_dir.clone() else {
            let (mode, _, _) = self.attach_unpinned(iface, mode)?;
            self.attach_tc_ingress_unpinned(iface)?;
            return Ok(Attachment::New(mode));
        };
        let (xdp_pin, tc_pin) = (pins::xdp_link(&dir, iface), pins::tc_link(&dir, iface));
        if xdp_pin.exists() && tc_pin.exists() {
            let link = pinned_link(&xdp_pin)?;
            let link = XdpLink::try_from(link).map_err(|source| LoadError::Link {
                path: xdp_pin.clone(),
                source,
            })?;
            let xdp = program::<Xdp>(&mut self.ebpf, XDP_PROGRAM)?;
            let id = xdp
                .attach_to_link(link)
                .map_err(|source| attach_error(XDP_PROGRAM, iface, source))?;
            // Taken out of the program so that dropping the program leaves it attached.
            drop(
                xdp.take_link(id)
                    .map_err(|source| attach_error(XDP_PROGRAM, iface, source))?,
            );
            self.adopt_tc(TC_PROGRAM, &tc_pin, iface)?;
            self.tc_ingress_pinned(&dir, iface)?;
            return Ok(Attachment::Adopted);
        }
        let (taken, xdp_id, tc_id) = self.attach_unpinned(iface, mode)?;
        let link_dir = pins::links(&dir, iface);
        std::fs::create_dir_all(&link_dir).map_err(|source| LoadError::Pin {
            path: link_dir,
            source,
        })?;
        let link = program::<Xdp>(&mut self.ebpf, XDP_PROGRAM)?
            .take_link(xdp_id)
            .map_err(|source| attach_error(XDP_PROGRAM, iface, source))?;
        pin_link(FdLink::try_from(link), &xdp_pin)?;
        let link = program::<SchedClassifier>(&mut self.ebpf, TC_PROGRAM)?
            .take_link(tc_id)
            .map_err(|source| attach_error(TC_PROGRAM, iface, source))?;
        pin_link(FdLink::try_from(link), &tc_pin)?;
        self.tc_ingress_pinned(&dir, iface)?;
        Ok(Attachment::New(taken))
    }

    /// Swaps our TC program `name` into the pinned link at `pin`.
    fn adopt_tc(&mut self, name: &'static str, pin: &Path, iface: &str) -> Result<(), LoadError> {
        let link = pinned_link(pin)?;
        let link = SchedClassifierLink::try_from(link).map_err(|source| LoadError::Link {
            path: pin.to_path_buf(),
            source,
        })?;
        let tc = program::<SchedClassifier>(&mut self.ebpf, name)?;
        let id = tc
            .attach_to_link(link)
            .map_err(|source| attach_error(name, iface, source))?;
        // Taken out of the program so that dropping the program leaves it attached.
        drop(
            tc.take_link(id)
                .map_err(|source| attach_error(name, iface, source))?,
        );
        Ok(())
    }

    /// The TC ingress program on `iface`, pinned: adopted from an earlier agent's pin, or
    /// attached and pinned (an agent from before the program existed pinned none).
    fn tc_ingress_pinned(&mut self, dir: &Path, iface: &str) -> Result<(), LoadError> {
        let pin = pins::tc_ingress_link(dir, iface);
        if pin.exists() {
            return self.adopt_tc(TC_INGRESS_PROGRAM, &pin, iface);
        }
        let tc = program::<SchedClassifier>(&mut self.ebpf, TC_INGRESS_PROGRAM)?;
        let id = tc
            .attach(iface, TcAttachType::Ingress)
            .map_err(|source| attach_error(TC_INGRESS_PROGRAM, iface, source))?;
        let link = tc
            .take_link(id)
            .map_err(|source| attach_error(TC_INGRESS_PROGRAM, iface, source))?;
        pin_link(FdLink::try_from(link), &pin)
    }

    /// Attaches both programs to `iface`, the links owned by this process.
    fn attach_unpinned(
        &mut self,
        iface: &str,
        mode: XdpAttachMode,
    ) -> Result<(XdpAttachMode, XdpLinkId, SchedClassifierLinkId), LoadError> {
        let xdp = program::<Xdp>(&mut self.ebpf, XDP_PROGRAM)?;
        let (taken, xdp_id) = match mode {
            XdpAttachMode::Native => xdp.attach(iface, XdpMode::Driver).map(|id| (mode, id)),
            XdpAttachMode::Skb => xdp.attach(iface, XdpMode::Skb).map(|id| (mode, id)),
            XdpAttachMode::Auto => xdp
                .attach(iface, XdpMode::Driver)
                .map(|id| (XdpAttachMode::Native, id))
                .or_else(|error| {
                    tracing::info!(iface, %error, "native XDP unavailable, using generic (skb) mode");
                    xdp.attach(iface, XdpMode::Skb)
                        .map(|id| (XdpAttachMode::Skb, id))
                }),
        }
        .map_err(|source| attach_error(XDP_PROGRAM, iface, source))?;
        let tc_id = program::<SchedClassifier>(&mut self.ebpf, TC_PROGRAM)?
            .attach(iface, TcAttachType::Egress)
            .map_err(|source| attach_error(TC_PROGRAM, iface, source))?;
        Ok((taken, xdp_id, tc_id))
    }

    /// Attaches the TC ingress program to `iface`, the link owned by this process (the pinned
    /// path attaches it in [`Datapath::attach`]).
    fn attach_tc_ingress_unpinned(&mut self, iface: &str) -> Result<(), LoadError> {
        program::<SchedClassifier>(&mut self.ebpf, TC_INGRESS_PROGRAM)?
            .attach(iface, TcAttachType::Ingress)
            .map(drop)
            .map_err(|source| attach_error(TC_INGRESS_PROGRAM, iface, source))
    }

    /// The loaded object, so its programs can be run directly (`BPF_PROG_TEST_RUN` in the
    /// tests and the kernel benchmark).
    pub fn ebpf(&self) -> &Ebpf {
        &self.ebpf
    }
}

fn attach_error(name: &'static str, iface: &str, source: ProgramError) -> LoadError {
    LoadError::Attach {
        name,
        iface: iface.to_string(),
        source,
    }
}

fn pinned_link(path: &Path) -> Result<FdLink, LoadError> {
    PinnedLink::from_pin(path)
        .map(FdLink::from)
        .map_err(|source| LoadError::Link {
            path: path.to_path_buf(),
            source,
        })
}

fn pin_link<E>(link: Result<FdLink, E>, path: &Path) -> Result<(), LoadError>
where
    E: Into<aya::programs::links::LinkError>,
{
    let link = link.map_err(|e| LoadError::Link {
        path: path.to_path_buf(),
        source: e.into(),
    })?;
    // Dropping the pinned handle keeps the pin, and with it the link.
    link.pin(path).map(drop).map_err(|e| LoadError::Pin {
        path: path.to_path_buf(),
        source: std::io::Error::other(e),
    })
}

/// Where the BPF filesystem is conventionally mounted.
const BPFFS: &str = "/sys/fs/bpf";

/// Makes sure `pin_dir` lies on a BPF filesystem, mounting one at /sys/fs/bpf when the pin
/// directory is under it and nothing is mounted there yet (minimal hosts and containers often
/// boot without it). Pins anywhere else must already be on a BPF filesystem.
fn ensure_bpffs(pin_dir: &Path) -> Result<(), LoadError> {
    let on_bpffs = |path: &Path| {
        nix::sys::statfs::statfs(path)
            .is_ok_and(|fs| fs.filesystem_type() == nix::sys::statfs::BPF_FS_MAGIC)
    };
    let mut existing = pin_dir;
    while !existing.exists() {
        match existing.parent() {
            Some(parent) => existing = parent,
            None => break,
        }
    }
    if on_bpffs(existing) {
        return Ok(());
    }
    let not_bpffs = |why: String| LoadError::Pin {
        path: pin_dir.to_path_buf(),
        source: std::io::Error::other(why),
    };
    if !pin_dir.starts_with(BPFFS) {
        return Err(not_bpffs(format!(
            "{} is not on a BPF filesystem",
            existing.display()
        )));
    }
    tracing::info!("mounting the BPF filesystem at {BPFFS}");
    nix::mount::mount(
        Some("bpf"),
        BPFFS,
        Some("bpf"),
        nix::mount::MsFlags::empty(),
        Some("mode=0700"),
    )
    .map_err(|e| not_bpffs(format!("mounting a BPF filesystem at {BPFFS}: {e}")))
}

/// Detaches limiter from `iface` (or every interface with pinned links when `None`) by
/// removing the pinned links; once no interface is left, the pinned maps go too. Returns the
/// interfaces detached.
pub fn detach(pin_dir: &Path, iface: Option<&str>) -> Result<Vec<String>, LoadError> {
    let links = pin_dir.join("links");
    let ifaces: Vec<String> = match iface {
        Some(iface) => vec![iface.to_string()],
        None => match std::fs::read_dir(&links) {
            Ok(entries) => entries
                .filter_map(|e| e.ok())
                .map(|e| e.file_name().to_string_lossy().into_owned())
                .collect(),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Vec::new(),
            Err(source) => {
                return Err(LoadError::Pin {
                    path: links,
                    source,
                });
            }
        },
    };
    let mut detached = Vec::new();
    for iface in ifaces {
        let dir = pins::links(pin_dir, &iface);
        if !dir.exists() {
            continue;
        }
        for path in [
            pins::xdp_link(pin_dir, &iface),
            pins::tc_link(pin_dir, &iface),
            pins::tc_ingress_link(pin_dir, &iface),
        ] {
            if path.exists() {
                // Unpinning drops the last reference to the link, which detaches the program.
                let link = PinnedLink::from_pin(&path).map_err(|source| LoadError::Link {
                    path: path.clone(),
                    source,
                })?;
                drop(link.unpin().map_err(|source| LoadError::Pin {
                    path: path.clone(),
                    source,
                })?);
            }
        }
        std::fs::remove_dir(&dir).map_err(|source| LoadError::Pin { path: dir, source })?;
        detached.push(iface);
    }
    let remaining = std::fs::read_dir(&links).map(|d| d.count()).unwrap_or(0);
    if remaining == 0 {
        remove_tree(pin_dir)?;
    }
    Ok(detached)
}

/// Removes the pin directory: bpffs unlinks each pin, dropping the kernel's reference.
fn remove_tree(pin_dir: &Path) -> Result<(), LoadError> {
    match std::fs::remove_dir_all(pin_dir) {
        Ok(()) => Ok(()),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(()),
        Err(source) => Err(LoadError::Pin {
            path: pin_dir.to_path_buf(),
            source,
        }),
    }
}

fn program<'a, P>(ebpf: &'a mut Ebpf, name: &'static str) -> Result<&'a mut P, LoadError>
where
    &'a mut P: TryFrom<&'a mut aya::programs::Program, Error = ProgramError>,
{
    ebpf.program_mut(name)
        .ok_or(LoadError::MissingProgram(name))?
        .try_into()
        .map_err(|source| LoadError::Program { name, source })
}

/// The interface of the IPv4 default route, read from `/proc/net/route`.
pub fn default_route_interface() -> Result<String, LoadError> {
    let table = fs::read_to_string("/proc/net/route")
        .map_err(|e| LoadError::DefaultRoute(e.to_string()))?;
    parse_default_route(&table)
        .ok_or_else(|| LoadError::DefaultRoute("no default route in /proc/net/route".into()))
}

fn parse_default_route(table: &str) -> Option<String> {
    table.lines().skip(1).find_map(|line| {
        let mut fields = line.split_whitespace();
        let iface = fields.next()?;
        (fields.next()? == "00000000").then(|| iface.to_string())
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn default_route_is_the_zero_destination() {
        let table = "Iface\tDestination\tGateway\n\
                     eth1\t0000A8C0\t00000000\n\
                     eth0\t00000000\t0100A8C0\n";
        assert_eq!(parse_default_route(table).as_deref(), Some("eth0"));
        assert_eq!(parse_default_route("Iface\tDestination\n"), None);
    }
}
