//! `limiter events`: the event log's lines, then each new one as the agent writes it (like
//! `tail -F`: a file rotated away or truncated is followed to its successor, never a panic),
//! from the place the agent's own settings say (`event-log` in its config file, the same
//! flags and `LIMITER_*` variables over it). With `journald`, `journalctl` shows them.

use std::{
    fs::File,
    io::{self, Read, Seek, SeekFrom, Write},
    os::unix::{fs::MetadataExt, process::CommandExt},
    path::{Path, PathBuf},
    process::ExitCode,
    time::{Duration, SystemTime},
};

use anyhow::{Context, Result};

use crate::{
    events,
    settings::{EventLog, JOURNALD_IDENTIFIER, defaults, event_log_of},
};

/// How often a followed file is looked at again. Polling (as `tail -F` does) sees a rotation
/// or a truncation the same way as new lines, with no watch to re-arm on a new file.
const POLL: Duration = Duration::from_millis(250);

#[derive(clap::Args, Debug)]
pub struct EventsArgs {
    /// The agent's configuration file, whose `event-log` (and `state-file`) say where the
    /// events are. [default: /etc/limiter.toml, when it exists]
    #[arg(long, env = "LIMITER_CONFIG")]
    pub config: Option<PathBuf>,
    /// Where the agent writes its events, as `limiter run --event-log` takes it.
    #[arg(long, env = "LIMITER_EVENT_LOG")]
    pub event_log: Option<String>,
    /// The agent's state file, beside which the default event log lies.
    #[arg(long, env = "LIMITER_STATE_FILE")]
    pub state_file: Option<PathBuf>,
    /// Print the events there are and exit, instead of following the log.
    #[arg(long)]
    pub no_follow: bool,
    /// Only events of this last while ("1h", "30m").
    #[arg(long, value_parser = humantime::parse_duration)]
    pub since: Option<Duration>,
    /// Print the JSON lines as written, instead of one readable line per event.
    #[arg(long)]
    pub json: bool,
}

impl EventsArgs {
    pub fn execute(&self) -> Result<ExitCode> {
        let default_config = Path::new(defaults::CONFIG);
        let config = self
            .config
            .as_deref()
            .or(default_config.exists().then_some(default_config));
        let log = event_log_of(
            config,
            self.event_log.as_deref(),
            self.state_file.as_deref(),
        )?;
        let since = self.since.map(|ago| {
            SystemTime::now()
                .checked_sub(ago)
                .unwrap_or(SystemTime::UNIX_EPOCH)
        });
        match log {
            EventLog::Off => {
                eprintln!("the event log is off (event-log = \"off\"); the agent writes no events");
                Ok(ExitCode::FAILURE)
            }
            EventLog::Journald => Err(self.journalctl()),
            EventLog::File(path) => {
                let mut show = Show {
                    json: self.json,
                    since,
                    out: io::stdout().lock(),
                };
                follow(&path, !self.no_follow, &mut show)?;
                Ok(ExitCode::SUCCESS)
            }
        }
    }

    /// Becomes `journalctl` showing the events; returns only if it cannot be run.
    fn journalctl(&self) -> anyhow::Error {
        let mut command = std::process::Command::new("journalctl");
        command.args(["-t", JOURNALD_IDENTIFIER]);
        if !self.no_follow {
            command.arg("--follow");
        }
        if self.json {
            command.args(["--output", "json"]);
        }
        if let Some(ago) = self.since {
            command.arg(format!("--since=-{}s", ago.as_secs()));
        }
        let error = command.exec();
        anyhow::Error::new(error).context(format!(
            "the events are in the journal (event-log = \"journald\"): running journalctl; \
             read them with `journalctl -t {JOURNALD_IDENTIFIER}`"
        ))
    }
}

/// Where the lines go, and which.
struct Show<W> {
    json: bool,
    since: Option<SystemTime>,
    out: W,
}

impl<W: Write> Show<W> {
    fn line(&mut self, line: &str) -> io::Result<()> {
        if let Some(since) = self.since
            && events::timestamp(line).is_some_and(|at| at < since)
        {
            return Ok(());
        }
        if self.json {
            writeln!(self.out, "{line}")
        } else {
            writeln!(self.out, "{}", events::render(line))
        }
    }
}

/// The file at `path` as far as it has been read.
struct Tail {
    path: PathBuf,
    /// The file open, with its inode; `None` until it exists.
    open: Option<(File, u64)>,
    read: u64,
    /// The start of a line the writer has not finished.
    partial: Vec<u8>,
}

impl Tail {
    fn new(path: &Path) -> Self {
        Self {
            path: path.to_owned(),
            open: None,
            read: 0,
            partial: Vec::new(),
        }
    }

