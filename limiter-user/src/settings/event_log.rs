//! `event-log`: where enforcement events go (`off`, `journald`, or an absolute file path),
//! and its default, a file beside the state file. One rule for `limiter run` (start and
//! SIGHUP) and `limiter events`, which reads what the agent writes.

use std::path::{Path, PathBuf};

use super::ConfigError;

/// The file name of the default event log, in the state file's directory (systemd's
/// `StateDirectory=limiter`, which the agent may write under `ProtectSystem=full`).
pub const DEFAULT_FILE: &str = "events.log";

/// The journal's `SYSLOG_IDENTIFIER` of the events: `journalctl -t limiter-events`. Not the
/// agent's own name, under which systemd files its ordinary log.
pub const JOURNALD_IDENTIFIER: &str = "limiter-events";

#[derive(Clone, Debug, PartialEq, Eq)]
pub enum EventLog {
    Off,
    Journald,
    /// JSON lines appended to this file.
    File(PathBuf),
}

/// The setting as written (`None`: unset), checked; `state_file` places the default.
pub fn resolve(text: Option<&str>, state_file: &Path) -> Result<EventLog, ConfigError> {
    let Some(text) = text else {
        return Ok(EventLog::File(
            state_file
                .parent()
                .unwrap_or(Path::new("/"))
                .join(DEFAULT_FILE),
        ));
    };
    match text.trim() {
        "off" => Ok(EventLog::Off),
        "journald" => Ok(EventLog::Journald),
        path if Path::new(path).is_absolute() && !path.ends_with('/') => {
            Ok(EventLog::File(PathBuf::from(path)))
        }
        // A relative path would depend on the directory the agent starts in, and is more
        // often a misspelt `journald` than a file meant.
        other => Err(ConfigError::new(
            "event-log",
            format!("`{other}` is neither `off`, `journald` nor an absolute file path"),
        )),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn off_journald_a_file_or_beside_the_state_file() {
        let state = Path::new("/var/lib/limiter/state.json");
        assert_eq!(
            resolve(None, state),
            Ok(EventLog::File("/var/lib/limiter/events.log".into()))
        );
        assert_eq!(resolve(Some("off"), state), Ok(EventLog::Off));
        assert_eq!(resolve(Some(" journald "), state), Ok(EventLog::Journald));
        assert_eq!(
            resolve(Some("/var/log/limiter/events.json"), state),
            Ok(EventLog::File("/var/log/limiter/events.json".into()))
        );
        for bad in ["jounald", "events.log", "", "/var/log/"] {
            let error = resolve(Some(bad), state).unwrap_err();
            assert_eq!(error.setting, "event-log", "{bad}");
        }
    }
}
