//! Loads the embedded kernel programs and attaches them to interfaces.

use std::fs;

use aya::{
    Ebpf, EbpfLoader,
    programs::{ProgramError, SchedClassifier, TcAttachType, Xdp, XdpMode},
};
use thiserror::Error;

/// The kernel object, built by `cargo xtask build` and embedded so the agent is one file.
pub static EBPF_OBJECT: &[u8] = aya::include_bytes_aligned!(env!("LIMITER_EBPF_OBJECT"));

pub const XDP_PROGRAM: &str = "limiter_xdp";
pub const TC_PROGRAM: &str = "limiter_tc";

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
}

impl Datapath {
    pub fn load() -> Result<Self, LoadError> {
        let mut ebpf = EbpfLoader::new().load(EBPF_OBJECT)?;
        program::<Xdp>(&mut ebpf, XDP_PROGRAM)?
            .load()
            .map_err(|source| LoadError::Program {
                name: XDP_PROGRAM,
                source,
            })?;
        program::<SchedClassifier>(&mut ebpf, TC_PROGRAM)?
            .load()
            .map_err(|source| LoadError::Program {
                name: TC_PROGRAM,
                source,
            })?;
        Ok(Self { ebpf })
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