    /// The whole lines written since the last call. A file truncated under the reader is
    /// read again from its start; one renamed away is read to its end, then the new file at
    /// the path from its start.
    fn lines(&mut self) -> io::Result<Vec<String>> {
        if self.open.is_none() {
            match File::open(&self.path) {
                Ok(file) => {
                    let inode = file.metadata()?.ino();
                    self.open = Some((file, inode));
                    self.read = 0;
                    self.partial.clear();
                }
                Err(error) if error.kind() == io::ErrorKind::NotFound => return Ok(Vec::new()),
                Err(error) => return Err(error),
            }
        }
        let mut lines = self.drain()?;
        let replaced = match std::fs::metadata(&self.path) {
            Ok(now) => self
                .open
                .as_ref()
                .is_some_and(|(_, inode)| now.ino() != *inode),
            Err(error) if error.kind() == io::ErrorKind::NotFound => true,
            Err(error) => return Err(error),
        };
        if replaced {
            // What the writer put in the old file before it moved on.
            lines.extend(self.drain()?);
            self.open = None;
        }
        Ok(lines)
    }

    fn drain(&mut self) -> io::Result<Vec<String>> {
        let Some((file, _)) = self.open.as_mut() else {
            return Ok(Vec::new());
        };
        if file.metadata()?.len() < self.read {
            self.read = 0;
            self.partial.clear();
        }
        file.seek(SeekFrom::Start(self.read))?;
        let before = self.partial.len();
        file.read_to_end(&mut self.partial)?;
        self.read += (self.partial.len() - before) as u64;
        let Some(end) = self.partial.iter().rposition(|&b| b == b'\n') else {
            return Ok(Vec::new());
        };
        let rest = self.partial.split_off(end + 1);
        let whole = std::mem::replace(&mut self.partial, rest);
        Ok(String::from_utf8_lossy(&whole)
            .lines()
            .filter(|l| !l.is_empty())
            .map(str::to_owned)
            .collect())
    }
}

/// Shows the log's lines, and with `keep_following` every new one until interrupted; a
/// reader that went away (`| head`) ends it quietly.
fn follow<W: Write>(path: &Path, keep_following: bool, show: &mut Show<W>) -> Result<()> {
    let mut tail = Tail::new(path);
    if !keep_following && !path.exists() {
        eprintln!(
            "no event log at {} yet: the agent makes it at its start",
            path.display()
        );
    }
    loop {
        let lines = tail
            .lines()
            .with_context(|| format!("reading the event log {}", path.display()))?;
        let shown = lines
            .iter()
            .try_for_each(|line| show.line(line))
            .and_then(|()| show.out.flush());
        match shown {
            Err(error) if error.kind() == io::ErrorKind::BrokenPipe => return Ok(()),
            other => other.context("writing the events")?,
        }
        if !keep_following {
            return Ok(());
        }
        std::thread::sleep(POLL);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn append(path: &Path, text: &str) {
        let mut file = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(path)
            .unwrap();
        file.write_all(text.as_bytes()).unwrap();
    }

    #[test]
    fn whole_lines_through_truncation_and_rotation() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("events.log");
        let mut tail = Tail::new(&path);
        assert!(tail.lines().unwrap().is_empty(), "no file yet");
        append(&path, "one\ntw");
        assert_eq!(tail.lines().unwrap(), ["one"]);
        append(&path, "o\n");
        assert_eq!(tail.lines().unwrap(), ["two"]);
        // Truncated (logrotate's copytruncate): read again from the start.
        std::fs::File::create(&path).unwrap();
        append(&path, "3\n");
        assert_eq!(tail.lines().unwrap(), ["3"]);
        // Renamed away, the writer still appending to it, and a new file at the path.
        let old = dir.path().join("events.log.1");
        std::fs::rename(&path, &old).unwrap();
        append(&old, "4\n");
        append(&path, "5\n");
        assert_eq!(tail.lines().unwrap(), ["4"]);
        assert_eq!(tail.lines().unwrap(), ["5"]);
        std::fs::remove_file(&path).unwrap();
        assert!(tail.lines().unwrap().is_empty());
        append(&path, "6\n");
        assert_eq!(tail.lines().unwrap(), ["6"]);
    }

    #[test]
    fn since_keeps_recent_events_and_lines_without_a_time() {
        let mut show = Show {
            json: true,
            since: Some(humantime::parse_rfc3339("2030-01-01T00:00:00Z").unwrap()),
            out: Vec::new(),
        };
        for line in [
            r#"{"timestamp":"2029-12-31T23:59:59.5Z","message":"old"}"#,
            r#"{"timestamp":"2030-01-01T00:00:01.000001Z","message":"new"}"#,
            "not an event",
        ] {
            show.line(line).unwrap();
        }
        let out = String::from_utf8(show.out).unwrap();
        assert!(!out.contains("old") && out.contains("new") && out.contains("not an event"));
        assert_eq!(out.lines().count(), 2);
    }
}
