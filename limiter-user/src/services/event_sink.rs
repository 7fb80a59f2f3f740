//! The process's `tracing` subscriber, with the event log's sink beside the ordinary log:
//! events (target [`events::TARGET`]) go only to the sink, everything else only to stderr as
//! before. The sink starts empty and [`open`] sets it from `event-log` once the settings are
//! resolved, and again on each SIGHUP (so a reload may move it, and logrotate's `postrotate`
//! HUP makes the agent write to a new file).

use std::{
    fs::{File, OpenOptions},
    io,
    path::PathBuf,
    sync::{Mutex, OnceLock},
};

use tracing_subscriber::{
    EnvFilter, Layer, Registry,
    filter::{LevelFilter, Targets},
    fmt::MakeWriter,
    layer::SubscriberExt,
    registry::LookupSpan,
    reload,
    util::SubscriberInitExt,
};

use crate::{
    events,
    settings::{EventLog, JOURNALD_IDENTIFIER},
};

type Sink = Box<dyn Layer<Registry> + Send + Sync>;

/// The sink's slot in the installed subscriber, set by [`init`]: a subscriber is installed
/// once per process, and so is its handle.
static SINK: OnceLock<reload::Handle<Option<Sink>, Registry>> = OnceLock::new();

#[derive(Debug, thiserror::Error)]
pub enum SinkError {
    #[error("opening the event log {}", path.display())]
    File {
        path: PathBuf,
        #[source]
        source: io::Error,
    },
    #[error("connecting to journald for the event log")]
    Journald(#[source] io::Error),
    #[error("the event log's subscriber is not installed in this process")]
    NotInstalled,
    #[error("replacing the event log's sink")]
    Reload(#[source] reload::Error),
}

/// Installs the subscriber: the ordinary log on stderr under `filter`, the events never in
/// it, and the event log's sink, empty until [`open`].
pub fn init(filter: EnvFilter) {
    let ansi = io::IsTerminal::is_terminal(&io::stderr());
    let (subscriber, handle) = subscriber(filter, io::stderr, ansi);
    subscriber.init();
    let _ = SINK.set(handle);
}

/// The subscriber [`init`] installs, writing the ordinary log to `log`.
fn subscriber<W>(
    filter: EnvFilter,
    log: W,
    ansi: bool,
) -> (
    impl tracing::Subscriber + Send + Sync,
    reload::Handle<Option<Sink>, Registry>,
)
where
    W: for<'a> MakeWriter<'a> + Send + Sync + 'static,
{
    let filter = filter.add_directive(
        format!("{}=off", events::TARGET)
            .parse()
            .expect("a constant directive"),
    );
    let (sink, handle) = reload::Layer::new(None::<Sink>);
    let events_only = Targets::new().with_target(events::TARGET, LevelFilter::INFO);
    let ordinary = tracing_subscriber::fmt::layer()
        .with_writer(log)
        .with_ansi(ansi)
        .with_filter(filter);
    let subscriber = tracing_subscriber::registry()
        .with(sink.with_filter(events_only))
        .with(ordinary);
    (subscriber, handle)
}

/// The event log's JSON lines: the time, then the event's fields at the top level, one
/// line per event.
pub fn json_layer<S, W>(writer: W) -> impl Layer<S> + Send + Sync
where
    S: tracing::Subscriber + for<'a> LookupSpan<'a>,
    W: for<'a> MakeWriter<'a> + Send + Sync + 'static,
{
    tracing_subscriber::fmt::layer()
        .json()
        .flatten_event(true)
        .with_current_span(false)
        .with_span_list(false)
        .with_target(false)
        .with_level(false)
        .with_writer(writer)
}

/// Points the sink at `log`: a file is opened (made, with its directory, if missing) for
/// appending; each line goes in one write, so readers never see half an event.
pub fn open(log: &EventLog) -> Result<(), SinkError> {
    let sink: Option<Sink> = match log {
        EventLog::Off => None,
        EventLog::Journald => Some(Box::new(
            tracing_journald::layer()
                .map_err(SinkError::Journald)?
                .with_syslog_identifier(JOURNALD_IDENTIFIER.to_owned())
                .with_field_prefix(None),
        )),
        EventLog::File(path) => Some(Box::new(json_layer(Mutex::new(append(path).map_err(
            |source| SinkError::File {
                path: path.clone(),
                source,
            },
        )?)))),
    };
    SINK.get()
        .ok_or(SinkError::NotInstalled)?
        .reload(sink)
        .map_err(SinkError::Reload)
}

fn append(path: &std::path::Path) -> io::Result<File> {
    if let Some(dir) = path.parent() {
        std::fs::create_dir_all(dir)?;
    }
    OpenOptions::new().create(true).append(true).open(path)
}

#[cfg(test)]
pub(crate) mod tests {
    use std::sync::{Arc, Mutex};

    use super::*;
    use crate::events::{BanCause, Event};

    #[test]
    fn events_reach_only_the_sink_and_the_log_only_stderr() {
        let (log, sink) = (Buffer::default(), Buffer::default());
        let (subscriber, handle) =
            subscriber(EnvFilter::new("info,limiter=debug"), log.clone(), false);
        tracing::subscriber::with_default(subscriber, || {
            let ban = Event::Ban {
                addr: "192.0.2.1".parse().unwrap(),
                cause: BanCause::Broker,
                ttl: std::time::Duration::from_secs(60),
            };
            // No sink yet: the event goes nowhere, and not to the log either.
            events::emit(&ban);
            handle
                .reload(Some(Box::new(json_layer(sink.clone())) as Sink))
                .unwrap();
            events::emit(&ban);
            tracing::info!("an ordinary line");
            handle.reload(None).unwrap();
            events::emit(&ban);
        });
        assert_eq!(sink.text().lines().count(), 1, "{}", sink.text());
        assert!(sink.text().contains("\"kind\":\"ban\""), "{}", sink.text());
        assert!(!sink.text().contains("ordinary"));
        assert!(log.text().contains("an ordinary line"), "{}", log.text());
        assert!(!log.text().contains("banned"), "{}", log.text());
    }

    /// A writer whose lines a test reads back.
    #[derive(Clone, Default)]
    pub struct Buffer(Arc<Mutex<Vec<u8>>>);

    impl Buffer {
        pub fn text(&self) -> String {
            String::from_utf8(self.0.lock().unwrap().clone()).unwrap()
        }
    }

    impl std::io::Write for Buffer {
        fn write(&mut self, bytes: &[u8]) -> std::io::Result<usize> {
            self.0.lock().unwrap().extend_from_slice(bytes);
            Ok(bytes.len())
        }

        fn flush(&mut self) -> std::io::Result<()> {
            Ok(())
        }
    }

    impl<'a> tracing_subscriber::fmt::MakeWriter<'a> for Buffer {
        type Writer = Self;

        fn make_writer(&'a self) -> Self {
            self.clone()
        }
    }
}
