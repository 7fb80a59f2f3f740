//! Sessions per key (`kind = "concurrency"`): at most `limit` held at once, each acquired and
//! released over the broker protocol, and owned by the protocol connection that acquired it,
//! so a broker that dies (its connection drops) frees every session it held. A shared action's
//! session is a lease in the fleet's store as well (`fleet/redis_sessions.rs`), given back with it.
//!
//! A key's count moves only under its map entry's lock, so concurrent acquires of one key
//! never take more than the limit; a count back at zero is removed with its entry.

use std::{
    collections::HashMap,
    sync::{
        Arc, Mutex, Weak,
        atomic::{AtomicU64, Ordering},
    },
};

use dashmap::{DashMap, mapref::entry::Entry};
use foldhash::quality::RandomState;

use super::{
    bucket_keys::StoredKey,
    shared_store::{SessionLease, SharedBuckets, SharedFuture},
};

/// Each key's sessions held now through this agent (in a fleet, its brokers' share).
#[derive(Default)]
pub struct SessionCounts {
    counts: DashMap<StoredKey, u32, RandomState>,
    /// Every key's together, for the metrics.
    total: AtomicU64,
}

impl SessionCounts {
    /// Takes one of `key`'s sessions if fewer than `limit` are held, or regardless with
    /// `force` (monitor mode judges, and takes it anyway); returns whether it fit and the
    /// count after.
    pub fn acquire(&self, key: &StoredKey, limit: u32, force: bool) -> (bool, u32) {
        let mut count = self.counts.entry(*key).or_insert(0);
        let fits = *count < limit;
        if fits || force {
            *count = count.saturating_add(1);
            self.total.fetch_add(1, Ordering::Relaxed);
        }
        let after = *count;
        drop(count);
        if after == 0 {
            self.counts.remove_if(key, |_, c| *c == 0);
        }
        (fits, after)
    }

    /// Gives one of `key`'s sessions back.
    pub fn release(&self, key: &StoredKey) {
        if let Entry::Occupied(mut entry) = self.counts.entry(*key) {
            if *entry.get() <= 1 {
                entry.remove();
            } else {
                *entry.get_mut() -= 1;
            }
            self.total.fetch_sub(1, Ordering::Relaxed);
        }
    }

    /// Sessions held now, every key's.
    pub fn total(&self) -> u64 {
        self.total.load(Ordering::Relaxed)
    }

    /// Sessions `key` holds now.
    pub fn held(&self, key: &StoredKey) -> u32 {
        self.counts.get(key).map_or(0, |c| *c)
    }

    /// Keys holding at least one session.
    pub fn keys(&self) -> usize {
        self.counts.len()
    }
}

/// One held session: the action's name, the key as stored, and the broker's name for it.
type Held = (Arc<str>, StoredKey, Vec<u8>);

/// Where a held session is counted: always in this agent's counts it was taken from, and for
/// a shared action also as a lease in the fleet's store.
struct Holding {
    counts: Weak<SessionCounts>,
    lease: Option<(Weak<dyn SharedBuckets>, SessionLease)>,
}

impl Holding {
    /// Gives the session back here at once, and the lease to the store, whose answer is
    /// still to come.
    fn give_back(self, key: &StoredKey) -> Option<SharedFuture<bool>> {
        if let Some(counts) = self.counts.upgrade() {
            counts.release(key);
        }
        let (store, lease) = self.lease?;
        Some(store.upgrade()?.release_session(lease))
    }

    /// Gives the session back without waiting for the store: the connection is gone.
    fn give_back_unawaited(self, key: &StoredKey) {
        if let Some(released) = self.give_back(key)
            && let Ok(runtime) = tokio::runtime::Handle::try_current()
        {
            runtime.spawn(released);
        }
    }
}

/// What a release did.
pub enum Released {
    /// The connection held no session of that name.
    NotHeld,
    /// Given back.
    Done,
    /// Given back here; the fleet's store is still to confirm it.
    Waiting(SharedFuture<bool>),
}

/// Gives every protocol connection its own name among the agent's.
static NEXT_OWNER: AtomicU64 = AtomicU64::new(1);

