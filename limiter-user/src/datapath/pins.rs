//! The pin layout and its lifecycle: `maps/<MAP>` shared by every interface,
//! `links/<iface>/` holding one interface's attachments (`xdp`; `tc` for egress and
//! `tc-ingress` for ingress, each either a pinned TCX link or, on kernels without TCX, a
//! `tc-netlink` / `tc-ingress-netlink` filter record, plus `clsact` when limiter created the
//! qdisc; records are empty directories), and `agent-<pid>` naming the agent that enforces
//! through them, on a BPF filesystem this module mounts when needed, and `limiter detach`,
//! which removes them.

use std::path::{Path, PathBuf};

use aya::programs::{TcAttachType, links::PinnedLink};

use super::{LoadError, tc_legacy};

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

/// The file name of the TC attachment in `direction`: one TC program per direction, which is
/// also what lets the netlink filters share one priority and handle.
pub fn tc_link_file(direction: TcAttachType) -> &'static str {
    match direction {
        TcAttachType::Ingress => "tc-ingress",
        TcAttachType::Egress | TcAttachType::Custom(_) => "tc",
    }
}

/// The direction whose TC attachment is called `file` (the inverse of [`tc_link_file`]).
fn tc_direction(file: &str) -> TcAttachType {
    if file == tc_link_file(TcAttachType::Ingress) {
        TcAttachType::Ingress
    } else {
        TcAttachType::Egress
    }
}

/// The pinned TCX link of the TC program in `direction`.
pub fn tc_link(pin_dir: &Path, iface: &str, direction: TcAttachType) -> PathBuf {
    links(pin_dir, iface).join(tc_link_file(direction))
}

/// Whether an earlier agent left the TC program in `direction` attached to `iface`: a pinned
/// TCX link or a netlink filter record.
pub fn tc_attached(pin_dir: &Path, iface: &str, direction: TcAttachType) -> bool {
    tc_link(pin_dir, iface, direction).exists()
        || tc_legacy::recorded(&links(pin_dir, iface), tc_link_file(direction))
}

/// The running agent's pid, so that a second agent for the same pins says whose they are
/// instead of swapping its programs into a live agent's links. The BPF filesystem holds no
/// regular files, so the pid is the name of an empty directory: `<pin-dir>/agent-<pid>`.
fn pid_dir(pin_dir: &Path, pid: u32) -> PathBuf {
    pin_dir.join(format!("agent-{pid}"))
}

/// Another live agent enforcing through `pin_dir`; records of dead ones are removed.
pub fn live_agent(pin_dir: &Path) -> Option<u32> {
    let entries = std::fs::read_dir(pin_dir).ok()?;
    let mut live = None;
    for entry in entries.filter_map(Result::ok) {
        let name = entry.file_name();
        let Some(pid) = name
            .to_str()
            .and_then(|n| n.strip_prefix("agent-"))
            .and_then(|p| p.parse::<u32>().ok())
        else {
            continue;
        };
        let alive = std::fs::read_to_string(format!("/proc/{pid}/comm"))
            .is_ok_and(|comm| comm.trim() == "limiter");
        if alive && pid != std::process::id() {
            live = Some(pid);
        } else if !alive {
            let _ = std::fs::remove_dir(entry.path());
        }
    }
    live
}

/// Records this process as the agent enforcing through `pin_dir`.
pub fn write_pid_file(pin_dir: &Path) -> Result<(), LoadError> {
    let path = pid_dir(pin_dir, std::process::id());
    match std::fs::create_dir(&path) {
        Err(e) if e.kind() != std::io::ErrorKind::AlreadyExists => {
            Err(LoadError::Pin { path, source: e })
        }
        _ => Ok(()),
    }
}

/// Removes this process's record.
pub fn remove_pid_file(pin_dir: &Path) {
    let path = pid_dir(pin_dir, std::process::id());
    if let Err(error) = std::fs::remove_dir(&path)
        && error.kind() != std::io::ErrorKind::NotFound
    {
        tracing::warn!(%error, path = %path.display(), "removing the pid record");
    }
}

/// Where the BPF filesystem is conventionally mounted.
const BPFFS: &str = "/sys/fs/bpf";

