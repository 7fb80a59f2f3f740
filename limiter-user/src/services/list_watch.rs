//! Watches `allow-file` and `deny-file` (inotify, through the `notify` crate) and applies each
//! change to the kernel's tries as it is saved. Each file's directory is watched, not the file:
//! editors and configuration tools save by writing a new file and renaming it over the old one,
//! which a watch on the old file would never see. A file that no longer reads (a bad line, gone)
//! is reported and its last good entries stay in force.

use std::{
    path::{Path, PathBuf},
    sync::Arc,
    time::Duration,
};

use notify::{RecursiveMode, Watcher};
use tokio::sync::{mpsc, watch};

use crate::{
    api::ListKind,
    datapath::Enforcer,
    errors::error_chain,
    settings::{ListFile, ListFiles},
};

/// How long events are gathered before the files are read: a save is several events (create,
/// write, rename), and reading at the first may see a file half written.
const SETTLE: Duration = Duration::from_millis(100);

/// The watched paths, replaced on SIGHUP.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct ListPaths {
    pub allow: Option<PathBuf>,
    pub deny: Option<PathBuf>,
}

impl ListPaths {
    pub fn of(files: &ListFiles) -> Self {
        Self {
            allow: files.allow.as_ref().map(|f| f.path.clone()),
            deny: files.deny.as_ref().map(|f| f.path.clone()),
        }
    }

    fn each(&self) -> impl Iterator<Item = (ListKind, &'static str, &Path)> {
        [
            (ListKind::Allow, "allow-file", self.allow.as_deref()),
            (ListKind::Deny, "deny-file", self.deny.as_deref()),
        ]
        .into_iter()
        .filter_map(|(kind, setting, path)| path.map(|p| (kind, setting, p)))
    }
}

/// Applies what a resolve read (start, SIGHUP) to the enforcer; the first error stops it.
pub fn apply(enforcer: &Enforcer, files: &ListFiles) -> Result<(), crate::datapath::EnforceError> {
    for (kind, file) in [
        (ListKind::Allow, &files.allow),
        (ListKind::Deny, &files.deny),
    ] {
        let entries = file
            .as_ref()
            .map(|f| f.entries.to_vec())
            .unwrap_or_default();
        if enforcer.set_file_list(kind, entries)? {
            tracing::info!(list = kind.name(), "list file applied");
        }
    }
    Ok(())
}

/// Watches the paths `paths` holds (and, after a SIGHUP, the new ones) until `stop` fires.
/// The watches are in place when this returns, before the future runs: the agent says it is
/// ready only once a save would be seen. The files are read once more as the watch begins, so
/// a save between the start's read and the watch is not missed either.
pub fn run(
    enforcer: Arc<Enforcer>,
    mut paths: watch::Receiver<ListPaths>,
    stop: tokio_util::sync::CancellationToken,
) -> impl std::future::Future<Output = ()> + Send + 'static {
    let (tx, mut events) = mpsc::channel::<()>(1);
    let first = tx.clone();
    let watcher = notify::recommended_watcher(move |event: notify::Result<notify::Event>| {
        if event.is_ok_and(|e| !e.kind.is_access()) {
            // Full: a read is already due, which will see this change too.
            let _ = tx.try_send(());
        }
    });
    let mut watched: Vec<PathBuf> = Vec::new();
    let mut current = paths.borrow_and_update().clone();
    let watcher = match watcher {
        Ok(mut watcher) => {
            rewatch(&mut watcher, &mut watched, &current);
            let _ = first.try_send(());
            Some(watcher)
        }
        Err(error) => {
            tracing::error!(error = %error_chain(&error), "list files cannot be watched; SIGHUP re-reads them");
            None
        }
    };
    async move {
        let Some(mut watcher) = watcher else {
            return;
        };
        loop {
            tokio::select! {
                _ = stop.cancelled() => return,
                changed = paths.changed() => {
                    if changed.is_err() {
                        return;
                    }
                    current = paths.borrow_and_update().clone();
                    rewatch(&mut watcher, &mut watched, &current);
                }
                Some(()) = events.recv() => {
                    tokio::time::sleep(SETTLE).await;
                    while events.try_recv().is_ok() {}
                    let enforcer = Arc::clone(&enforcer);
                    let current = current.clone();
                    let _ = tokio::task::spawn_blocking(move || reread(&enforcer, &current)).await;
                }
            }
        }
    }
}

/// Watches the directories of `paths`, and only them.
fn rewatch(watcher: &mut impl Watcher, watched: &mut Vec<PathBuf>, paths: &ListPaths) {
    let mut want: Vec<PathBuf> = paths
        .each()
        .map(|(_, _, path)| match path.parent() {
            Some(dir) if !dir.as_os_str().is_empty() => dir.to_owned(),
            _ => PathBuf::from("."),
        })
        .collect();
    want.sort();
    want.dedup();
    for dir in watched.iter().filter(|d| !want.contains(d)) {
        let _ = watcher.unwatch(dir);
    }
    for dir in want.iter().filter(|d| !watched.contains(d)) {
        if let Err(error) = watcher.watch(dir, RecursiveMode::NonRecursive) {
            tracing::error!(dir = %dir.display(), error = %error_chain(&error), "cannot watch a list file's directory; SIGHUP re-reads it");
        }
    }
    *watched = want;
}

/// Reads each watched file again and applies the ones that read; the enforcer leaves an
/// unchanged list's tries alone.
fn reread(enforcer: &Enforcer, paths: &ListPaths) {
    for (kind, setting, path) in paths.each() {
        match ListFile::read(setting, path) {
            Ok(file) => match enforcer.set_file_list(kind, file.entries.to_vec()) {
                Ok(false) => {}
                Ok(true) => tracing::info!(
                    path = %path.display(),
                    entries = file.entries.len(),
                    "list file applied"
                ),
                Err(error) => tracing::error!(
                    path = %path.display(),
                    error = %error_chain(&error),
                    "list file not applied; its last entries stay in force"
                ),
            },
            Err(error) => tracing::error!("{error}; the file's last good entries stay in force"),
        }
    }
}
