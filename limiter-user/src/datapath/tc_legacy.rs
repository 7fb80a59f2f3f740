//! TC programs on kernels without TCX (before 6.6): a cls_bpf filter on the clsact qdisc,
//! attached through netlink, made to outlive the agent the way a pinned TCX link does.
//!
//! A netlink filter is no BPF link and cannot be pinned, but it holds its own reference to the
//! program: the filter keeps enforcing when the agent exits or dies. What the next agent needs
//! is where the filter is, so every filter limiter makes sits at one fixed priority and handle
//! per direction, and a record of it is left in the pin directory (an empty directory named
//! after the filter, without a dot: bpffs holds no regular files, and older kernels
//! refuse names with dots on it with `EPERM`, 6.1 among them). A new agent replaces the program of
//! that filter in one netlink request (cls_bpf swaps the program under RCU, so no packet goes
//! unfiltered), which is `tc filter replace` on the same priority and handle.
//!
//! The clsact qdisc is created when the interface has none, and a `clsact` record says so;
//! detach removes the qdisc only then, leaving one that someone else made.

use std::{
    io,
    path::{Path, PathBuf},
};

use aya::programs::{
    Link, ProgramError, SchedClassifier, TcAttachType,
    tc::{self, NlOptions, SchedClassifierLink, TcAttachOptions, TcError, TcHandle},
};
use thiserror::Error;

use super::netlink::{self, NetlinkError};

/// The priority of every filter limiter makes. Low numbers run first; 1 puts limiter before
/// filters made without a priority (the kernel gives those 49152 and up).
pub const PRIORITY: u16 = 1;
/// The handle of every filter limiter makes ("LM"), unique within its priority.
pub const HANDLE: TcHandle = TcHandle::new(0, 0x4c4d);

/// The record beside the filters' records that is present only when limiter created the
/// interface's clsact qdisc.
pub const CLSACT_RECORD: &str = "clsact";
/// What a filter's record is called: its link file name (which says the direction) and this.
pub const FILTER_RECORD_SUFFIX: &str = "-netlink";

#[derive(Debug, Error)]
pub enum TcLegacyError {
    #[error("adding the clsact qdisc to {iface}")]
    Qdisc {
        iface: String,
        #[source]
        source: TcError,
    },
    #[error("removing the clsact qdisc limiter added to {iface}")]
    QdiscDelete {
        iface: String,
        #[source]
        source: NetlinkError,
    },
    #[error("the netlink tc filter of {name} on {iface}")]
    Filter {
        name: &'static str,
        iface: String,
        #[source]
        source: ProgramError,
    },
    #[error("removing the netlink tc filter recorded in {path}")]
    Detach {
        path: PathBuf,
        #[source]
        source: ProgramError,
    },
    #[error("record {path}")]
    Record {
        path: PathBuf,
        #[source]
        source: io::Error,
    },
    #[error("limiter attaches TC programs only to the clsact ingress or egress hook")]
    CustomParent,
}

/// Attaches `program` (called `name`) to `iface` in `direction` through a netlink filter at
/// [`PRIORITY`] and [`HANDLE`], adding the clsact qdisc when the interface has none.
///
/// With `record` (the interface's link directory in the pin directory, and the link file name
/// for `direction`), the filter is left to outlive this process and recorded there as
/// `<file>-netlink`; without it the filter stays the program's and goes when the program is
/// dropped (the qdisc stays).
pub fn attach(
    program: &mut SchedClassifier,
    name: &'static str,
    iface: &str,
    direction: TcAttachType,
    record: Option<(&Path, &str)>,
) -> Result<(), TcLegacyError> {
    if let TcAttachType::Custom(_) = direction {
        return Err(TcLegacyError::CustomParent);
    }
    let created = match tc::qdisc_add_clsact(iface) {
        Ok(()) => true,
        Err(TcError::NetlinkError(e)) if e.raw_os_error() == Some(libc::EEXIST) => false,
        Err(source) => {
            return Err(TcLegacyError::Qdisc {
                iface: iface.to_string(),
                source,
            });
        }
    };
    if let Some((dir, _)) = record {
        // Written before the filter, so a failure in between still lets detach clean up.
        if created {
            write_record(&dir.join(CLSACT_RECORD))?;
        }
    }
    let filter_error = |source| TcLegacyError::Filter {
        name,
        iface: iface.to_string(),
        source,
    };
    let id = program
        .attach_with_options(
            iface,
            direction,
            TcAttachOptions::Netlink(NlOptions {
                priority: PRIORITY,
                handle: HANDLE,
                classid: None,
            }),
        )
        .map_err(filter_error)?;
    if let Some((dir, file)) = record {
        write_record(&record_path(dir, file))?;
        let link = program.take_link(id).map_err(filter_error)?;
        // Dropping the link would delete the filter; it must outlive this process.
        std::mem::forget(link);
    }
    Ok(())
}

