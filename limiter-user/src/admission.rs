//! Who gets one of a listener's connection slots.
//!
//! Each listener (HTTP, the Unix socket, TCP) serves at most `max` connections, so idle or
//! slow clients cannot take every file descriptor the agent has. A full listener does not just
//! stop accepting, which would let whoever holds the slots blind it: a new connection takes
//! the slot of the oldest one that has not yet sent a whole request. Clients that have (the
//! broker's long-lived connections) are never evicted for newcomers; when they alone fill the
//! listener, newcomers wait for a slot.

use std::{
    collections::VecDeque,
    sync::{
        Arc, Mutex,
        atomic::{AtomicU64, Ordering},
    },
    time::{Duration, Instant},
};

use tokio::sync::{OwnedSemaphorePermit, Semaphore};
use tokio_util::sync::{CancellationToken, WaitForCancellationFutureOwned};

/// One listener's slots.
pub struct Admission {
    permits: Arc<Semaphore>,
    /// Connections holding a slot without a whole request yet, oldest first.
    unproven: Mutex<VecDeque<(u64, CancellationToken)>>,
    next_id: AtomicU64,
    evicted: AtomicU64,
    /// The cap in force, and the slots a lowered cap still has to take back: they are taken
    /// as connections close, none is closed for it.
    resizing: Mutex<(u32, u32)>,
}

impl Admission {
    pub fn new(max: u32) -> Arc<Self> {
        Arc::new(Self {
            permits: Arc::new(Semaphore::new(max as usize)),
            unproven: Mutex::new(VecDeque::new()),
            next_id: AtomicU64::new(0),
            evicted: AtomicU64::new(0),
            resizing: Mutex::new((max, 0)),
        })
    }

    /// Changes the cap (a reload): a raised cap admits waiting connections at once; a lowered
    /// one takes free slots now and the others as their connections close.
    pub fn resize(&self, max: u32) {
        let mut resizing = self.resizing.lock().expect("admission lock");
        let (current, owed) = &mut *resizing;
        if max > *current {
            let grown = max - *current;
            let repaid = grown.min(*owed);
            *owed -= repaid;
            self.permits.add_permits((grown - repaid) as usize);
        } else {
            let shrunk = *current - max;
            let taken = self.permits.forget_permits(shrunk as usize) as u32;
            *owed += shrunk - taken;
        }
        *current = max;
    }

    /// Whether a slot given back goes to a lowered cap rather than to the next connection.
    fn repay(&self) -> bool {
        let mut resizing = self.resizing.lock().expect("admission lock");
        let repaid = resizing.1 > 0;
        resizing.1 -= u32::from(repaid);
        repaid
    }

    /// A slot for a connection just accepted: a free one, else the oldest unproven
    /// connection's (which is told to close), else the first to be given back.
    pub async fn admit(self: &Arc<Self>) -> Ticket {
        let permit = match Arc::clone(&self.permits).try_acquire_owned() {
            Ok(permit) => permit,
            Err(_) => {
                let oldest = self.unproven.lock().expect("admission lock").pop_front();
                if let Some((_, cancel)) = oldest {
                    cancel.cancel();
                    self.evicted.fetch_add(1, Ordering::Relaxed);
                }
                Arc::clone(&self.permits)
                    .acquire_owned()
                    .await
                    .expect("the semaphore is never closed")
            }
        };
        let id = self.next_id.fetch_add(1, Ordering::Relaxed);
        let cancel = CancellationToken::new();
        self.unproven
            .lock()
            .expect("admission lock")
            .push_back((id, cancel.clone()));
        Ticket {
            permit: Some(permit),
            id,
            cancel,
            admission: Arc::clone(self),
        }
    }

    /// Connections closed to make room for newer ones since the start.
    pub fn evicted(&self) -> u64 {
        self.evicted.load(Ordering::Relaxed)
    }

    fn forget(&self, id: u64) {
        let mut unproven = self.unproven.lock().expect("admission lock");
        if let Some(at) = unproven.iter().position(|(i, _)| *i == id) {
            unproven.remove(at);
        }
    }
}

