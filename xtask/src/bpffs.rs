//! The BPF filesystem as the privileged tests find it and leave it. The agents under test mount
//! it when the machine has none; once they are gone, that mount holds only the kernel's own
//! entries, so it is taken down again and the machine is left as it was found.

const BPFFS: &str = "/sys/fs/bpf";

/// Restores the BPF filesystem's absence when dropped, if it was absent when made: wrap every
/// run of the privileged tests on this machine in one, so a failed run cleans up too.
pub struct Restore {
    was_mounted: bool,
}

impl Restore {
    pub fn new() -> Restore {
        Restore {
            was_mounted: mounted(),
        }
    }
}

impl Drop for Restore {
    fn drop(&mut self) {
        if !self.was_mounted {
            unmount_if_empty();
        }
    }
}

fn mounted() -> bool {
    std::fs::read_to_string("/proc/mounts").is_ok_and(|mounts| {
        mounts
            .lines()
            .any(|l| l.split_whitespace().nth(1) == Some(BPFFS))
    })
}

fn unmount_if_empty() {
    if !mounted() {
        return;
    }
    let left: Vec<String> = std::fs::read_dir(BPFFS)
        .map(|d| {
            d.filter_map(std::result::Result::ok)
                .map(|e| e.file_name().to_string_lossy().into_owned())
                .collect()
        })
        .unwrap_or_default();
    // `maps.debug` and `progs.debug` are the kernel's own iterators, made at mount time.
    if left
        .iter()
        .all(|name| name == "maps.debug" || name == "progs.debug")
    {
        let path = std::ffi::CString::new(BPFFS).expect("no NUL in the path");
        // SAFETY: a valid C string; umount has no other preconditions.
        if unsafe { libc::umount(path.as_ptr()) } != 0 {
            eprintln!(
                "could not unmount {BPFFS}: {}",
                std::io::Error::last_os_error()
            );
        }
    } else {
        eprintln!("{BPFFS} still holds pins the tests did not remove: {left:?}");
    }
}
