//! Each source's count of open connections in `SOURCE_CONNS`, whose entry exists only while
//! the count is above zero: a flood of sources that each connected once, or a table fail-
//! closed, must not fill up with sources that hold nothing.
//!
//! The last slot given back removes the entry without losing a slot taken at the same moment
//! on another CPU: the entry is first retired, by compare-and-swap from 0 to
//! [`SOURCE_RETIRED`], and only then deleted. A taker that finds it retired leaves it (its
//! remover deletes it) and takes its slot in a fresh entry. The map is allocated on demand
//! (`BPF_F_NO_PREALLOC`), so a deleted entry's memory is not reused while a program that
//! looked it up still runs: a late add to a retired entry lands in dead memory, never in
//! another source's count.

use limiter_common::{SOURCE_RETIRED, SourceKey};

use crate::{
    atomics,
    maps::{self, SOURCE_CONNS},
};

/// Takes `delta` slots of `source`'s count; returns the counter and its count before, or
/// `None` if the table has no room (or a retired entry outlasted every try).
#[inline(always)]
pub fn take(source: &SourceKey, delta: u64) -> Option<(*mut u64, u64)> {
    for _ in 0..4 {
        let counter = maps::get_or_insert(&SOURCE_CONNS, source, &0)?;
        let before = atomics::fetch_add(counter, delta);
        if before & SOURCE_RETIRED == 0 {
            return Some((counter, before));
        }
    }
    None
}

/// Gives `delta` slots of `source`'s count back through `counter` (from [`take`] or a
/// lookup); removes the entry if that took it to zero. False if the count held fewer slots
/// than that (it is left as it was).
#[inline(always)]
pub fn give_back(source: &SourceKey, counter: *mut u64, delta: u64) -> bool {
    let before = atomics::fetch_add(counter, delta.wrapping_neg());
    if before & SOURCE_RETIRED != 0 || before < delta {
        atomics::fetch_add(counter, delta);
        return false;
    }
    if before == delta && atomics::compare_exchange(counter, 0, SOURCE_RETIRED).is_ok() {
        let _ = SOURCE_CONNS.remove(source);
    }
    true
}

/// `source`'s open connections as they stand (0 for none, or an entry being removed).
#[inline(always)]
pub fn current(source: &SourceKey) -> u64 {
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
pub fn release(source: &SourceKey, delta: u64) -> bool {
    SOURCE_CONNS
        .get_ptr_mut(source)
        .is_some_and(|counter| give_back(source, counter, delta))
}
