//! A read-only mapping of a `BPF_F_MMAPABLE` array map. Reading a large array through its
//! mapping is one pass over memory, where a walk with lookups makes one syscall per slot (the
//! SYN bucket array has 131,072 slots by default).

use std::{mem::size_of, num::NonZeroUsize, os::fd::AsFd, ptr::NonNull};

use nix::sys::mman::{MapFlags, ProtFlags, mmap, munmap};

/// The array's values, mapped read-only while this lives. The programs keep writing them: a
/// value read here may be torn, which callers accept for what they read (counts to show).
pub struct MmapArray<T> {
    values: NonNull<T>,
    len: usize,
    bytes: NonZeroUsize,
}

impl<T: Copy> MmapArray<T> {
    /// Maps the `len` values of the array behind `fd`. The kernel lays them out at strides of
    /// their size rounded up to eight bytes, from the start of the mapping, so `T`'s size must
    /// be a multiple of eight.
    pub fn new(fd: impl AsFd, len: u32) -> Result<Self, nix::Error> {
        const { assert!(size_of::<T>().is_multiple_of(8) && size_of::<T>() > 0) };
        let len = len as usize;
        let Some(bytes) = NonZeroUsize::new(len * size_of::<T>()) else {
            return Err(nix::Error::EINVAL);
        };
        // SAFETY: a fresh shared read-only mapping of the map's fd at offset 0 (its values);
        // nothing else is placed at the address the kernel chooses.
        let values = unsafe {
            mmap(
                None,
                bytes,
                ProtFlags::PROT_READ,
                MapFlags::MAP_SHARED,
                fd,
                0,
            )?
        };
        Ok(Self {
            values: values.cast(),
            len,
            bytes,
        })
    }

    /// Every value, in slot order, each read once.
    pub fn iter(&self) -> impl Iterator<Item = T> + '_ {
        // SAFETY: every slot below `len` lies inside the mapping, aligned (the mapping is
        // page-aligned and the stride is `T`'s size); a volatile read, since the programs
        // write the values behind the compiler's back.
        (0..self.len).map(|i| unsafe { self.values.as_ptr().add(i).read_volatile() })
    }
}

impl<T> Drop for MmapArray<T> {
    fn drop(&mut self) {
        // SAFETY: the mapping made in `new`, unmapped once.
        if let Err(error) = unsafe { munmap(self.values.cast(), self.bytes.get()) } {
            tracing::warn!(%error, "unmapping a BPF array");
        }
    }
}
