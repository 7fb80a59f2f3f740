//! The datapath in use, shared by the agent's services: the loaded programs and maps behind
//! one lock, the policy they enforce, and the list entries the admin API added on top of it.

use std::{
    net::IpAddr,
    sync::{
        Mutex, MutexGuard, RwLock,
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

/// List entries added through the admin API, kept on top of the configuration's until the
/// agent restarts (entries meant to last belong in the configuration file).
#[derive(Default)]
struct Extra {
    allow: Vec<IpNet>,
    deny: Vec<IpNet>,
}

impl Extra {
    fn list(&mut self, kind: ListKind) -> &mut Vec<IpNet> {
        match kind {
            ListKind::Allow => &mut self.allow,
            ListKind::Deny => &mut self.deny,
        }
    }
}

/// The loaded datapath and what it enforces.
pub struct Enforcer {
    datapath: Mutex<Datapath>,
    policy: RwLock<Policy>,
    extra: Mutex<Extra>,
    ready: AtomicBool,
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
            extra: Mutex::new(Extra::default()),
            ready: AtomicBool::new(false),
            cookie_switches: [AtomicU64::new(0), AtomicU64::new(0)],
        }
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
        tracing::info!(%addr, ?ttl, "banned");
        Ok(())
    }

    pub fn unban(&self, addr: IpAddr) -> Result<bool, EnforceError> {
        let lifted = self.with_maps(|m| m.unban(addr))?;
        tracing::info!(%addr, lifted, "unbanned");
        Ok(lifted)
    }

    /// The policy in force: the configuration's with the admin API's list entries.
    pub fn policy(&self) -> Policy {
        let policy = self.policy.read().expect("policy lock");
        let extra = self.extra.lock().expect("lists lock");
        policy.with_lists(&extra.allow, &extra.deny)
    }

    /// Replaces the configured policy (start, SIGHUP) and writes it to the maps; the admin
    /// API's entries stay on top.
    pub fn set_policy(&self, policy: Policy) -> Result<(), EnforceError> {
        *self.policy.write().expect("policy lock") = policy;
        self.apply()
    }

    /// Adds a list entry; false if it was already there.
    pub fn list_add(&self, kind: ListKind, net: IpNet) -> Result<bool, EnforceError> {
        let net = net.trunc();
        if kind.of(&self.policy()).contains(&net) {
            return Ok(false);
        }
        self.extra.lock().expect("lists lock").list(kind).push(net);
        self.apply()?;
        Ok(true)
    }

    /// Removes an entry the admin API added; false if there was none, an error if the entry
    /// comes from the configuration.
    pub fn list_del(&self, kind: ListKind, net: IpNet) -> Result<bool, EnforceError> {
        let net = net.trunc();
        if kind
            .of(&self.policy.read().expect("policy lock"))
            .contains(&net)
        {
            return Err(EnforceError::Configured(net));
        }
        let removed = {
            let mut extra = self.extra.lock().expect("lists lock");
            let list = extra.list(kind);
            let before = list.len();
            list.retain(|n| *n != net);
            before != list.len()
        };
        if removed {
            self.apply()?;
        }
        Ok(removed)
    }

    /// Writes the policy in force to the kernel maps.
    fn apply(&self) -> Result<(), EnforceError> {
        let policy = self.policy();
        self.with_maps(|m| m.apply(&policy))?;
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