/// A connection's slot, given back when dropped.
pub struct Ticket {
    permit: Option<OwnedSemaphorePermit>,
    id: u64,
    cancel: CancellationToken,
    admission: Arc<Admission>,
}

impl Ticket {
    /// The connection sent a whole request: it is no longer evicted for newcomers.
    pub fn proven(&self) {
        self.admission.forget(self.id);
    }

    /// Resolves when a newer connection has taken this one's slot.
    pub fn evicted(&self) -> WaitForCancellationFutureOwned {
        self.cancel.clone().cancelled_owned()
    }
}

impl Drop for Ticket {
    fn drop(&mut self) {
        self.admission.forget(self.id);
        if self.admission.repay()
            && let Some(permit) = self.permit.take()
        {
            permit.forget();
        }
    }
}

/// Failed accepts (`EMFILE` above all) back off, doubling up to half a second, and are logged
/// at most once a second with how many were not, so a failing listener neither spins nor
/// floods the log.
pub struct AcceptBackoff {
    listener: &'static str,
    delay: Duration,
    last_log: Option<Instant>,
    unlogged: u64,
}

impl AcceptBackoff {
    const FIRST: Duration = Duration::from_millis(5);
    const MAX: Duration = Duration::from_millis(500);
    const LOG_EVERY: Duration = Duration::from_secs(1);

    pub fn new(listener: &'static str) -> Self {
        Self {
            listener,
            delay: Self::FIRST,
            last_log: None,
            unlogged: 0,
        }
    }

    /// An accept succeeded: the next failure starts from the shortest wait.
    pub fn succeeded(&mut self) {
        self.delay = Self::FIRST;
    }

    /// An accept failed: logs (rate-bounded) and waits before the next one.
    pub async fn failed(&mut self, error: &std::io::Error) {
        let now = Instant::now();
        if self
            .last_log
            .is_none_or(|at| now.duration_since(at) >= Self::LOG_EVERY)
        {
            tracing::warn!(
                listener = self.listener,
                %error,
                suppressed = self.unlogged,
                retry_in = ?self.delay,
                "accepting a connection failed"
            );
            self.last_log = Some(now);
            self.unlogged = 0;
        } else {
            self.unlogged += 1;
        }
        tokio::time::sleep(self.delay).await;
        self.delay = (self.delay * 2).min(Self::MAX);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn a_full_listener_evicts_the_oldest_unproven_connection() {
        let admission = Admission::new(2);
        let first = admission.admit().await;
        let second = admission.admit().await;
        second.proven();
        let evicted = first.evicted();
        let admitting = tokio::spawn({
            let admission = Arc::clone(&admission);
            async move { admission.admit().await }
        });
        evicted.await;
        drop(first);
        let third = tokio::time::timeout(Duration::from_secs(5), admitting)
            .await
            .unwrap()
            .unwrap();
        assert_eq!(admission.evicted(), 1);
        // Only proven connections left besides the newcomer, which is itself unproven.
        third.proven();
        assert!(
            tokio::time::timeout(Duration::from_millis(50), admission.admit())
                .await
                .is_err(),
            "proven connections are never evicted"
        );
        drop(second);
        drop(third);
    }

    #[tokio::test]
    async fn a_resized_cap_admits_at_once_or_takes_slots_back_as_they_close() {
        let admission = Admission::new(1);
        let first = admission.admit().await;
        first.proven();
        let waiting = tokio::spawn({
            let admission = Arc::clone(&admission);
            async move { admission.admit().await }
        });
        admission.resize(2);
        let second = tokio::time::timeout(Duration::from_secs(5), waiting)
            .await
            .expect("a raised cap admits the waiting connection")
            .unwrap();
        second.proven();
        admission.resize(1);
        drop(first);
        let full = tokio::time::timeout(Duration::from_millis(50), admission.admit()).await;
        assert!(full.is_err(), "the closed slot went to the lowered cap");
        drop(second);
        let third = tokio::time::timeout(Duration::from_secs(5), admission.admit()).await;
        assert!(third.is_ok(), "one slot remains");
    }
}
