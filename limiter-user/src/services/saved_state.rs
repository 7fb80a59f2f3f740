//! The state file: the bans in force and the list entries added over HTTP or the CLI, kept so
//! that they outlive the agent and a reboot (the pinned maps outlive the agent, not a reboot or
//! `limiter detach`). Written atomically (a temporary file in the same directory, synced, then
//! renamed over the old one) at most once a second after a change, and once more at the stop;
//! read once at the start. A file that cannot be read as one is reported, set aside as
//! `<name>.corrupt` so nothing in it is lost, and the agent starts without it.

use std::{
    io::Write,
    net::IpAddr,
    path::{Path, PathBuf},
    sync::Arc,
    time::{Duration, SystemTime},
};

use ipnet::IpNet;
use serde::{Deserialize, Serialize};
use thiserror::Error;

use crate::{
    api::{ListKind, MAX_BAN_TTL, MIN_BAN_TTL},
    datapath::{Enforcer, Lists, MapsError, kernel_keys::key_address},
    duration_units::duration_ms,
    errors::error_chain,
    settings::parse_cidr,
};

/// The format's version; a file of another version is not this agent's to read.
const VERSION: u32 = 1;

/// The fewest time between two writes: a burst of bans (escalation under attack) costs one
/// write a second, not one per ban.
const WRITE_EVERY: Duration = Duration::from_secs(1);

/// What the file holds.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SavedState {
    pub version: u32,
    /// Admin entries of the allowlist, as CIDRs.
    pub allow: Vec<String>,
    /// Admin entries of the denylist.
    pub deny: Vec<String>,
    pub bans: Vec<SavedBan>,
}

/// A ban by the source it applies to, with its end on the wall clock: the kernel's boot-time
/// expiry means nothing after a reboot.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SavedBan {
    /// The source key as a CIDR (`192.0.2.7/32`, `2001:db8:1::/64`).
    pub source: String,
    pub expires_unix_ms: u64,
}

