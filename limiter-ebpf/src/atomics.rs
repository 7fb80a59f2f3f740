//! The atomic operations exact counters need (BPF CPU v3: fetch-add, fetch-or, cmpxchg).
//!
//! `core::sync::atomic` has no read-modify-write methods on the BPF target, so these wrap the
//! intrinsics. Every caller passes a pointer from a successful map lookup.

use core::intrinsics::{AtomicOrdering, atomic_cxchg, atomic_or, atomic_xadd};

/// Adds `delta` and returns the value before.
#[inline(always)]
pub fn fetch_add(ptr: *mut u64, delta: u64) -> u64 {
    // SAFETY: `ptr` points into a map value, valid for the program's run.
    unsafe { atomic_xadd::<u64, u64, { AtomicOrdering::SeqCst }>(ptr, delta) }
}

/// Subtracts one unless that would wrap below zero; returns whether it did.
///
/// A counter at zero while a flow is released means the counts drifted (the agent repairs
/// drift); wrapping it to `u64::MAX` would refuse its source forever instead.
#[inline(always)]
pub fn decrement(ptr: *mut u64) -> bool {
    let before = fetch_add(ptr, u64::MAX);
    if before == 0 {
        fetch_add(ptr, 1);
        return false;
    }
    true
}

#[inline(always)]
pub fn fetch_or(ptr: *mut u32, bits: u32) -> u32 {
    // SAFETY: as for `fetch_add`.
    unsafe { atomic_or::<u32, u32, { AtomicOrdering::SeqCst }>(ptr, bits) }
}

/// A single 64-bit read (aligned word loads are atomic; BPF before v4 has no load-acquire,
/// and the compare-and-swap that follows catches any value that moved meanwhile).
#[inline(always)]
pub fn load(ptr: *const u64) -> u64 {
    // SAFETY: as for `fetch_add`.
    unsafe { core::ptr::read_volatile(ptr) }
}

/// Replaces `current` with `new`; `Err` with the value found if it was not `current`.
#[inline(always)]
pub fn compare_exchange(ptr: *mut u64, current: u64, new: u64) -> Result<(), u64> {
    // SAFETY: as for `fetch_add`.
    let (found, swapped) = unsafe {
        atomic_cxchg::<u64, { AtomicOrdering::SeqCst }, { AtomicOrdering::SeqCst }>(
            ptr, current, new,
        )
    };
    if swapped { Ok(()) } else { Err(found) }
}

#[inline(always)]
pub fn fetch_and(ptr: *mut u32, bits: u32) -> u32 {
    // SAFETY: as for `fetch_add`.
    unsafe { core::intrinsics::atomic_and::<u32, u32, { AtomicOrdering::SeqCst }>(ptr, bits) }
}
