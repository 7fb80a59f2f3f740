//! Walking a map in bounded steps. aya iterates a map from its first key only; the sweeper
//! must resume where its last pass stopped, so this module issues `BPF_MAP_GET_NEXT_KEY` with a
//! start key itself and keeps each map's cursor between passes.

use aya::{
    Pod,
    maps::{IterableMap, MapData, MapError},
};
use limiter_common::{Flow, FlowKey, SourceKey, map_names};

use super::map_handles::{Maps, MapsError, map_error};

fn walk_error(name: &'static str) -> impl FnOnce(std::io::Error) -> MapsError {
    move |io_error| MapsError::Map {
        name,
        source: MapError::SyscallError(aya::sys::SyscallError {
            call: "bpf_map_get_next_key",
            io_error,
        }),
    }
}

/// Up to `max` keys of `map` after `cursor` (from the start when `None`), and whether the walk
/// reached the end. The sweeper resumes from the last key it saw, so each pass does bounded
/// work however large the map; if that key was deleted meanwhile, the kernel restarts the walk
/// from the first key, which costs a re-read, never a missed entry.
fn keys_after<K: Pod>(
    map: &MapData,
    cursor: Option<K>,
    max: usize,
) -> Result<(Vec<K>, bool), std::io::Error> {
    let mut keys = Vec::with_capacity(max.min(4096));
    let mut at = cursor;
    while keys.len() < max {
        match next_key(map, at.as_ref())? {
            Some(key) => {
                keys.push(key);
                at = Some(key);
            }
            None => return Ok((keys, true)),
        }
    }
    Ok((keys, false))
}

/// `BPF_MAP_GET_NEXT_KEY`, which aya uses internally but does not expose with a start key.
fn next_key<K: Pod>(map: &MapData, key: Option<&K>) -> Result<Option<K>, std::io::Error> {
    use std::os::fd::{AsFd, AsRawFd};
    // The `bpf_attr` layout of the map element commands.
    #[repr(C)]
    struct Attr {
        map_fd: u32,
        _pad: u32,
        key: u64,
        next_key: u64,
        flags: u64,
    }
    const BPF_MAP_GET_NEXT_KEY: libc::c_long = 4;
    let mut next = std::mem::MaybeUninit::<K>::uninit();
    let attr = Attr {
        map_fd: map.fd().as_fd().as_raw_fd() as u32,
        _pad: 0,
        key: key.map_or(0, |k| k as *const K as u64),
        next_key: next.as_mut_ptr() as u64,
        flags: 0,
    };
    // SAFETY: `attr` is a valid bpf_attr prefix for this command; the kernel writes one key of
    // the map's key size (that of `K`, checked when the typed map was made) into `next`.
    let rc = unsafe {
        libc::syscall(
            libc::SYS_bpf,
            BPF_MAP_GET_NEXT_KEY,
            &attr as *const Attr,
            std::mem::size_of::<Attr>() as u32,
        )
    };
    if rc == 0 {
        // SAFETY: the call succeeded, so the kernel wrote the key.
        return Ok(Some(unsafe { next.assume_init() }));
    }
    let error = std::io::Error::last_os_error();
    if error.raw_os_error() == Some(libc::ENOENT) {
        Ok(None)
    } else {
        Err(error)
    }
}

/// Where each map's sweep walk stands between passes.
#[derive(Default)]
pub struct SweepCursor {
    flows: Option<FlowKey>,
    half_open: Option<FlowKey>,
    bans: Option<SourceKey>,
}

impl SweepCursor {
    /// Whether the next flow batch starts at the table's first key.
    pub fn at_flow_start(&self) -> bool {
        self.flows.is_none()
    }
}

/// One batch of the flow table, read for the sweeper.
pub struct FlowBatch {
    pub flows: Vec<(FlowKey, Flow)>,
    /// The walk reached the end of the table: the next batch starts a new cycle.
    pub wrapped: bool,
}

impl Maps {
    pub fn flow_batch(&self, cursor: &mut SweepCursor, max: usize) -> Result<FlowBatch, MapsError> {
        let (keys, wrapped) = keys_after(self.flows.map(), cursor.flows, max)
            .map_err(walk_error(map_names::FLOWS))?;
        cursor.flows = if wrapped { None } else { keys.last().copied() };
        let mut flows = Vec::with_capacity(keys.len());
        for key in keys {
            match self.flows.get(&key, 0) {
                Ok(flow) => flows.push((key, flow)),
                Err(MapError::KeyNotFound) => {} // closed meanwhile
                Err(e) => return Err(map_error(map_names::FLOWS)(e)),
            }
        }
        Ok(FlowBatch { flows, wrapped })
    }

    /// Deletes half-open connections older than `timeout_ns` among the next `max`; returns
    /// how many. They hold no slot, and the table makes room for new ones by itself (it is an
    /// LRU); this only spares real clients' entries from being pushed out by dead ones.
    pub fn sweep_half_open(
        &mut self,
        cursor: &mut SweepCursor,
        max: usize,
        now: u64,
        timeout_ns: u64,
    ) -> Result<u64, MapsError> {
        let (keys, wrapped) = keys_after(self.half_open.map(), cursor.half_open, max)
            .map_err(walk_error(map_names::HALF_OPEN))?;
        cursor.half_open = if wrapped { None } else { keys.last().copied() };
        let mut removed = 0;
        for key in keys {
            if let Ok(entry) = self.half_open.get(&key, 0)
                && now.saturating_sub(entry.first_seen_ns) > timeout_ns
                && self.half_open.remove(&key).is_ok()
            {
                removed += 1;
            }
        }
        Ok(removed)
    }

    /// Deletes expired bans among the next `max`; returns how many.
    pub fn sweep_bans(
        &mut self,
        cursor: &mut SweepCursor,
        max: usize,
        now: u64,
    ) -> Result<u64, MapsError> {
        let (keys, wrapped) =
            keys_after(self.bans.map(), cursor.bans, max).map_err(walk_error(map_names::BANS))?;
        cursor.bans = if wrapped { None } else { keys.last().copied() };
        let mut removed = 0;
        for key in keys {
            if let Ok(ban) = self.bans.get(&key, 0)
                && ban.expires_ns <= now
                && self.bans.remove(&key).is_ok()
            {
                removed += 1;
            }
        }
        Ok(removed)
    }
}
