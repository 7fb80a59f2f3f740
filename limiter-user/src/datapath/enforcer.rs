//! The datapath in use, shared by the agent's services: the loaded programs and maps behind
//! one lock, the policy they enforce, and the list entries of the list files and of the admin
//! API on top of it.

use std::{
    net::IpAddr,
    sync::{
        Arc, Mutex, MutexGuard, RwLock,
        atomic::{AtomicBool, AtomicU64, Ordering},
    },
    time::Duration,
};

use ipnet::IpNet;
use thiserror::Error;

use super::{Datapath, LoadError, Maps, MapsError, Policy};
use crate::api::ListKind;

#[derive(Debug, Error)]
pub enum EnforceError {
    #[error(transparent)]
    Maps(#[from] MapsError),
    #[error(transparent)]
    Load(#[from] LoadError),
    #[error("{0} comes from the configuration; change it there")]
    Configured(IpNet),
}

/// Entries of both lists from one origin (the list files, or the admin API).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Lists {
    pub allow: Vec<IpNet>,
    pub deny: Vec<IpNet>,
}

impl Lists {
    fn list(&mut self, kind: ListKind) -> &mut Vec<IpNet> {
        match kind {
            ListKind::Allow => &mut self.allow,
            ListKind::Deny => &mut self.deny,
        }
    }
}

/// What the enforcer holds beside the configured policy, under one lock so that a list file's
/// change and an admin change never interleave their writes.
#[derive(Default)]
struct Layers {
    /// The list files' entries (`allow-file`, `deny-file`), replaced whole on each change.
    files: Lists,
    /// Entries added through the admin API; the state file keeps them across restarts.
    admin: Lists,
    /// The policy as the maps hold it: all three merged and aggregated, computed once per
    /// change rather than per reader (a list file may hold 100,000 entries).
    in_force: Option<Policy>,
}

/// The loaded datapath and what it enforces.
pub struct Enforcer {
    datapath: Mutex<Datapath>,
    policy: RwLock<Policy>,
    layers: Mutex<Layers>,
    ready: AtomicBool,
    /// Woken on every change the state file keeps (a ban, an unban, an admin list entry), so
    /// its writer need not poll.
    changed: Arc<tokio::sync::Notify>,
    /// `syn-cookies = auto`'s switches, on and off, for the metrics.
    cookie_switches: [AtomicU64; 2],
}

/// SYN cookies as they stand, for the status and the metrics.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct CookieStatus {
    pub mode: super::CookieMode,
    /// Whether the programs answer unproven sources' SYNs with cookies now.
    pub active: bool,
    pub switched_on: u64,
    pub switched_off: u64,
}

impl Enforcer {
    pub fn new(datapath: Datapath, policy: Policy) -> Self {
        Self {
            datapath: Mutex::new(datapath),
            policy: RwLock::new(policy),
            layers: Mutex::new(Layers::default()),
            ready: AtomicBool::new(false),
            changed: Arc::new(tokio::sync::Notify::new()),
            cookie_switches: [AtomicU64::new(0), AtomicU64::new(0)],
        }
    }

    /// Notified after each ban, unban and admin list change.
    pub fn changes(&self) -> Arc<tokio::sync::Notify> {
        Arc::clone(&self.changed)
    }

    /// Writes `syn-cookies = auto`'s bits (see `services::syn_cookies`); `on` says which way
    /// it switched, for the count.
    pub fn switch_auto_cookies(&self, bits: u8, on: bool) -> Result<(), EnforceError> {
        let policy = self.policy();
        let was_on =
            self.with_maps(|m| m.config())?.syn_cookies & limiter_common::syn_cookies::ANSWER != 0;
        self.with_maps(|m| m.set_auto_cookies(bits, &policy))?;
        if was_on != on {
            self.cookie_switches[usize::from(!on)].fetch_add(1, Ordering::Relaxed);
        }
        Ok(())
    }

    pub fn cookie_status(&self) -> Result<CookieStatus, EnforceError> {
        let config = self.with_maps(|m| m.config())?;
        let (switched_on, switched_off) = self.cookie_switches();
        Ok(CookieStatus {
            mode: self.policy.read().expect("policy lock").cookies,
            active: config.syn_cookies & limiter_common::syn_cookies::ANSWER != 0,
            switched_on,
            switched_off,
        })
    }

    /// How often `syn-cookies = auto` switched cookies on, and off.
    pub fn cookie_switches(&self) -> (u64, u64) {
        let [on, off] = &self.cookie_switches;
        (on.load(Ordering::Relaxed), off.load(Ordering::Relaxed))
    }

