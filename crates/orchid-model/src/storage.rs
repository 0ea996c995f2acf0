//! Immutable byte buffers shared without copies: a memory-mapped checkpoint shard or an
//! owned vector (for the few tensors that must be rearranged at load time).

use std::ops::Range;
use std::sync::Arc;

/// A cheap-to-clone view of immutable bytes.
#[derive(Clone)]
pub struct Bytes {
    src: Arc<dyn AsRef<[u8]> + Send + Sync>,
    start: usize,
    len: usize,
}

impl Bytes {
    /// Owned bytes, stored 8-byte aligned so that typed views of any element type work.
    pub fn from_vec(v: Vec<u8>) -> Bytes {
        let len = v.len();
        let mut words = vec![0u64; len.div_ceil(8)];
        bytemuck::cast_slice_mut::<u64, u8>(&mut words)[..len].copy_from_slice(&v);
        Bytes { src: Arc::new(Aligned { words, len }), start: 0, len }
    }

    pub fn from_shared(src: Arc<dyn AsRef<[u8]> + Send + Sync>, range: Range<usize>) -> Bytes {
        assert!(range.end <= (*src).as_ref().len() && range.start <= range.end);
        Bytes { src, start: range.start, len: range.end - range.start }
    }

    pub fn as_slice(&self) -> &[u8] {
        &(*self.src).as_ref()[self.start..self.start + self.len]
    }

    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// A sub-range of this view (no copy).
    pub fn slice(&self, range: Range<usize>) -> Bytes {
        assert!(range.end <= self.len && range.start <= range.end, "slice out of range");
        Bytes { src: self.src.clone(), start: self.start + range.start, len: range.end - range.start }
    }

    /// Reinterprets as a slice of `T` when aligned; otherwise copies into an aligned buffer.
    pub fn aligned<T: bytemuck::Pod>(&self) -> Bytes {
        let s = self.as_slice();
        if (s.as_ptr() as usize).is_multiple_of(std::mem::align_of::<T>()) { self.clone() } else { Bytes::from_vec(s.to_vec()) }
    }

    /// Typed view; panics if misaligned (call [`Bytes::aligned`] first when loading).
    pub fn typed<T: bytemuck::Pod>(&self) -> &[T] {
        bytemuck::cast_slice(self.as_slice())
    }
}

/// Bytes kept in u64 words (so every typed view is aligned).
struct Aligned {
    words: Vec<u64>,
    len: usize,
}

impl AsRef<[u8]> for Aligned {
    fn as_ref(&self) -> &[u8] {
        &bytemuck::cast_slice(&self.words)[..self.len]
    }
}

impl std::fmt::Debug for Bytes {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Bytes({} bytes)", self.len)
    }
}
