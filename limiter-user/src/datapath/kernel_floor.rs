//! The oldest kernel the programs run on, checked before anything is loaded, so an old kernel
//! gets one sentence saying why instead of a verifier log.
//!
//! What sets the floor (the newest requirement wins):
//! - BPF atomic fetch-add and compare-and-swap (`BPF_ATOMIC` with `BPF_FETCH`/`BPF_CMPXCHG`,
//!   BPF CPU v3), which make the counters exact: 5.12.
//! - `bpf_ktime_get_boot_ns` (flows and bans on `CLOCK_BOOTTIME`) and the BPF ring buffer
//!   (the kernel log): 5.8. XDP through a BPF link, which is what gets pinned: 5.9.
//!   `bpf_ktime_get_coarse_ns` (the SYN-rate buckets' clock): 5.11.
//! - BTF, LPM tries, LRU hashes, per-CPU arrays, clsact with cls_bpf: all older.
//!
//! 5.12 to 5.14 were short-lived releases nobody ships any more, so the floor is 5.15, the
//! oldest long-term release with everything above. TC attaches through TCX from 6.6 and through
//! a netlink filter before (`tc_legacy`): that is the only difference between kernels, and it
//! changes nothing the programs enforce.

use thiserror::Error;

/// The oldest supported kernel, as (major, minor).
pub const MINIMUM: (u32, u32) = (5, 15);

/// Why [`MINIMUM`] is what it is, in the words the refusal uses.
pub const REASON: &str = "the kernel programs need BPF atomic fetch-add and compare-and-swap \
    (5.12), bpf_ktime_get_coarse_ns (5.11), bpf_ktime_get_boot_ns and the BPF ring buffer \
    (5.8), XDP BPF links (5.9) and BTF; \
    5.15 is the oldest long-term release with all of them";

#[derive(Debug, Error, PartialEq, Eq)]
pub enum KernelError {
    #[error(
        "Linux {major}.{minor} is too old: limiter needs {}.{} or newer, because {REASON}",
        MINIMUM.0,
        MINIMUM.1
    )]
    TooOld { major: u32, minor: u32 },
    #[error("cannot read the kernel version from the release {0:?}")]
    Unparsable(String),
}

/// The (major, minor) of a kernel release as `uname -r` prints it: `6.1.0-47-cloud-amd64`,
/// `5.15.0-91-generic`, `6.18.44-fc-v782`.
pub fn parse_release(release: &str) -> Result<(u32, u32), KernelError> {
    let bad = || KernelError::Unparsable(release.to_string());
    let mut numbers = release.split(|c: char| !c.is_ascii_digit());
    let major = numbers
        .next()
        .and_then(|n| n.parse().ok())
        .ok_or_else(bad)?;
    let minor = numbers
        .next()
        .and_then(|n| n.parse().ok())
        .ok_or_else(bad)?;
    Ok((major, minor))
}

/// Accepts `release` if it is [`MINIMUM`] or newer.
pub fn check_release(release: &str) -> Result<(u32, u32), KernelError> {
    let (major, minor) = parse_release(release)?;
    if (major, minor) < MINIMUM {
        return Err(KernelError::TooOld { major, minor });
    }
    Ok((major, minor))
}

/// The running kernel's release (`uname -r`).
pub fn running_release() -> String {
    nix::sys::utsname::uname()
        .map(|u| u.release().to_string_lossy().into_owned())
        .unwrap_or_default()
}

/// Accepts the running kernel if it is [`MINIMUM`] or newer.
pub fn check_running() -> Result<(u32, u32), KernelError> {
    check_release(&running_release())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn releases_parse_as_distributions_print_them() {
        assert_eq!(parse_release("6.1.0-47-cloud-amd64"), Ok((6, 1)));
        assert_eq!(parse_release("5.15.0-91-generic"), Ok((5, 15)));
        assert_eq!(parse_release("6.18.44-fc-v782"), Ok((6, 18)));
        assert_eq!(parse_release("6.12"), Ok((6, 12)));
        assert_eq!(parse_release("6.6.0+"), Ok((6, 6)));
        assert!(parse_release("").is_err());
        assert!(parse_release("linux").is_err());
        assert!(parse_release("6").is_err());
    }

    #[test]
    fn kernels_older_than_the_floor_are_refused_with_the_reason() {
        assert!(check_release("5.15.0-91-generic").is_ok());
        assert!(check_release("6.1.0-47-cloud-amd64").is_ok());
        assert!(check_release("10.0.1").is_ok());
        let refusal = check_release("5.10.0-30-amd64").unwrap_err();
        assert_eq!(
            refusal,
            KernelError::TooOld {
                major: 5,
                minor: 10
            }
        );
        let text = refusal.to_string();
        assert!(text.contains("5.15 or newer"), "{text}");
        assert!(text.contains("compare-and-swap"), "{text}");
        assert!(check_release("4.19.0").is_err());
    }
}