/// The sessions one protocol connection holds. Dropping it (the connection's end, however
/// it ends) gives every one back, to the counts it was taken from even if a reload has since
/// replaced them, and to the fleet's store. An acquire waiting on the store adds its session
/// through [`SessionOwner::handle`] once it is answered.
pub struct SessionOwner {
    id: u64,
    held: Arc<Mutex<HashMap<Held, Holding>>>,
}

/// An owner's sessions, for an acquire still waiting on the fleet's store: a session that fits
/// after its connection ended is given back at once.
#[derive(Clone)]
pub struct OwnerHandle {
    held: Weak<Mutex<HashMap<Held, Holding>>>,
}

impl Default for SessionOwner {
    fn default() -> Self {
        Self {
            id: NEXT_OWNER.fetch_add(1, Ordering::Relaxed),
            held: Arc::default(),
        }
    }
}

impl SessionOwner {
    fn held(&self) -> std::sync::MutexGuard<'_, HashMap<Held, Holding>> {
        self.held.lock().expect("sessions lock")
    }

    /// Whether this connection holds the session already (a repeated acquire is not counted
    /// twice), and whether as a lease in the fleet's store.
    pub fn holds(&self, action: &Arc<str>, key: &StoredKey, session: &[u8]) -> Option<bool> {
        self.held()
            .get(&(Arc::clone(action), *key, session.to_vec()))
            .map(|h| h.lease.is_some())
    }

    /// Records a session taken in `counts` (this agent's only).
    pub fn add(
        &self,
        action: &Arc<str>,
        key: &StoredKey,
        session: &[u8],
        counts: &Arc<SessionCounts>,
    ) {
        self.handle().add(action, key, session, counts, None);
    }

    /// The session's name in the fleet's store: this connection's number and the broker's
    /// name.
    pub fn lease_name(&self, session: &[u8]) -> Vec<u8> {
        let mut name = format!("{}:", self.id).into_bytes();
        name.extend_from_slice(session);
        name
    }

    pub fn handle(&self) -> OwnerHandle {
        OwnerHandle {
            held: Arc::downgrade(&self.held),
        }
    }

    /// Gives the session back, if this connection held it.
    pub fn release(&self, action: &Arc<str>, key: &StoredKey, session: &[u8]) -> Released {
        let removed = self
            .held()
            .remove(&(Arc::clone(action), *key, session.to_vec()));
        match removed.map(|holding| holding.give_back(key)) {
            None => Released::NotHeld,
            Some(None) => Released::Done,
            Some(Some(waiting)) => Released::Waiting(waiting),
        }
    }

    pub fn len(&self) -> usize {
        self.held().len()
    }

    pub fn is_empty(&self) -> bool {
        self.held().is_empty()
    }
}

impl OwnerHandle {
    /// Records a session taken in `counts`, and in the fleet's store as `lease`; a connection
    /// already gone gives it back at once.
    pub fn add(
        &self,
        action: &Arc<str>,
        key: &StoredKey,
        session: &[u8],
        counts: &Arc<SessionCounts>,
        lease: Option<(&Arc<dyn SharedBuckets>, SessionLease)>,
    ) {
        let holding = Holding {
            counts: Arc::downgrade(counts),
            lease: lease.map(|(store, lease)| (Arc::downgrade(store), lease)),
        };
        let Some(held) = self.held.upgrade() else {
            holding.give_back_unawaited(key);
            return;
        };
        let previous = held
            .lock()
            .expect("sessions lock")
            .insert((Arc::clone(action), *key, session.to_vec()), holding);
        // Two acquires of one name in flight at once: the second counted it again here.
        if let Some(previous) = previous
            && let Some(counts) = previous.counts.upgrade()
        {
            counts.release(key);
        }
    }
}

impl Drop for SessionOwner {
    fn drop(&mut self) {
        let held = std::mem::take(&mut *self.held());
        for ((_, key, _), holding) in held {
            holding.give_back_unawaited(&key);
        }
    }
}

#[cfg(test)]
mod tests {
    use std::{sync::Barrier, thread};

    use super::*;
    use crate::buckets::{KeyKind, bucket_keys};

