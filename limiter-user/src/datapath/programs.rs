//! The programs in the kernel object, by name, and how to find one of them.

use aya::{Ebpf, programs::ProgramError};

use super::LoadError;

pub const XDP_PROGRAM: &str = "limiter_xdp";
pub const TC_PROGRAM: &str = "limiter_tc";
/// TC ingress: answers the SYNs the XDP program refused with `rst` and marked (see
/// `Config::rst_xdp_tx`).
pub const TC_INGRESS_PROGRAM: &str = "limiter_tc_ingress";
pub const RELEASE_PROGRAM: &str = "limiter_release";
pub const ADJUST_PROGRAM: &str = "limiter_adjust";
pub const ADOPT_PROGRAM: &str = "limiter_adopt";

pub(super) fn program<'a, P>(ebpf: &'a mut Ebpf, name: &'static str) -> Result<&'a mut P, LoadError>
where
    &'a mut P: TryFrom<&'a mut aya::programs::Program, Error = ProgramError>,
{
    ebpf.program_mut(name)
        .ok_or(LoadError::MissingProgram(name))?
        .try_into()
        .map_err(|source| LoadError::Program { name, source })
}