/// Why a state file was not used.
#[derive(Debug, Error)]
pub enum StateError {
    #[error("reading {path}")]
    Read {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("not a state file")]
    Json(#[from] serde_json::Error),
    #[error("version {0}, not {VERSION}")]
    Version(u32),
    #[error("entry `{0}` is not a CIDR")]
    Entry(String),
    #[error("writing {path}")]
    Write {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("reading the kernel's bans")]
    Maps(#[from] MapsError),
}

/// What a restore put back.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Restored {
    pub bans: usize,
    /// Bans whose end passed while the agent was away.
    pub expired: usize,
    pub entries: usize,
}

/// A parsed state file, checked: every entry a CIDR.
pub struct Checked {
    lists: Lists,
    bans: Vec<(IpNet, u64)>,
}

/// Decodes and checks a state file's text.
pub fn decode(text: &str) -> Result<Checked, StateError> {
    let state: SavedState = serde_json::from_str(text)?;
    if state.version != VERSION {
        return Err(StateError::Version(state.version));
    }
    let cidr =
        |text: &String| parse_cidr("state", text).map_err(|_| StateError::Entry(text.clone()));
    let list = |entries: &[String]| entries.iter().map(cidr).collect::<Result<Vec<_>, _>>();
    Ok(Checked {
        lists: Lists {
            allow: list(&state.allow)?,
            deny: list(&state.deny)?,
        },
        bans: state
            .bans
            .iter()
            .map(|ban| Ok((cidr(&ban.source)?, ban.expires_unix_ms)))
            .collect::<Result<_, StateError>>()?,
    })
}

/// The state in force, at `now`.
pub fn snapshot(enforcer: &Enforcer, now: SystemTime) -> Result<SavedState, StateError> {
    let (config, bans) = enforcer.with_maps(|m| Ok::<_, MapsError>((m.config()?, m.bans()?)))?;
    let lists = enforcer.admin_lists();
    let now_ms = unix_ms(now);
    let text = |nets: &[IpNet]| nets.iter().map(ToString::to_string).collect();
    Ok(SavedState {
        version: VERSION,
        allow: text(&lists.allow),
        deny: text(&lists.deny),
        bans: bans
            .into_iter()
            .map(|(key, left)| {
                let addr = key_address(&key);
                let prefix = match addr {
                    IpAddr::V4(_) => config.ipv4_prefix,
                    IpAddr::V6(_) => config.ipv6_prefix,
                };
                let source = IpNet::new(addr, prefix).map_or(IpNet::from(addr), |n| n.trunc());
                SavedBan {
                    source: source.to_string(),
                    expires_unix_ms: now_ms.saturating_add(duration_ms(left)),
                }
            })
            .collect(),
    })
}

/// Puts a checked state back at `now`: its admin entries on the lists, its bans still in
/// force for what is left of them.
pub fn restore(enforcer: &Enforcer, state: &Checked, now: SystemTime) -> Restored {
    let mut restored = Restored::default();
    for (kind, nets) in [
        (ListKind::Allow, &state.lists.allow),
        (ListKind::Deny, &state.lists.deny),
    ] {
        for net in nets {
            match enforcer.list_add(kind, *net) {
                Ok(_) => restored.entries += 1,
                Err(error) => {
                    let error = error_chain(&error);
                    tracing::warn!(list = kind.name(), %net, %error, "saved list entry not restored");
                }
            }
        }
    }
    let now_ms = unix_ms(now);
    for (source, expires) in &state.bans {
        let left = Duration::from_millis(expires.saturating_sub(now_ms));
        if left < MIN_BAN_TTL {
            restored.expired += 1;
            continue;
        }
        match enforcer.ban(source.network(), left.min(MAX_BAN_TTL)) {
            Ok(()) => restored.bans += 1,
            Err(error) => {
                let error = error_chain(&error);
                tracing::warn!(%source, %error, "saved ban not restored");
            }
        }
    }
    restored
}

/// The file at `path`, checked; `None` if there is none or it cannot be used, which is
/// reported (and a corrupt file set aside) but never stops the agent.
pub fn load(path: &Path) -> Option<Checked> {
    let text = match std::fs::read_to_string(path) {
        Ok(text) => text,
        Err(error) if error.kind() == std::io::ErrorKind::NotFound => {
            tracing::info!(path = %path.display(), "no state file yet");
            return None;
        }
        Err(source) => {
            let error = StateError::Read {
                path: path.to_owned(),
                source,
            };
            tracing::error!(error = %error_chain(&error), "state file ignored");
            return None;
        }
    };
    match decode(&text) {
        Ok(state) => Some(state),
        Err(error) => {
            let aside = corrupt_path(path);
            let kept = std::fs::rename(path, &aside);
            tracing::error!(
                path = %path.display(),
                error = %error_chain(&error),
                kept_as = %aside.display(),
                moved = kept.is_ok(),
                "the state file is corrupt and was ignored; the agent starts without its bans and list entries"
            );
            None
        }
    }
}

fn corrupt_path(path: &Path) -> PathBuf {
    let mut name = path.file_name().unwrap_or_default().to_os_string();
    name.push(".corrupt");
    path.with_file_name(name)
}

/// Writes `state` to `path` atomically: a reader (or a crash) sees the old file or the new
/// one, never part of one.
pub fn write(path: &Path, state: &SavedState) -> Result<(), StateError> {
    let error = |source| StateError::Write {
        path: path.to_owned(),
        source,
    };
    let dir = match path.parent() {
        Some(dir) if !dir.as_os_str().is_empty() => dir,
        _ => Path::new("."),
    };
    std::fs::create_dir_all(dir).map_err(error)?;
    let mut file = tempfile::NamedTempFile::new_in(dir).map_err(error)?;
    serde_json::to_writer(&mut file, state).map_err(|e| error(e.into()))?;
    file.write_all(b"\n").map_err(error)?;
    file.as_file().sync_all().map_err(error)?;
    file.persist(path).map_err(|e| error(e.error))?;
    // The rename is durable once the directory is.
    std::fs::File::open(dir)
        .and_then(|d| d.sync_all())
        .map_err(error)
}

/// Keeps the file up to date: after each change (at most once per [`WRITE_EVERY`]) and once
/// more when `stop` fires.
pub async fn run(
    enforcer: Arc<Enforcer>,
    path: PathBuf,
    stop: tokio_util::sync::CancellationToken,
) {
    let changes = enforcer.changes();
    loop {
        let stopping = tokio::select! {
            _ = changes.notified() => false,
            _ = stop.cancelled() => true,
        };
        save(&enforcer, &path).await;
        if stopping {
            return;
        }
        tokio::select! {
            _ = tokio::time::sleep(WRITE_EVERY) => {}
            _ = stop.cancelled() => {
                save(&enforcer, &path).await;
                return;
            }
        }
    }
}

async fn save(enforcer: &Arc<Enforcer>, path: &Path) {
    let enforcer = Arc::clone(enforcer);
    let path = path.to_owned();
    let result = tokio::task::spawn_blocking(move || {
        let state = snapshot(&enforcer, SystemTime::now())?;
        write(&path, &state).map(|()| state.bans.len())
    })
    .await;
    match result {
        Ok(Ok(bans)) => tracing::debug!(bans, "state file written"),
        Ok(Err(error)) => {
            tracing::error!(error = %error_chain(&error), "the state file was not written");
        }
        Err(error) => tracing::error!(%error, "the state file's writer failed"),
    }
}

fn unix_ms(at: SystemTime) -> u64 {
    at.duration_since(SystemTime::UNIX_EPOCH)
        .map_or(0, duration_ms)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn state(bans: Vec<SavedBan>) -> SavedState {
        SavedState {
            version: VERSION,
            allow: vec!["10.0.0.0/8".into()],
            deny: vec!["2001:db8::/32".into()],
            bans,
        }
    }

    #[test]
    fn a_written_file_reads_back_and_replaces_the_old_one_whole() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("sub/state.json");
        let ban = SavedBan {
            source: "192.0.2.7/32".into(),
            expires_unix_ms: 5,
        };
        write(&path, &state(vec![ban.clone(), ban])).unwrap();
        write(&path, &state(Vec::new())).unwrap();
        let checked = decode(&std::fs::read_to_string(&path).unwrap()).unwrap();
        assert!(checked.bans.is_empty());
        assert_eq!(
            checked.lists.allow,
            ["10.0.0.0/8".parse::<IpNet>().unwrap()]
        );
        // Nothing but the file itself is left in its directory.
        let names: Vec<_> = std::fs::read_dir(path.parent().unwrap())
            .unwrap()
            .map(|e| e.unwrap().file_name())
            .collect();
        assert_eq!(names, ["state.json"]);
    }

    #[test]
    fn a_corrupt_file_is_set_aside_and_ignored() {
        let dir = tempfile::tempdir().unwrap();
        for (n, text) in [
            "{\"version\":1,\"allow\":[\"10.0.0.0/8\"],\"deny\":[],\"bans\":[".to_owned(),
            "\u{0}\u{1}garbage".to_owned(),
            serde_json::to_string(&SavedState {
                version: 2,
                ..state(Vec::new())
            })
            .unwrap(),
            serde_json::to_string(&state(vec![SavedBan {
                source: "192.0.2.300/32".into(),
                expires_unix_ms: 1,
            }]))
            .unwrap(),
            "{\"version\":1,\"allow\":[],\"deny\":[],\"bans\":[],\"extra\":1}".to_owned(),
        ]
        .iter()
        .enumerate()
        {
            let path = dir.path().join(format!("state{n}.json"));
            std::fs::write(&path, text).unwrap();
            assert!(load(&path).is_none(), "{text:?}");
            assert!(!path.exists());
            assert_eq!(std::fs::read_to_string(corrupt_path(&path)).unwrap(), *text);
        }
        assert!(load(&dir.path().join("absent.json")).is_none());
    }
}