/// Mounting a BPF filesystem in a private mount namespace (`ip netns exec` makes one, with a
/// fresh /sys) would pin into a filesystem nobody else sees, which dies with the agent: the
/// kernel would stop enforcing when it exits and no successor could adopt the maps.
#[derive(Debug, thiserror::Error)]
#[error(
    "{BPFFS} has no BPF filesystem and this agent runs in a private mount namespace (as under \
     `ip netns exec`): a BPF filesystem mounted here would die with the agent, and the pins \
     with it. Enter only the network namespace (`nsenter --net=/run/netns/NAME limiter run ...`), \
     or set allow-private-bpffs to accept pins that last only as long as this agent"
)]
pub struct PrivateBpffs;

/// Refuses to go on when `pin_dir` would need a BPF filesystem mounted and this process's
/// mount namespace is not init's.
pub fn refuse_private_bpffs(pin_dir: &Path) -> Result<(), PrivateBpffs> {
    let would_mount = pin_dir.starts_with(BPFFS) && !on_bpffs(Path::new(BPFFS));
    let ns = |pid: &str| std::fs::read_link(format!("/proc/{pid}/ns/mnt")).ok();
    // Init's namespace; where init is hidden (a container may not let us read it), the
    // parent's: `ip netns exec` unshares in place and execs the agent, so its parent, the
    // shell, is still in the namespace the agent left.
    let reference = ns("1").or_else(|| ns(&std::os::unix::process::parent_id().to_string()));
    let private = match (ns("self"), reference) {
        (Some(ours), Some(shared)) => ours != shared,
        _ => false,
    };
    if would_mount && private {
        Err(PrivateBpffs)
    } else {
        Ok(())
    }
}

fn on_bpffs(path: &Path) -> bool {
    nix::sys::statfs::statfs(path)
        .is_ok_and(|fs| fs.filesystem_type() == nix::sys::statfs::BPF_FS_MAGIC)
}

/// Makes sure `pin_dir` lies on a BPF filesystem, mounting one at /sys/fs/bpf when the pin
/// directory is under it and nothing is mounted there yet (minimal hosts and containers often
/// boot without it). Pins anywhere else must already be on a BPF filesystem.
pub fn ensure_bpffs(pin_dir: &Path) -> Result<(), LoadError> {
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
    let all_links = pin_dir.join("links");
    let ifaces: Vec<String> = match iface {
        Some(iface) => vec![iface.to_string()],
        None => match std::fs::read_dir(&all_links) {
            Ok(entries) => entries
                .filter_map(std::result::Result::ok)
                .map(|e| e.file_name().to_string_lossy().into_owned())
                .collect(),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Vec::new(),
            Err(source) => {
                return Err(LoadError::Pin {
                    path: all_links,
                    source,
                });
            }
        },
    };
    let mut detached = Vec::new();
    for iface in ifaces {
        if unpin_links(pin_dir, &iface)? {
            detached.push(iface);
        }
    }
    let remaining = std::fs::read_dir(&all_links).map_or(0, std::iter::Iterator::count);
    if remaining == 0 {
        remove_tree(pin_dir)?;
    }
    Ok(detached)
}

/// Removes `iface`'s attachments, which detaches its programs; false if it had none.
pub fn unpin_links(pin_dir: &Path, iface: &str) -> Result<bool, LoadError> {
    let dir = links(pin_dir, iface);
    if !dir.exists() {
        return Ok(false);
    }
    detach_iface(iface, &dir)?;
    std::fs::remove_dir(&dir).map_err(|source| LoadError::Pin { path: dir, source })?;
    Ok(true)
}

/// Removes everything in one interface's link directory: pinned links are unpinned (dropping
/// the last reference to a link detaches its program), recorded netlink filters are deleted,
/// and last the clsact qdisc, if limiter created it.
fn detach_iface(iface: &str, dir: &Path) -> Result<(), LoadError> {
    let entries = std::fs::read_dir(dir).map_err(|source| LoadError::Pin {
        path: dir.to_path_buf(),
        source,
    })?;
    let mut qdisc = None;
    for entry in entries {
        let path = entry
            .map_err(|source| LoadError::Pin {
                path: dir.to_path_buf(),
                source,
            })?
            .path();
        let name = path
            .file_name()
            .map(|n| n.to_string_lossy().into_owned())
            .unwrap_or_default();
        if name == tc_legacy::CLSACT_RECORD {
            qdisc = Some(path);
        } else if let Some(file) = name.strip_suffix(tc_legacy::FILTER_RECORD_SUFFIX) {
            tc_legacy::detach_filter(iface, tc_direction(file), &path)?;
        } else {
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
    if let Some(path) = qdisc {
        tc_legacy::detach_qdisc(iface, &path)?;
    }
    Ok(())
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