    /// The datapath, locked. Every map operation is a short syscall; hold it briefly and never
    /// across an `.await`.
    pub fn datapath(&self) -> MutexGuard<'_, Datapath> {
        self.datapath.lock().expect("datapath lock")
    }

    pub fn with_maps<T>(&self, f: impl FnOnce(&mut Maps) -> T) -> T {
        f(&mut self.datapath().maps)
    }

    /// Programs attached and the maps answering.
    pub fn ready(&self) -> bool {
        self.ready.load(Ordering::Relaxed) && self.with_maps(|m| m.config().is_ok())
    }

    pub fn set_ready(&self) {
        self.ready.store(true, Ordering::Relaxed);
    }

    pub fn ban(&self, addr: IpAddr, ttl: Duration) -> Result<(), EnforceError> {
        self.with_maps(|m| m.ban(addr, ttl))?;
        self.changed.notify_one();
        tracing::info!(%addr, ?ttl, "banned");
        Ok(())
    }

    pub fn unban(&self, addr: IpAddr) -> Result<bool, EnforceError> {
        let lifted = self.with_maps(|m| m.unban(addr))?;
        self.changed.notify_one();
        tracing::info!(%addr, lifted, "unbanned");
        Ok(lifted)
    }

    /// The policy in force: the configuration's, with the list files' and the admin API's
    /// entries, merged as the maps hold them.
    pub fn policy(&self) -> Policy {
        let layers = self.layers.lock().expect("lists lock");
        match &layers.in_force {
            Some(policy) => policy.clone(),
            None => self.merged(&layers),
        }
    }

    fn merged(&self, layers: &Layers) -> Policy {
        let policy = self.policy.read().expect("policy lock");
        policy.merged(&[&layers.files, &layers.admin])
    }

    /// The entries the admin API added, as the state file keeps them.
    pub fn admin_lists(&self) -> Lists {
        self.layers.lock().expect("lists lock").admin.clone()
    }

    /// Replaces the configured policy (start, SIGHUP) and writes it to the maps; the list
    /// files' and the admin API's entries stay on top.
    pub fn set_policy(&self, policy: Policy) -> Result<(), EnforceError> {
        let mut layers = self.layers.lock().expect("lists lock");
        *self.policy.write().expect("policy lock") = policy;
        self.apply(&mut layers)
    }

    /// Replaces one list file's entries (start, SIGHUP, the file changed); false if they
    /// were the same.
    pub fn set_file_list(&self, kind: ListKind, nets: Vec<IpNet>) -> Result<bool, EnforceError> {
        let mut layers = self.layers.lock().expect("lists lock");
        if *layers.files.list(kind) == nets {
            return Ok(false);
        }
        let before = std::mem::replace(layers.files.list(kind), nets);
        if let Err(error) = self.apply(&mut layers) {
            // What the maps could not take is not what is in force.
            *layers.files.list(kind) = before;
            return Err(error);
        }
        Ok(true)
    }

    /// Adds a list entry; false if it was already there.
    pub fn list_add(&self, kind: ListKind, net: IpNet) -> Result<bool, EnforceError> {
        let net = net.trunc();
        let mut layers = self.layers.lock().expect("lists lock");
        let configured = kind
            .of(&self.policy.read().expect("policy lock"))
            .contains(&net);
        if configured
            || layers.files.list(kind).contains(&net)
            || layers.admin.list(kind).contains(&net)
        {
            return Ok(false);
        }
        layers.admin.list(kind).push(net);
        self.apply(&mut layers)?;
        self.changed.notify_one();
        Ok(true)
    }

    /// Removes an entry the admin API added; false if there was none, an error if the entry
    /// comes from the configuration or a list file.
    pub fn list_del(&self, kind: ListKind, net: IpNet) -> Result<bool, EnforceError> {
        let net = net.trunc();
        let mut layers = self.layers.lock().expect("lists lock");
        if kind
            .of(&self.policy.read().expect("policy lock"))
            .contains(&net)
            || layers.files.list(kind).contains(&net)
        {
            return Err(EnforceError::Configured(net));
        }
        let list = layers.admin.list(kind);
        let before = list.len();
        list.retain(|n| *n != net);
        let removed = before != list.len();
        if removed {
            self.apply(&mut layers)?;
            self.changed.notify_one();
        }
        Ok(removed)
    }

    /// Writes the policy in force to the kernel maps.
    fn apply(&self, layers: &mut Layers) -> Result<(), EnforceError> {
        let policy = self.merged(layers);
        layers.in_force = None;
        self.with_maps(|m| m.apply(&policy))?;
        layers.in_force = Some(policy);
        Ok(())
    }
}

impl ListKind {
    /// This list's entries in `policy`.
    fn of(self, policy: &Policy) -> &[IpNet] {
        match self {
            ListKind::Allow => &policy.allow,
            ListKind::Deny => &policy.deny,
        }
    }
}
