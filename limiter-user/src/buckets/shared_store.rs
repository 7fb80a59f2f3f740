//! Buckets and quotas kept outside this agent, one per key for the whole fleet. The limiter
//! knows only this contract; `fleet/` keeps them in Redis. A shared store answers a GCRA or a
//! quota check on its own clock, or says it cannot (down, failing, slower than its timeout),
//! and the check is then decided here, on this agent's cells at the action's fallback share.
//! A concurrency action's sessions are leases there, one set per key for the whole fleet,
//! decided here the same way (at the fallback share) when the store cannot answer.

use std::{
    future::Future,
    pin::Pin,
    sync::Arc,
    task::{Context, Poll},
};

use crate::api::FleetStatus;

use super::{calendar_quota::Quota, cell::Evaluation, gcra::Rate};

/// The limit a shared check is held to: a rate's bucket or a quota's window.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum SharedLimit {
    Rate(Rate),
    Quota(Quota),
}

/// A boxed answer still to come.
pub type SharedFuture<T> = Pin<Box<dyn Future<Output = T> + Send>>;

/// One check for the shared store.
#[derive(Clone, Debug)]
pub struct SharedCheck {
    pub action: Arc<str>,
    /// The key as the store names it ([`super::bucket_keys::shared_name`]).
    pub key: Vec<u8>,
    pub limit: SharedLimit,
    pub cost: u32,
    /// False for a peek: evaluate, spend nothing.
    pub consume: bool,
}

/// One session as the shared store names it.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct SessionLease {
    pub action: Arc<str>,
    /// The key as the store names it ([`super::keys::shared_name`]).
    pub key: Vec<u8>,
    /// The session's name on this agent: its protocol connection and the broker's name for
    /// it (the store makes it unique in the fleet).
    pub session: Vec<u8>,
}

/// What the store answered for sessions: whether one (more) fit, and the key's sessions
/// held in the whole fleet after it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SessionsHeld {
    pub fits: bool,
    pub held: u32,
}

pub trait SharedBuckets: Send + Sync {
    /// The verdict of the shared bucket or quota, all or nothing for the cost; `None` when the
    /// store
    /// did not answer in time, never later than its timeout.
    fn take(&self, check: SharedCheck) -> SharedFuture<Option<Evaluation>>;

    /// Forgets a key's shared bucket: whether it had one, `None` when the store did not
    /// answer.
    fn forget(&self, action: Arc<str>, key: Vec<u8>) -> SharedFuture<Option<bool>>;

    /// The agents sharing the buckets: a check decided locally gets this share of the limit.
    fn expected_replicas(&self) -> u32;

    /// Takes `lease` if fewer than `limit` sessions of its key are held in the fleet (with
    /// `force`, regardless); a lease taken is kept alive until [`Self::release_session`].
    /// `None` when the store did not answer in time: then it holds nothing for the lease.
    fn acquire_session(
        &self,
        lease: SessionLease,
        limit: u32,
        force: bool,
    ) -> SharedFuture<Option<SessionsHeld>>;

    /// Gives a lease back (it is no longer renewed from now on); the future says whether the
    /// store confirmed it within its timeout (if not, the lease lapses).
    fn release_session(&self, lease: SessionLease) -> SharedFuture<bool>;

    /// Whether one more of the key's sessions would fit `limit`; `None` when the store did
    /// not answer.
    fn sessions_held(
        &self,
        action: Arc<str>,
        key: Vec<u8>,
        limit: u32,
    ) -> SharedFuture<Option<SessionsHeld>>;

    fn status(&self) -> FleetStatus;
}

/// An answer that is either here already (a local bucket) or waits on the shared store.
pub enum Pending<T> {
    Ready(Option<T>),
    Waiting(SharedFuture<T>),
}

impl<T> Pending<T> {
    pub fn ready(value: T) -> Self {
        Self::Ready(Some(value))
    }

    /// The answer if it needs no waiting.
    pub fn now(self) -> Result<T, Self> {
        match self {
            Self::Ready(Some(value)) => Ok(value),
            other => Err(other),
        }
    }
}

impl<T: Unpin> Future for Pending<T> {
    type Output = T;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<T> {
        match self.get_mut() {
            Self::Ready(value) => {
                Poll::Ready(value.take().expect("a Pending polled after it completed"))
            }
            Self::Waiting(future) => future.as_mut().poll(cx),
        }
    }
}
