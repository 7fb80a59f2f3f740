//! Loads the embedded kernel programs and attaches them to interfaces.

use std::fs;

use aya::{
    Ebpf, EbpfLoader, TestRun,
    programs::{ProgramError, SchedClassifier, TcAttachType, TestRunOptions, Xdp, XdpMode},
};
use limiter_common::{FlowKey, ReleaseRequest, map_names, release};
use thiserror::Error;

use crate::maps::{Maps, MapsError};

/// The kernel object, built by `cargo xtask build` and embedded so the agent is one file.
pub static EBPF_OBJECT: &[u8] = aya::include_bytes_aligned!(env!("LIMITER_EBPF_OBJECT"));

pub const XDP_PROGRAM: &str = "limiter_xdp";
pub const TC_PROGRAM: &str = "limiter_tc";
pub const RELEASE_PROGRAM: &str = "limiter_release";

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
    #[error("the release program returned {0}, which it never should")]
    Release(u32),
}

/// How the kernel programs are loaded.
#[derive(Clone, Copy, Debug)]
pub struct LoadOptions {
    /// Sizes the flow table and the per-source tables.
    pub flow_table_size: u32,
    /// Keeps the programs' debug log statements (otherwise the verifier removes them).
    pub kernel_debug: bool,
}

impl Default for LoadOptions {
    fn default() -> Self {
        Self {
            flow_table_size: 65_536,
            kernel_debug: false,
        }
    }
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
}

pub type KernelLogger = aya_log::EbpfLogger<&'static dyn log::Log>;

impl Datapath {
    pub fn load(options: LoadOptions) -> Result<Self, LoadError> {
        // aya-log's levels: 0 turns every statement off, 4 keeps debug and above.
        let log_level: u8 = if options.kernel_debug { 4 } else { 0 };
        let mut ebpf = EbpfLoader::new()
            .map_max_entries(map_names::FLOWS, options.flow_table_size)
            .map_max_entries(map_names::SOURCE_CONNS, options.flow_table_size)
            .map_max_entries(map_names::SYN_BUCKETS, options.flow_table_size)
            .map_max_entries(map_names::BLOCKED, options.flow_table_size)
            .override_global(aya_log::LEVEL, &log_level, true)
            .load(EBPF_OBJECT)?;
        for name in [XDP_PROGRAM, RELEASE_PROGRAM] {
            program::<Xdp>(&mut ebpf, name)?
                .load()
                .map_err(|source| LoadError::Program { name, source })?;
        }
        program::<SchedClassifier>(&mut ebpf, TC_PROGRAM)?
            .load()
            .map_err(|source| LoadError::Program {
                name: TC_PROGRAM,
                source,
            })?;
        let logger = if options.kernel_debug {
            Some(aya_log::EbpfLogger::init(&mut ebpf)?)
        } else {
            None
        };
        let maps = Maps::take(&mut ebpf)?;
        Ok(Self { ebpf, maps, logger })
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
        let request = ReleaseRequest { flow: *flow };
        // SAFETY: `ReleaseRequest` is `repr(C)` plain data with no padding the compiler adds.
        let bytes = unsafe {
            std::slice::from_raw_parts(
                (&request as *const ReleaseRequest).cast::<u8>(),
                std::mem::size_of::<ReleaseRequest>(),
            )
        };
        let prog = program::<Xdp>(&mut self.ebpf, RELEASE_PROGRAM)?;
        let result = prog
            .test_run(TestRunOptions {
                data_in: Some(bytes),
                ..Default::default()
            })
            .map_err(|source| LoadError::Program {
                name: RELEASE_PROGRAM,
                source,
            })?;
        match result.return_value {
            release::RELEASED => Ok(true),
            release::ABSENT => Ok(false),
            other => Err(LoadError::Release(other)),
        }
    }

    /// Attaches XDP on ingress and TC on egress; returns the XDP mode that took.
    pub fn attach(&mut self, iface: &str, mode: XdpAttachMode) -> Result<XdpAttachMode, LoadError> {
        let attach_error = |name, source| LoadError::Attach {
            name,
            iface: iface.to_string(),
            source,
        };
        let xdp = program::<Xdp>(&mut self.ebpf, XDP_PROGRAM)?;
        let taken = match mode {
            XdpAttachMode::Native => xdp.attach(iface, XdpMode::Driver).map(|_| mode),
            XdpAttachMode::Skb => xdp.attach(iface, XdpMode::Skb).map(|_| mode),
            XdpAttachMode::Auto => xdp
                .attach(iface, XdpMode::Driver)
                .map(|_| XdpAttachMode::Native)
                .or_else(|error| {
                    tracing::info!(iface, %error, "native XDP unavailable, using generic (skb) mode");
                    xdp.attach(iface, XdpMode::Skb).map(|_| XdpAttachMode::Skb)
                }),
        }
        .map_err(|source| attach_error(XDP_PROGRAM, source))?;
        program::<SchedClassifier>(&mut self.ebpf, TC_PROGRAM)?
            .attach(iface, TcAttachType::Egress)
            .map_err(|source| attach_error(TC_PROGRAM, source))?;
        Ok(taken)
    }

    pub fn ebpf(&self) -> &Ebpf {
        &self.ebpf
    }

    pub fn ebpf_mut(&mut self) -> &mut Ebpf {
        &mut self.ebpf
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
