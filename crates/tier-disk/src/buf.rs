//! Page-aligned scratch buffers for `O_DIRECT` I/O.

use std::ops::{Deref, DerefMut};

use memmap2::MmapMut;

/// A zero-initialised, page-aligned buffer (an anonymous mapping), so it is a valid `O_DIRECT`
/// source or destination.
pub struct AlignedBuf {
    map: MmapMut,
}

impl AlignedBuf {
    /// A zeroed buffer of `len` bytes (at least one byte is mapped).
    ///
    /// # Errors
    /// The mapping failed (out of memory or address space).
    pub fn zeroed(len: usize) -> std::io::Result<Self> {
        Ok(Self {
            map: MmapMut::map_anon(len.max(1))?,
        })
    }
}

impl Deref for AlignedBuf {
    type Target = [u8];

    fn deref(&self) -> &[u8] {
        &self.map
    }
}

impl DerefMut for AlignedBuf {
    fn deref_mut(&mut self) -> &mut [u8] {
        &mut self.map
    }
}

impl std::fmt::Debug for AlignedBuf {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "AlignedBuf({} bytes)", self.map.len())
    }
}
