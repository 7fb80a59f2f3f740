//! The operator's exceptions to the per-source limits (`[[overrides]]`): a NAT gateway's
//! prefix given more connections, a known scanner's fewer. Looked up by the source key, so
//! every address a key covers gets the same limits (the agent refuses a prefix narrower than
//! the key's), and only while the tries hold entries (`Config::has_overrides`).

use aya_ebpf::maps::lpm_trie::Key;
use limiter_common::{SourceKey, SourceLimits, source::V4_MAPPED};

use crate::map_access::{OVERRIDES_V4, OVERRIDES_V6};

/// The most specific override covering `source`, if any.
#[inline(always)]
pub fn lookup(source: &SourceKey) -> Option<SourceLimits> {
    let a = &source.addr;
    if a[..12] == V4_MAPPED {
        OVERRIDES_V4
            .get(Key::new(32, [a[12], a[13], a[14], a[15]]))
            .copied()
    } else {
        OVERRIDES_V6.get(Key::new(128, *a)).copied()
    }
}