    fn key(k: &str) -> StoredKey {
        bucket_keys::store(KeyKind::User, k.as_bytes()).unwrap()
    }

    #[test]
    fn at_most_the_limit_and_a_release_makes_room() {
        let counts = SessionCounts::default();
        let alice = key("alice");
        assert_eq!(counts.acquire(&alice, 2, false), (true, 1));
        assert_eq!(counts.acquire(&alice, 2, false), (true, 2));
        assert_eq!(counts.acquire(&alice, 2, false), (false, 2));
        counts.release(&alice);
        assert_eq!(counts.acquire(&alice, 2, false), (true, 2));
        assert_eq!(
            counts.acquire(&alice, 2, true),
            (false, 3),
            "monitor takes it anyway"
        );
        for _ in 0..3 {
            counts.release(&alice);
        }
        assert_eq!((counts.held(&alice), counts.keys()), (0, 0));
        assert_eq!(counts.acquire(&alice, 0, false), (false, 0));
        assert_eq!(counts.keys(), 0, "a refused first session leaves no entry");
    }

    #[test]
    fn an_owner_dropped_gives_back_what_it_held_and_only_that() {
        let counts = Arc::new(SessionCounts::default());
        let action: Arc<str> = Arc::from("sessions");
        let alice = key("alice");
        let broker = SessionOwner::default();
        counts.acquire(&alice, 5, false);
        broker.add(&action, &alice, b"c1", &counts);
        counts.acquire(&alice, 5, false);
        broker.add(&action, &alice, b"c2", &counts);
        let other = SessionOwner::default();
        counts.acquire(&alice, 5, false);
        other.add(&action, &alice, b"c3", &counts);
        assert_eq!(broker.holds(&action, &alice, b"c1"), Some(false));
        assert_eq!(counts.total(), 3);
        assert!(
            matches!(broker.release(&action, &alice, b"c3"), Released::NotHeld),
            "not this owner's"
        );
        assert!(matches!(
            broker.release(&action, &alice, b"c1"),
            Released::Done
        ));
        assert_eq!(counts.held(&alice), 2);
        drop(broker);
        assert_eq!(counts.held(&alice), 1, "the other broker's session stays");
        drop(other);
        assert_eq!((counts.keys(), counts.total()), (0, 0));
    }

    #[test]
    fn a_session_answered_after_its_connection_ended_is_given_back_at_once() {
        let counts = Arc::new(SessionCounts::default());
        let action: Arc<str> = Arc::from("sessions");
        let alice = key("alice");
        let broker = SessionOwner::default();
        let waiting = broker.handle();
        assert_ne!(
            broker.lease_name(b"c1"),
            SessionOwner::default().lease_name(b"c1"),
            "each connection names its sessions apart"
        );
        counts.acquire(&alice, 5, false);
        waiting.add(&action, &alice, b"c1", &counts, None);
        // The same name answered twice (two acquires in flight) is held once.
        counts.acquire(&alice, 5, true);
        waiting.add(&action, &alice, b"c1", &counts, None);
        assert_eq!((broker.len(), counts.held(&alice)), (1, 1));
        drop(broker);
        assert_eq!(counts.total(), 0);
        counts.acquire(&alice, 5, false);
        waiting.add(&action, &alice, b"c2", &counts, None);
        assert_eq!((counts.keys(), counts.total()), (0, 0));
    }

    #[test]
    fn concurrent_acquires_of_one_key_take_exactly_the_limit() {
        let counts = Arc::new(SessionCounts::default());
        let barrier = Arc::new(Barrier::new(8));
        let taken: usize = (0..8)
            .map(|_| {
                let (counts, barrier) = (Arc::clone(&counts), Arc::clone(&barrier));
                thread::spawn(move || {
                    barrier.wait();
                    (0..100)
                        .filter(|_| counts.acquire(&key("alice"), 50, false).0)
                        .count()
                })
            })
            .collect::<Vec<_>>()
            .into_iter()
            .map(|t| t.join().unwrap())
            .sum();
        assert_eq!((taken, counts.held(&key("alice"))), (50, 50));
    }
}
