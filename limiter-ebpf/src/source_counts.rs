//! Each source's count of open connections in a profile, in `SOURCE_CONNS`, whose entry exists
//! only while the count is above zero: a flood of sources that each connected once, or a table
//! failing closed, must not fill up with sources that hold nothing. (A "source" here is a
//! source key in a profile.)
//!
//! Removing an entry at zero races the sources' handshakes on other CPUs, and a hash map
//! deletes by key, unconditionally, so the count is exact by these rules:
//!
//! - **Retire, then delete.** An entry is deleted only by whoever retired it, by
//!   compare-and-swap from 0 to [`SOURCE_RETIRED`]. Counts move only by compare-and-swap from
//!   a value without that bit, so a retired entry's value never moves again, and a slot is
//!   either in a live entry or was never taken: a take before the retirement makes it fail.
//! - **A retired entry is waited out, never counted around.** A taker that finds one (its
//!   remover between the swap and the delete, a few hundred nanoseconds) looks again, up to
//!   [`TRIES`] times; if the entry outlasts them, [`Taken::Busy`] refuses the handshake
//!   rather than letting it in uncounted.
//! - **A pointer may outlive its element.** A deleted element's memory is reused at once
//!   (preallocated or not), possibly for another source, so a pointer from a lookup before a
//!   delete may now hold another source's count. After changing a count through a pointer,
//!   the caller looks its source up again: the same element means it was its own (an entry
//!   holding a taken slot cannot be retired, and one a retirement marks is deleted only by
//!   that retirement, so neither can change hands in between); any other answer means the
//!   change landed in another source's entry and is undone there.
//!
//! Another source's entry that such an undo leaves at zero stays until the agent's sweeper
//! removes it through [`retire_idle`]. The map is preallocated: an insert then fails only
//! when the table is full, never for an allocation under a burst.

use limiter_common::{ProfileSource, SOURCE_RETIRED};

use crate::{
    atomics,
    map_access::{self, SOURCE_CONNS},
};

/// Looks taken by a source at a contended or retiring entry before giving up.
const TRIES: usize = 32;

/// What [`take`] found.
pub enum Taken {
    /// The slots are `source`'s, through `counter`, which held `before`.
    Slots { counter: *mut u64, before: u64 },
    /// The table has no room for a new entry.
    Full,
    /// The source's entry was being removed (or contended) for every try: nothing was taken.
    Busy,
}

/// Whether `counter` is `source`'s entry in the table right now.
#[inline(always)]
fn is_entry_of(source: &ProfileSource, counter: *mut u64) -> bool {
    SOURCE_CONNS
        .get_ptr_mut(source)
        .is_some_and(|now| core::ptr::eq(now, counter))
}

/// Takes `delta` slots of `source`'s count.
#[inline(always)]
pub fn take(source: &ProfileSource, delta: u64) -> Taken {
    for _ in 0..TRIES {
        let Some(counter) = map_access::get_or_insert(&SOURCE_CONNS, source, &0) else {
            return Taken::Full;
        };
        let before = atomics::load(counter);
        if before & SOURCE_RETIRED != 0
            || atomics::compare_exchange(counter, before, before + delta).is_err()
        {
            continue;
        }
        if is_entry_of(source, counter) {
            return Taken::Slots { counter, before };
        }
        // The element was deleted and reused for another source before the swap: the slots
        // went to that source's count, which they keep live until taken back.
        atomics::fetch_add(counter, delta.wrapping_neg());
    }
    Taken::Busy
}

/// Gives `delta` slots of `source`'s count back through `counter`, which holds them (from
/// [`take`] or a lookup); removes the entry if that took it to zero. False if the count held
/// fewer slots than that or stayed contended (it is left as it was; the sweeper repairs a
/// drifted count).
#[inline(always)]
pub fn give_back(source: &ProfileSource, counter: *mut u64, delta: u64) -> bool {
    for _ in 0..TRIES {
        let before = atomics::load(counter);
        if before & SOURCE_RETIRED != 0 || before < delta {
            return false;
        }
        if atomics::compare_exchange(counter, before, before - delta).is_ok() {
            if before == delta {
                retire(source, counter);
            }
            return true;
        }
    }
    false
}

/// Removes `source`'s entry through `counter` if it holds zero; whether it did. A take that
/// comes first makes the swap fail; one that comes after finds the entry retired.
#[inline(always)]
fn retire(source: &ProfileSource, counter: *mut u64) -> bool {
    if atomics::compare_exchange(counter, 0, SOURCE_RETIRED).is_err() {
        return false;
    }
    if !is_entry_of(source, counter) {
        // The element had been deleted and reused for another source at zero: give it back
        // as it was (a retired value never moves, so the swap back cannot fail).
        let _ = atomics::compare_exchange(counter, SOURCE_RETIRED, 0);
        return false;
    }
    let _ = SOURCE_CONNS.remove(source);
    true
}

/// `source`'s open connections as they stand (0 for none, or an entry being removed).
#[inline(always)]
pub fn current(source: &ProfileSource) -> u64 {
    match SOURCE_CONNS.get_ptr(source) {
        Some(counter) => {
            let count = atomics::load(counter);
            if count & SOURCE_RETIRED != 0 {
                0
            } else {
                count
            }
        }
        None => 0,
    }
}

/// Gives back `delta` slots of `source`'s count, looking its entry up (a flow's release, a
/// repair).
#[inline(always)]
pub fn release(source: &ProfileSource, delta: u64) -> bool {
    SOURCE_CONNS
        .get_ptr_mut(source)
        .is_some_and(|counter| give_back(source, counter, delta))
}

/// Removes `source`'s entry if it holds zero, for the agent's sweeper (an entry another
/// source's undo left at zero, or one from an agent before entries were removed in the
/// kernel). Exact where a read from user space and a delete after it would race a take.
#[inline(always)]
pub fn retire_idle(source: &ProfileSource) -> bool {
    SOURCE_CONNS
        .get_ptr_mut(source)
        .is_some_and(|counter| retire(source, counter))
}
