//! Sessions per key (`kind = "concurrency"`): at most `limit` held at once, each acquired and
//! released over the broker protocol, and owned by the protocol connection that acquired it,
//! so a broker that dies (its connection drops) frees every session it held.
//!
//! A key's count moves only under its map entry's lock, so concurrent acquires of one key
//! never take more than the limit; a count back at zero is removed with its entry.

use std::{
    collections::HashMap,
    sync::{Arc, Weak},
};

use dashmap::{DashMap, mapref::entry::Entry};
use foldhash::quality::RandomState;

use super::bucket_keys::StoredKey;

/// Each key's sessions held now.
#[derive(Default)]
pub struct SessionCounts {
    counts: DashMap<StoredKey, u32, RandomState>,
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
        }
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

/// The sessions one protocol connection holds. Dropping it (the connection's end, however
/// it ends) gives every one back, to the counts it was taken from even if a reload has since
/// replaced them.
#[derive(Default)]
pub struct SessionOwner {
    held: HashMap<Held, Weak<SessionCounts>>,
}

impl SessionOwner {
    /// Whether this connection holds the session already (a repeated acquire is not counted
    /// twice).
    pub fn holds(&self, action: &Arc<str>, key: &StoredKey, session: &[u8]) -> bool {
        self.held
            .contains_key(&(Arc::clone(action), *key, session.to_vec()))
    }

    pub fn add(
        &mut self,
        action: &Arc<str>,
        key: &StoredKey,
        session: &[u8],
        counts: &Arc<SessionCounts>,
    ) {
        self.held.insert(
            (Arc::clone(action), *key, session.to_vec()),
            Arc::downgrade(counts),
        );
    }

    /// Gives the session back; false if this connection did not hold it.
    pub fn release(&mut self, action: &Arc<str>, key: &StoredKey, session: &[u8]) -> bool {
        match self
            .held
            .remove(&(Arc::clone(action), *key, session.to_vec()))
        {
            Some(counts) => {
                if let Some(counts) = counts.upgrade() {
                    counts.release(key);
                }
                true
            }
            None => false,
        }
    }

    pub fn len(&self) -> usize {
        self.held.len()
    }

    pub fn is_empty(&self) -> bool {
        self.held.is_empty()
    }
}

impl Drop for SessionOwner {
    fn drop(&mut self) {
        for ((_, key, _), counts) in self.held.drain() {
            if let Some(counts) = counts.upgrade() {
                counts.release(&key);
            }
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
        let mut broker = SessionOwner::default();
        counts.acquire(&alice, 5, false);
        broker.add(&action, &alice, b"c1", &counts);
        counts.acquire(&alice, 5, false);
        broker.add(&action, &alice, b"c2", &counts);
        let mut other = SessionOwner::default();
        counts.acquire(&alice, 5, false);
        other.add(&action, &alice, b"c3", &counts);
        assert!(broker.holds(&action, &alice, b"c1"));
        assert!(!broker.release(&action, &alice, b"c3"), "not this owner's");
        assert!(broker.release(&action, &alice, b"c1"));
        assert_eq!(counts.held(&alice), 2);
        drop(broker);
        assert_eq!(counts.held(&alice), 1, "the other broker's session stays");
        drop(other);
        assert_eq!(counts.keys(), 0);
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