/// Whether `dir` holds a netlink filter record for the link file `file`.
pub fn recorded(dir: &Path, file: &str) -> bool {
    record_path(dir, file).is_dir()
}

/// Swaps `program` into the filter an earlier agent left on `iface` in `direction`: the same
/// priority and handle, replaced in place.
pub fn adopt(
    program: &mut SchedClassifier,
    name: &'static str,
    iface: &str,
    direction: TcAttachType,
) -> Result<(), TcLegacyError> {
    let filter_error = |source| TcLegacyError::Filter {
        name,
        iface: iface.to_string(),
        source,
    };
    let link = SchedClassifierLink::attached(iface, direction, PRIORITY, HANDLE, None)
        .map_err(|e| filter_error(ProgramError::from(TcError::IoError(e))))?;
    let id = program.attach_to_link(link).map_err(filter_error)?;
    let link = program.take_link(id).map_err(filter_error)?;
    // As in `attach`: the filter outlives this process.
    std::mem::forget(link);
    Ok(())
}

/// Removes the filter recorded at `path` (the `*-netlink` record of `iface` in `direction`)
/// and its record. A filter already gone (the interface deleted with it) is not an error.
pub fn detach_filter(
    iface: &str,
    direction: TcAttachType,
    path: &Path,
) -> Result<(), TcLegacyError> {
    let detach_error = |source| TcLegacyError::Detach {
        path: path.to_path_buf(),
        source,
    };
    match SchedClassifierLink::attached(iface, direction, PRIORITY, HANDLE, None) {
        Ok(link) => match link.detach() {
            // No such filter, or no clsact qdisc at all ("Parent Qdisc doesn't exists"): the
            // filter is gone already. Also what a detach run in another network namespace
            // than the interface's sees: netlink reaches only its own namespace's interfaces.
            Err(ProgramError::NetlinkError(e))
                if matches!(e.raw_os_error(), Some(libc::ENOENT | libc::EINVAL)) => {}
            Ok(()) => {}
            Err(e) => return Err(detach_error(e)),
        },
        // No such interface (here): its filters went with it, or live in another namespace.
        Err(e) if e.raw_os_error() == Some(libc::ENODEV) || e.kind() == io::ErrorKind::NotFound => {
        }
        Err(e) => return Err(detach_error(TcError::IoError(e).into())),
    }
    remove_record(path)
}

/// Removes the clsact qdisc of `iface` if the record at `path` says limiter created it, then
/// the record.
pub fn detach_qdisc(iface: &str, path: &Path) -> Result<(), TcLegacyError> {
    let deleted = nix::net::if_::if_nametoindex(iface)
        .map_err(|errno| NetlinkError::Io(errno.into()))
        .and_then(netlink::delete_clsact);
    match deleted {
        Ok(()) => {}
        Err(e)
            if matches!(
                e.raw_os_error(),
                Some(libc::ENODEV | libc::ENOENT | libc::EINVAL)
            ) => {}
        Err(source) => {
            return Err(TcLegacyError::QdiscDelete {
                iface: iface.to_string(),
                source,
            });
        }
    }
    remove_record(path)
}

fn record_path(dir: &Path, file: &str) -> PathBuf {
    dir.join(format!("{file}{FILTER_RECORD_SUFFIX}"))
}

fn write_record(path: &Path) -> Result<(), TcLegacyError> {
    std::fs::create_dir(path).map_err(|source| TcLegacyError::Record {
        path: path.to_path_buf(),
        source,
    })
}

fn remove_record(path: &Path) -> Result<(), TcLegacyError> {
    match std::fs::remove_dir(path) {
        Err(e) if e.kind() != io::ErrorKind::NotFound => Err(TcLegacyError::Record {
            path: path.to_path_buf(),
            source: e,
        }),
        _ => Ok(()),
    }
}
