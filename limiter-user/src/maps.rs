//! Typed access to the kernel programs' maps.

use aya::maps::{MapError, PerCpuArray};
use limiter_common::Stat;

use crate::loader::Datapath;

/// Sums one per-CPU statistic across CPUs.
pub fn stat(datapath: &Datapath, stat: Stat) -> Result<u64, MapError> {
    let map = datapath.ebpf().map("STATS").ok_or(MapError::InvalidName {
        name: "STATS".into(),
    })?;
    let stats = PerCpuArray::<_, u64>::try_from(map)?;
    Ok(stats.get(&(stat as u32), 0)?.iter().sum())
}
