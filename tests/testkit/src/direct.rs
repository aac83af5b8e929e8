//! O_DIRECT I/O: bypasses the page cache so a write really travels to the NBD server.

use std::fs::{File, OpenOptions};
use std::io;
use std::os::unix::fs::{FileExt, OpenOptionsExt};
use std::path::Path;

/// Alignment that satisfies O_DIRECT on any logical block size up to the page size.
pub const ALIGN: usize = 4096;

/// A heap buffer whose start is aligned for O_DIRECT.
#[derive(Debug)]
pub struct AlignedBuf {
    storage: Vec<u8>,
    offset: usize,
    len: usize,
}

impl AlignedBuf {
    pub fn zeroed(len: usize) -> Self {
        let storage = vec![0u8; len + ALIGN];
        let offset = storage.as_ptr().align_offset(ALIGN);
        Self {
            storage,
            offset,
            len,
        }
    }

    pub fn from_slice(data: &[u8]) -> Self {
        let mut buf = Self::zeroed(data.len());
        buf.as_mut().copy_from_slice(data);
        buf
    }
}

impl AsRef<[u8]> for AlignedBuf {
    fn as_ref(&self) -> &[u8] {
        &self.storage[self.offset..self.offset + self.len]
    }
}

impl AsMut<[u8]> for AlignedBuf {
    fn as_mut(&mut self) -> &mut [u8] {
        &mut self.storage[self.offset..self.offset + self.len]
    }
}

/// Deterministic, position-dependent bytes: a block written to the wrong offset, or not at
/// all, reads back differently.
pub fn pattern(seed: u64, offset: u64, len: usize) -> Vec<u8> {
    (0..len as u64)
        .map(|i| {
            let x = (offset + i)
                .wrapping_mul(0x9e37_79b9_7f4a_7c15)
                .wrapping_add(seed.wrapping_mul(0xff51_afd7_ed55_8ccd));
            // Truncation wanted: the top byte mixed with one from the middle.
            #[allow(clippy::cast_possible_truncation)]
            let byte = (x >> 56) as u8 ^ (x >> 24) as u8;
            byte
        })
        .collect()
}

/// A block device or file opened with O_DIRECT.
#[derive(Debug)]
pub struct DirectFile(File);

impl DirectFile {
    pub fn open(path: &Path, write: bool) -> io::Result<Self> {
        OpenOptions::new()
            .read(true)
            .write(write)
            .custom_flags(libc::O_DIRECT)
            .open(path)
            .map(Self)
    }

    pub fn write_at(&self, data: &[u8], offset: u64) -> io::Result<()> {
        let buf = AlignedBuf::from_slice(data);
        self.0.write_all_at(buf.as_ref(), offset)
    }

    pub fn read_at(&self, len: usize, offset: u64) -> io::Result<Vec<u8>> {
        let mut buf = AlignedBuf::zeroed(len);
        self.0.read_exact_at(buf.as_mut(), offset)?;
        Ok(buf.as_ref().to_vec())
    }

    pub fn sync(&self) -> io::Result<()> {
        self.0.sync_all()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn aligned_and_pattern_differs_by_offset() {
        let b = AlignedBuf::zeroed(8192);
        assert_eq!(b.as_ref().as_ptr() as usize % ALIGN, 0);
        assert_eq!(b.as_ref().len(), 8192);
        assert_ne!(pattern(1, 0, 512), pattern(1, 512, 512));
        assert_ne!(pattern(1, 0, 512), pattern(2, 0, 512));
        assert_eq!(pattern(3, 4096, 64), pattern(3, 4096, 64));
    }
}
