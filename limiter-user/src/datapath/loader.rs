//! Loads the embedded kernel programs and attaches them to interfaces.

use std::path::{Path, PathBuf};

use aya::{
    Ebpf, EbpfLoader,
    programs::{
        LinkOrder, ProgramError, SchedClassifier, TcAttachType, Xdp, XdpMode,
        links::{FdLink, PinnedLink},
        tc::{SchedClassifierLink, TcAttachOptions},
        xdp::{XdpLink, XdpLinkId},
    },
};
use limiter_common::map_names;
use thiserror::Error;

use super::{
    Maps, MapsError,
    kernel_floor::{self, KernelError},
    pins,
    programs::{
        ADJUST_PROGRAM, ADOPT_PROGRAM, RELEASE_PROGRAM, TC_INGRESS_PROGRAM, TC_PROGRAM,
        XDP_PROGRAM, program,
    },
    tc_legacy::{self, TcLegacyError},
};

/// The kernel object, built by `cargo xtask build` and embedded so the agent is one file.
pub static EBPF_OBJECT: &[u8] = aya::include_bytes_aligned!(env!("LIMITER_EBPF_OBJECT"));

#[derive(Debug, Error)]
pub enum LoadError {
    #[error(transparent)]
    Kernel(#[from] KernelError),
    #[error("loading the eBPF object")]
    Load(#[from] aya::EbpfError),
    /// build.rs embedded an empty stub because the object had not been built.
    #[error("this agent was built without its eBPF object: build it with `cargo xtask build`")]
    NoObject,
    #[error("map {0} is missing from the eBPF object")]
    MissingMap(&'static str),
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
    /// Boxed: the netlink errors inside are large, and every `Result` here carries them.
    #[error(transparent)]
    TcLegacy(Box<TcLegacyError>),
    #[error("finding the default route's interface: {0}")]
    DefaultRoute(String),
    #[error(transparent)]
    Maps(#[from] MapsError),
    #[error("forwarding the kernel log")]
    Log(#[from] aya_log::Error),
    #[error("a helper program returned {0}, which it never should")]
    Helper(u32),
    #[error("pin {path}")]
    Pin {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    /// A pin left by a build of limiter whose map layout differs: adopting it would feed the
    /// programs values of the wrong shape, so the verifier (or worse, the data) would break.
    #[error(
        "the pinned map {name} at {path} has {found}, but this agent's programs need {expected}: \
         it was made by another version of limiter; run `limiter detach --pin-dir {pin_dir}` \
         (this drops the pinned counts, bans and buckets) and start again"
    )]
    IncompatiblePin {
        name: &'static str,
        path: PathBuf,
        pin_dir: String,
        found: String,
        expected: String,
    },
    #[error("reading the pinned map {path}")]
    PinInfo {
        path: PathBuf,
        #[source]
        source: aya::maps::MapError,
    },
    #[error("reading the map layouts of the eBPF object")]
    Object(#[from] aya_obj::ParseError),
    #[error("pinned link {path}")]
    Link {
        path: PathBuf,
        #[source]
        source: aya::programs::links::LinkError,
    },
}

impl From<TcLegacyError> for LoadError {
    fn from(error: TcLegacyError) -> Self {
        Self::TcLegacy(Box::new(error))
    }
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
            flow_table_size: limiter_common::map_catalogue::FLOWS.default_entries,
            half_open_size: limiter_common::map_catalogue::HALF_OPEN.default_entries,
            kernel_debug: false,
            pin_dir: None,
        }
    }
}

/// Refuses pinned maps whose type, key or value size differ from the object's before anything
/// is loaded: aya adopts a pin by name alone, and a map of another layout would be read with
/// this build's types.
fn check_pinned_layouts(pin_dir: &Path) -> Result<(), LoadError> {
    let object = aya_obj::Object::parse(EBPF_OBJECT)?;
    for def in limiter_common::map_catalogue::ALL {
        let path = pins::map(pin_dir, def.name);
        if !path.exists() {
            continue;
        }
        let Some(want) = object.maps.get(def.name) else {
            return Err(LoadError::MissingMap(def.name));
        };
        let info = aya::maps::MapInfo::from_pin(&path).map_err(|source| LoadError::PinInfo {
            path: path.clone(),
            source,
        })?;
        let layout = |kind: u32, key: u32, value: u32| {
            format!("map type {kind}, key size {key}, value size {value}")
        };
        // A type this aya cannot name is no type the object uses.
        let kind = info.map_type().map_or(u32::MAX, |kind| kind as u32);
        let found = layout(kind, info.key_size(), info.value_size());
        let expected = layout(want.map_type(), want.key_size(), want.value_size());
        if found != expected {
            return Err(LoadError::IncompatiblePin {
                name: def.name,
                path,
                pin_dir: pin_dir.display().to_string(),
                found,
                expected,
            });
        }
    }
    Ok(())
}

/// Swaps this agent's program into a link an earlier agent pinned, with no moment
/// unenforced. A macro because aya's link and program types share these methods by name, not
/// through a trait.
macro_rules! adopt {
    ($self:ident, $program:ty, $link:ty, $name:expr, $pin:expr, $iface:expr) => {{
        let link = <$link>::try_from(pinned_link($pin)?).map_err(|source| LoadError::Link {
            path: $pin.to_path_buf(),
            source,
        })?;
        let program = program::<$program>(&mut $self.ebpf, $name)?;
        let id = program
            .attach_to_link(link)
            .map_err(|source| attach_error($name, $iface, source))?;
        // Taken out of the program so that dropping the program leaves it attached.
        drop(
            program
                .take_link(id)
                .map_err(|source| attach_error($name, $iface, source))?,
        );
    }};
}

/// The TC programs and where each attaches.
const TC_PROGRAMS: [(&str, TcAttachType); 2] = [
    (TC_PROGRAM, TcAttachType::Egress),
    (TC_INGRESS_PROGRAM, TcAttachType::Ingress),
];

/// How an interface came to be enforced.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Attachment {
    /// Attached afresh: XDP in this mode, TC through this path.
    New(XdpAttachMode, TcPath),
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

/// How a TC program is attached: through a TCX link (6.6 and later), or through a netlink
/// filter on the clsact qdisc where the kernel has no TCX (see `tc_legacy`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum TcPath {
    Tcx,
    Netlink,
}

/// The loaded programs and their maps; dropping it detaches everything it attached.
pub struct Datapath {
    pub(super) ebpf: Ebpf,
    pub maps: Maps,
    logger: Option<KernelLogger>,
    pin_dir: Option<PathBuf>,
    /// The smallest MTU of the interfaces attached, for the SYN cookies' MSS.
    smallest_mtu: Option<u32>,
}

pub type KernelLogger = aya_log::EbpfLogger<&'static dyn log::Log>;

impl Datapath {
    pub fn load(options: LoadOptions) -> Result<Self, LoadError> {
        if EBPF_OBJECT.is_empty() {
            return Err(LoadError::NoObject);
        }
        kernel_floor::check_running()?;
        // aya-log's levels: 0 turns every statement off, 4 keeps debug and above.
        let log_level: u8 = if options.kernel_debug { 4 } else { 0 };
        let mut loader = EbpfLoader::new();
        loader
            .map_max_entries(map_names::FLOWS, options.flow_table_size)
            .map_max_entries(map_names::HALF_OPEN, options.half_open_size)
            .map_max_entries(map_names::SOURCE_CONNS, options.flow_table_size)
            .map_max_entries(
                map_names::SYN_BUCKETS,
                options.flow_table_size.next_power_of_two(),
            )
            .map_max_entries(map_names::BLOCKED, options.flow_table_size)
            .map_max_entries(map_names::OFFENDERS, options.flow_table_size)
            .override_global(aya_log::LEVEL, &log_level, true);
        if let Some(dir) = &options.pin_dir {
            pins::ensure_bpffs(dir)?;
            let maps = pins::maps(dir);
            std::fs::create_dir_all(&maps)
                .map_err(|source| LoadError::Pin { path: maps, source })?;
            check_pinned_layouts(dir)?;
            // Every catalogued map outlives the agent (the log ring buffer is not one of them).
            for map in limiter_common::map_catalogue::ALL {
                loader.map_pin_path(map.name, pins::map(dir, map.name));
            }
        }
        let mut ebpf = loader.load(EBPF_OBJECT)?;
        for name in [XDP_PROGRAM, RELEASE_PROGRAM, ADJUST_PROGRAM, ADOPT_PROGRAM] {
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
            smallest_mtu: None,
        })
    }

    /// The kernel log's ring buffer, when `kernel_debug` is on; the caller polls it and calls
    /// `flush` whenever it is readable.
    pub fn take_logger(&mut self) -> Option<KernelLogger> {
        self.logger.take()
    }

    /// Enforces on `iface`: XDP on ingress, TC on egress (close tracking) and on ingress
    /// (answering the SYNs XDP marked for an RST). With a pin directory, links an earlier agent
    /// pinned for `iface` are adopted (their programs swapped for ours, with no moment
    /// unenforced); otherwise the programs are attached and their links pinned.
    pub fn attach(&mut self, iface: &str, mode: XdpAttachMode) -> Result<Attachment, LoadError> {
        let attached = self.attach_programs(iface, mode)?;
        self.learn_cookie_terms(iface);
        Ok(attached)
    }

    /// Reads what the host's TCP stack lets a SYN cookie offer on `iface` (its MTU, and the
    /// sysctls), says what it found, and hands it to the programs. The smallest MTU of the
    /// interfaces attached wins. A host that cannot be read keeps the safe defaults.
    fn learn_cookie_terms(&mut self, iface: &str) {
        let host = match super::HostTcp::read() {
            Ok(host) => host,
            Err(error) => {
                tracing::warn!(error = %crate::errors::error_chain(&error), "SYN cookies will offer only a small MSS");
                return;
            }
        };
        let mtu = match super::host_tcp::mtu(iface) {
            Ok(mtu) => mtu,
            Err(error) => {
                tracing::warn!(error = %crate::errors::error_chain(&error), "SYN cookies will offer only a small MSS");
                return;
            }
        };
        let mtu = self.smallest_mtu.map_or(mtu, |seen| seen.min(mtu));
        self.smallest_mtu = Some(mtu);
        let terms = host.terms(mtu);
        tracing::info!(
            ?host,
            ?terms,
            iface,
            "the host's TCP settings for SYN cookies"
        );
        for finding in host.findings() {
            tracing::warn!("SYN cookies: {finding}");
        }
        if let Err(error) = self.maps.set_cookie_terms(terms) {
            tracing::warn!(error = %crate::errors::error_chain(&error), "writing the SYN cookie terms");
        }
    }

    fn attach_programs(
        &mut self,
        iface: &str,
        mode: XdpAttachMode,
    ) -> Result<Attachment, LoadError> {
        let Some(dir) = self.pin_dir.clone() else {
            let (taken, _) = self.attach_xdp(iface, mode)?;
            let mut path = TcPath::Tcx;
            for (name, direction) in TC_PROGRAMS {
                path = self.attach_tc(name, iface, direction, None)?;
            }
            return Ok(Attachment::New(taken, path));
        };
        let xdp_pin = pins::xdp_link(&dir, iface);
        let taken = if xdp_pin.exists() {
            adopt!(self, Xdp, XdpLink, XDP_PROGRAM, &xdp_pin, iface);
            None
        } else {
            let link_dir = pins::links(&dir, iface);
            std::fs::create_dir_all(&link_dir).map_err(|source| LoadError::Pin {
                path: link_dir,
                source,
            })?;
            let (taken, xdp_id) = self.attach_xdp(iface, mode)?;
            let link = program::<Xdp>(&mut self.ebpf, XDP_PROGRAM)?
                .take_link(xdp_id)
                .map_err(|source| attach_error(XDP_PROGRAM, iface, source))?;
            pin_link(FdLink::try_from(link), &xdp_pin)?;
            Some(taken)
        };
        let mut path = TcPath::Tcx;
        for (name, direction) in TC_PROGRAMS {
            // Each TC program is adopted or attached on its own: an agent from before the
            // ingress program existed left nothing for it.
            path = if pins::tc_attached(&dir, iface, direction) {
                self.adopt_tc(name, iface, direction, &dir)?
            } else {
                self.attach_tc(name, iface, direction, Some(&dir))?
            };
        }
        Ok(match taken {
            Some(mode) => Attachment::New(mode, path),
            None => Attachment::Adopted,
        })
    }

    /// Attaches the XDP program to `iface`, the link owned by this process.
    fn attach_xdp(
        &mut self,
        iface: &str,
        mode: XdpAttachMode,
    ) -> Result<(XdpAttachMode, XdpLinkId), LoadError> {
        let xdp = program::<Xdp>(&mut self.ebpf, XDP_PROGRAM)?;
        match mode {
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
        .map_err(|source| attach_error(XDP_PROGRAM, iface, source))
    }

    /// Attaches the TC program `name` to `iface` in `direction`: through a TCX link where the
    /// kernel has TCX, else through a netlink filter (`tc_legacy`). With a pin directory the
    /// attachment outlives this process: the TCX link is pinned, or the netlink filter is
    /// recorded, under the interface's link directory, where [`Self::adopt_tc`] and `limiter
    /// detach` find it. Any TC program of the object, either direction.
    pub fn attach_tc(
        &mut self,
        name: &'static str,
        iface: &str,
        direction: TcAttachType,
        pin_dir: Option<&Path>,
    ) -> Result<TcPath, LoadError> {
        let tc = program::<SchedClassifier>(&mut self.ebpf, name)?;
        match tc.attach_with_options(
            iface,
            direction,
            TcAttachOptions::TcxOrder(LinkOrder::default()),
        ) {
            Ok(id) => {
                tracing::info!(iface, program = name, "TC attached through a TCX link");
                if let Some(dir) = pin_dir {
                    let link = tc
                        .take_link(id)
                        .map_err(|source| attach_error(name, iface, source))?;
                    pin_link(
                        FdLink::try_from(link),
                        &pins::tc_link(dir, iface, direction),
                    )?;
                }
                Ok(TcPath::Tcx)
            }
            // Kernels before 6.6 know no TCX attach type, and BPF_LINK_CREATE says EINVAL.
            Err(ProgramError::SyscallError(e))
                if e.io_error.raw_os_error() == Some(libc::EINVAL) =>
            {
                tracing::info!(
                    iface,
                    program = name,
                    error = %e.io_error,
                    "no TCX on this kernel: TC attached through a netlink filter"
                );
                let record =
                    pin_dir.map(|dir| (pins::links(dir, iface), pins::tc_link_file(direction)));
                tc_legacy::attach(
                    tc,
                    name,
                    iface,
                    direction,
                    record.as_ref().map(|(dir, file)| (dir.as_path(), *file)),
                )?;
                Ok(TcPath::Netlink)
            }
            Err(source) => Err(attach_error(name, iface, source)),
        }
    }

    /// Swaps the TC program `name` into what an earlier agent left on `iface` in `direction`:
    /// its pinned TCX link, or its recorded netlink filter, with no moment unenforced.
    pub fn adopt_tc(
        &mut self,
        name: &'static str,
        iface: &str,
        direction: TcAttachType,
        pin_dir: &Path,
    ) -> Result<TcPath, LoadError> {
        let link_dir = pins::links(pin_dir, iface);
        let file = pins::tc_link_file(direction);
        if tc_legacy::recorded(&link_dir, file) {
            let tc = program::<SchedClassifier>(&mut self.ebpf, name)?;
            tc_legacy::adopt(tc, name, iface, direction)?;
            return Ok(TcPath::Netlink);
        }
        let pin = pins::tc_link(pin_dir, iface, direction);
        adopt!(
            self,
            SchedClassifier,
            SchedClassifierLink,
            name,
            &pin,
            iface
        );
        Ok(TcPath::Tcx)
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
