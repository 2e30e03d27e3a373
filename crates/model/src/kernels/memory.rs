//! Memory for repacked weights.
//!
//! A repacked weight is written once at load and then streamed at every matmul, so its
//! bytes live in their own anonymous mapping, aligned to 2 MiB and advised as
//! transparent huge pages (`MADV_HUGEPAGE`, what the common
//! `transparent_hugepage=madvise` setting waits for): one TLB entry per 2 MiB instead
//! of per 4 KiB while a decode step streams every weight. The mapping is populated
//! before the weight is written (`MADV_POPULATE_WRITE`, on rayon's threads), so the
//! kernel allocates its pages in bulk instead of one page fault at a time (a 1B model
//! took 200k faults at load with ordinary pages). Small buffers, other systems or a
//! refused mapping get the heap; `AGENTSTACK_HUGE_PAGES=off` keeps the mapping but not
//! the advice; nothing but speed depends on which. (Huge pages cost more at load where
//! the OS must find and zero 2 MiB of fresh memory at a time: in a virtual machine
//! whose host backs guest memory lazily, first touches of memory the host has taken
//! back dominate load time.)

use std::marker::PhantomData;
use std::ops::{Deref, DerefMut};

use bytemuck::Pod;

use rayon::prelude::*;

/// The huge page size of x86-64 (and of aarch64 with 4 KiB pages).
const HUGE_PAGE: usize = 2 << 20;

/// A cache line.
const CACHE_LINE: usize = 64;

/// Buffers smaller than this stay on the heap.
const MIN_LEN: usize = HUGE_PAGE;

/// Zeroed values of a repacked weight (its quants, scales or minimums), from a 64-byte
/// boundary at least (so no 512-bit load of a kernel step straddles two cache lines; a
/// heap allocation is only 16-byte aligned).
pub(crate) struct Weights<T: Pod = u8>(Backing, PhantomData<T>);

impl<T: Pod> Default for Weights<T> {
    fn default() -> Self {
        Self(Backing::Empty, PhantomData)
    }
}

#[derive(Default)]
enum Backing {
    #[default]
    Empty,
    /// The bytes are `v[start..start + len]`, from a 64-byte boundary.
    Heap {
        v: Vec<u8>,
        start: usize,
        len: usize,
    },
    /// A mapping with room to align: the bytes are `map[start..start + len]`.
    #[cfg_attr(not(target_os = "linux"), expect(dead_code, reason = "Linux only"))]
    Mapped {
        map: memmap2::MmapMut,
        start: usize,
        len: usize,
    },
    /// A mapping of a range of a repack cache entry (`repack_cache.rs`): private when
    /// read from a finished entry (the page cache's pages, not copied), shared when the
    /// weight is packed straight into the entry being written (an [`Arena`]'s `id`,
    /// with the range's offset).
    File {
        map: memmap2::MmapMut,
        arena: u64,
        offset: u64,
    },
}

/// A file the weights packed on this thread go into while it is set
/// ([`Arena::packing`]): each array of at least [`MIN_LEN`] bytes gets the file's next
/// 2 MiB-aligned range, allocated on disk and mapped shared, so the packing writes the
/// repack cache's entry itself (one copy of the weights, in the page cache) instead of
/// anonymous memory that would then be copied to the file. Smaller arrays stay on the
/// heap.
pub(crate) struct Arena {
    file: std::fs::File,
    /// Unique in the process (from 1): which [`Backing::File`]s are this file's.
    id: u64,
    /// Where the next range may start.
    end: std::cell::Cell<u64>,
    /// Set once a range could not be had (a full disk): the rest go to memory.
    failed: std::cell::Cell<bool>,
}

thread_local! {
    /// The arena of the weight being packed on this thread, if any.
    static ARENA: std::cell::RefCell<Option<std::rc::Rc<Arena>>> =
        const { std::cell::RefCell::new(None) };
}

/// Arena ids; 0 is no arena (a finished entry's mappings).
static ARENAS: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(1);

impl Arena {
    /// An arena in `file` (open for reading and writing), its ranges from `start`.
    pub(crate) fn new(file: std::fs::File, start: u64) -> Self {
        Self {
            file,
            id: ARENAS.fetch_add(1, std::sync::atomic::Ordering::Relaxed),
            end: std::cell::Cell::new(start),
            failed: std::cell::Cell::new(false),
        }
    }

    /// Its id, as [`Weights::offset_in`] takes it.
    pub(crate) fn id(&self) -> u64 {
        self.id
    }

    /// The end of its last range.
    pub(crate) fn end(&self) -> u64 {
        self.end.get()
    }

    /// Runs `pack` with the large arrays it allocates on this thread in `arena`.
    pub(crate) fn packing<R>(arena: &std::rc::Rc<Self>, pack: impl FnOnce() -> R) -> R {
        /// Puts back the arena that was set (none, in practice), also on a panic.
        struct Restore(Option<std::rc::Rc<Arena>>);
        impl Drop for Restore {
            fn drop(&mut self) {
                let before = self.0.take();
                ARENA.with(|a| *a.borrow_mut() = before);
            }
        }
        let _restore = Restore(ARENA.with(|a| a.borrow_mut().replace(arena.clone())));
        pack()
    }

    /// A zeroed range of `len` bytes from the next 2 MiB boundary, mapped shared and
    /// populated (huge pages where the file system gives large folios); None once
    /// the file cannot grow.
    #[cfg(target_os = "linux")]
    fn range(&self, len: usize) -> Option<Backing> {
        if self.failed.get() {
            return None;
        }
        let offset = self.end.get().next_multiple_of(HUGE_PAGE as u64);
        let mapped = (|| -> std::io::Result<memmap2::MmapMut> {
            let ilen = i64::try_from(len).map_err(std::io::Error::other)?;
            let ioffset = i64::try_from(offset).map_err(std::io::Error::other)?;
            // Blocks allocated up front: page faults on a hole would allocate them one
            // page at a time (2-5x slower to fill here). A file system without
            // `fallocate` gets a hole.
            if nix::fcntl::fallocate(
                &self.file,
                nix::fcntl::FallocateFlags::empty(),
                ioffset,
                ilen,
            )
            .is_err()
            {
                let needed = offset + len as u64;
                if self.file.metadata()?.len() < needed {
                    self.file.set_len(needed)?;
                }
            }
            #[expect(
                unsafe_code,
                reason = "mapping the repack cache's entry being written, to pack into it"
            )]
            // SAFETY: the file is this load's own temporary file in the cache folder
            // (a random name, open by no one else) until it is renamed into place, and
            // after that others only read it or map it privately; nothing truncates it.
            // The range lies within the file, just allocated.
            let map = unsafe {
                memmap2::MmapOptions::new()
                    .offset(offset)
                    .len(len)
                    .map_mut(&self.file)?
            };
            Ok(map)
        })();
        match mapped {
            Ok(map) => {
                let _ = map.advise(memmap2::Advice::HugePage);
                let mut map = map;
                populate(&mut map, 0, len);
                self.end.set(offset + len as u64);
                Some(Backing::File {
                    map,
                    arena: self.id,
                    offset,
                })
            }
            Err(e) => {
                tracing::debug!(error = %e, "packing into memory: the repack cache's entry cannot grow");
                self.failed.set(true);
                None
            }
        }
    }

    #[cfg(not(target_os = "linux"))]
    fn range(&self, _: usize) -> Option<Backing> {
        None
    }
}

impl<T: Pod> Weights<T> {
    /// `len` zero values.
    pub(crate) fn zeroed(len: usize) -> Self {
        let len = len * size_of::<T>();
        if len == 0 {
            return Self::default();
        }
        if len >= MIN_LEN
            && let Some(backing) = ARENA
                .with(|a| a.borrow().as_ref().and_then(|a| a.range(len)))
                .or_else(|| mapped(len, huge_pages_on()))
        {
            return Self(backing, PhantomData);
        }
        let v = vec![0; len + CACHE_LINE - 1];
        let start = v.as_ptr().align_offset(CACHE_LINE).min(CACHE_LINE - 1);
        Self(Backing::Heap { v, start, len }, PhantomData)
    }

    /// Whether it is backed by a mapping advised as huge pages (the kernel may still
    /// give small ones).
    #[cfg(test)]
    fn is_mapped(&self) -> bool {
        matches!(self.0, Backing::Mapped { .. })
    }

    /// Its bytes, as stored in the repack cache.
    pub(crate) fn as_bytes(&self) -> &[u8] {
        self.0.bytes()
    }

    /// Where its bytes are in the file of arena `id`, if they were packed there.
    pub(crate) fn offset_in(&self, id: u64) -> Option<u64> {
        match self.0 {
            Backing::File { arena, offset, .. } if arena == id && id != 0 => Some(offset),
            _ => None,
        }
    }

    /// The same bytes as values of `U`, if they are a whole number of them (every
    /// backing starts on a 64-byte boundary).
    pub(crate) fn cast<U: Pod>(self) -> Option<Weights<U>> {
        (self.0.bytes().len().is_multiple_of(size_of::<U>()) && align_of::<U>() <= CACHE_LINE)
            .then_some(Weights(self.0, PhantomData))
    }
}

impl Weights<u8> {
    /// `len` bytes of `file` from `offset` (a multiple of 2 MiB when `len` is at least
    /// [`MIN_LEN`]): buffers that would get their own mapping map the file privately
    /// (the page cache's pages, no copy; huge ones where the file system keeps large
    /// folios); smaller ones are read onto the heap.
    pub(crate) fn from_file(
        file: &std::fs::File,
        offset: u64,
        len: usize,
    ) -> std::io::Result<Self> {
        use std::os::unix::fs::FileExt;
        if len == 0 {
            return Ok(Self::default());
        }
        if len >= MIN_LEN {
            if !offset.is_multiple_of(HUGE_PAGE as u64) {
                return Err(std::io::Error::other(format!(
                    "a weight of {len} bytes at offset {offset}, not on a 2 MiB boundary"
                )));
            }
            #[expect(
                unsafe_code,
                reason = "mapping the repack cache's file, as model files are"
            )]
            // SAFETY: a private mapping, read only by the kernels; its length is checked
            // against the file's by the caller. The cache replaces a file by renaming a new
            // one over it, never by writing into it, so the bytes under a mapping do not
            // change; a file truncated by someone else would fault on access, as a model
            // file mapped by any loader (llama.cpp, safetensors) would.
            let map = unsafe {
                memmap2::MmapOptions::new()
                    .offset(offset)
                    .len(len)
                    .map_copy(file)?
            };
            // Faulted in for reading, in one call: `MAP_POPULATE` on a writable private
            // mapping would fault for writing, copying every page.
            #[cfg(target_os = "linux")]
            let _ = map.advise(memmap2::Advice::PopulateRead);
            return Ok(Self(
                Backing::File {
                    map,
                    arena: 0,
                    offset,
                },
                PhantomData,
            ));
        }
        let mut w = Self::zeroed(len);
        file.read_exact_at(&mut w, offset)?;
        Ok(w)
    }
}

/// Whether weights go on huge pages: unless `AGENTSTACK_HUGE_PAGES` says off, read
/// once.
fn huge_pages_on() -> bool {
    static ON: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *ON.get_or_init(|| {
        env_switch(
            agentstack_static::env_vars::AGENTSTACK_HUGE_PAGES,
            "keeping huge pages on",
        )
    })
}

/// The on/off variable `name` (see [`on_off_setting`]); a value that is neither is
/// warned about, saying `unclear` (what happens instead), and taken as on.
pub(super) fn env_switch(name: &str, unclear: &str) -> bool {
    let value = std::env::var(name).ok();
    on_off_setting(value.as_deref()).unwrap_or_else(|| {
        tracing::warn!(
            value = value.as_deref().unwrap_or_default(),
            "{name} is not on/off (or 1/0, true/false): {unclear}"
        );
        true
    })
}

/// An on/off variable's meaning: on when unset or empty, None for a value that is
/// neither on nor off.
pub(crate) fn on_off_setting(value: Option<&str>) -> Option<bool> {
    match value.map(|v| v.trim().to_ascii_lowercase()).as_deref() {
        None | Some("" | "on" | "1" | "true" | "yes") => Some(true),
        Some("off" | "0" | "false" | "no") => Some(false),
        Some(_) => None,
    }
}

/// A fresh anonymous mapping (zeroed by the OS) of `len` bytes from a 2 MiB boundary,
/// advised as huge pages when `huge` (a kernel without them just ignores that), and
/// populated on rayon's threads: `MADV_POPULATE_WRITE` (Linux 5.14)
/// allocates and zeroes every page in the kernel, without a page fault per 4 KiB while
/// the weight is written; older kernels get the pages touched instead.
#[cfg(target_os = "linux")]
fn mapped(len: usize, huge: bool) -> Option<Backing> {
    let mut map = memmap2::MmapMut::map_anon(len.checked_add(HUGE_PAGE)?).ok()?;
    let start = (map.as_ptr() as usize).next_multiple_of(HUGE_PAGE) - map.as_ptr() as usize;
    if huge {
        // Without transparent huge pages the advice fails: ordinary pages serve as well.
        let _ = map.advise_range(memmap2::Advice::HugePage, start, map.len() - start);
    }
    populate(&mut map, start, len);
    Some(Backing::Mapped { map, start, len })
}

/// Allocates the pages of `map[start..start + len]` on rayon's threads:
/// `MADV_POPULATE_WRITE` (Linux 5.14) in the kernel, without a page fault per 4 KiB
/// while the weight is written; older kernels get the pages touched instead.
#[cfg(target_os = "linux")]
fn populate(map: &mut memmap2::MmapMut, start: usize, len: usize) {
    // Chunks of 32 MiB: few enough calls, and enough of them to share among threads.
    const CHUNK: usize = 16 * HUGE_PAGE;
    let populated = (0..len.div_ceil(CHUNK)).into_par_iter().all(|c| {
        let at = start + c * CHUNK;
        map.advise_range(
            memmap2::Advice::PopulateWrite,
            at,
            CHUNK.min(start + len - at),
        )
        .is_ok()
    });
    if !populated {
        map[start..start + len]
            .par_chunks_mut(4096)
            .for_each(|page| page[0] = 0);
    }
}

#[cfg(not(target_os = "linux"))]
fn mapped(_: usize, _: bool) -> Option<Backing> {
    None
}

impl Backing {
    #[inline(always)]
    fn bytes(&self) -> &[u8] {
        match self {
            Self::Empty => &[],
            Self::Heap { v, start, len } => &v[*start..*start + *len],
            Self::Mapped { map, start, len } => &map[*start..*start + *len],
            Self::File { map, .. } => map,
        }
    }

    #[inline(always)]
    fn bytes_mut(&mut self) -> &mut [u8] {
        match self {
            Self::Empty => &mut [],
            Self::Heap { v, start, len } => &mut v[*start..*start + *len],
            Self::Mapped { map, start, len } => &mut map[*start..*start + *len],
            Self::File { map, .. } => map,
        }
    }
}

// The bytes start on a 64-byte boundary and hold a whole number of values, so the casts
// cannot fail for any plain type of alignment up to 64.
impl<T: Pod> Deref for Weights<T> {
    type Target = [T];

    // Kernels take slices of the weights for every block: a call each would cost more
    // than the slicing (it did: 12-15% of a SmolLM2 prefill).
    #[inline(always)]
    fn deref(&self) -> &[T] {
        match self.0 {
            // An empty byte slice's dangling pointer is not aligned for `T`.
            Backing::Empty => &[],
            _ => bytemuck::cast_slice(self.0.bytes()),
        }
    }
}

impl<T: Pod> DerefMut for Weights<T> {
    #[inline(always)]
    fn deref_mut(&mut self) -> &mut [T] {
        match self.0 {
            Backing::Empty => &mut [],
            _ => bytemuck::cast_slice_mut(self.0.bytes_mut()),
        }
    }
}

impl<T: Pod> std::fmt::Debug for Weights<T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Weights({} values)", self.len())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_setting_reads_on_and_off_and_refuses_the_rest() {
        for v in [
            None,
            Some(""),
            Some("on"),
            Some("1"),
            Some("TRUE"),
            Some(" yes "),
        ] {
            assert_eq!(on_off_setting(v), Some(true), "{v:?}");
        }
        for v in ["off", "0", "False", "no"] {
            assert_eq!(on_off_setting(Some(v)), Some(false), "{v}");
        }
        assert_eq!(on_off_setting(Some("sometimes")), None);
    }

    #[test]
    fn values_of_any_plain_type_are_zeroed_and_aligned() {
        assert!(Weights::<f32>::default().is_empty());
        assert!(Weights::<f32>::default().iter_mut().next().is_none());
        for len in [0, 3, MIN_LEN / 4 + 1] {
            let mut d = Weights::<f32>::zeroed(len);
            assert_eq!(d.len(), len);
            assert!(d.iter().all(|&x| x == 0.0));
            d.iter_mut().enumerate().for_each(|(i, x)| *x = i as f32);
            assert_eq!(d.last().copied(), len.checked_sub(1).map(|i| i as f32));
            assert!(len == 0 || (d.as_ptr() as usize).is_multiple_of(CACHE_LINE));
            let h = Weights::<half::f16>::zeroed(len);
            assert!(h.iter().all(|x| x.to_f32() == 0.0) && h.len() == len);
        }
    }

    #[test]
    fn buffers_are_zeroed_writable_and_aligned_when_mapped() {
        for len in [0, 1, 1000, MIN_LEN - 1, MIN_LEN, 3 * HUGE_PAGE + 12_345] {
            let mut b = Weights::<u8>::zeroed(len);
            assert_eq!(b.len(), len);
            assert!(b.iter().all(|&x| x == 0), "{len}");
            if let Some(last) = b.last_mut() {
                *last = 7;
            }
            assert_eq!(
                b.iter().map(|&x| usize::from(x)).sum::<usize>(),
                7 * usize::from(len > 0)
            );
            if len > 0 {
                assert_eq!(b.as_ptr() as usize % CACHE_LINE, 0, "{len}");
            }
            if b.is_mapped() {
                assert_eq!(b.as_ptr() as usize % HUGE_PAGE, 0);
            }
        }
        // A large buffer gets its own mapping, with or without huge pages.
        #[cfg(target_os = "linux")]
        assert!(Weights::<u8>::zeroed(MIN_LEN).is_mapped());
        #[cfg(target_os = "linux")]
        {
            let len = 2 * HUGE_PAGE + 100;
            let mut b = Weights::<u8>(
                mapped(len, false).expect("an ordinary mapping"),
                PhantomData,
            );
            assert_eq!((b.len(), b.as_ptr() as usize % HUGE_PAGE), (len, 0));
            assert!(b.iter().all(|&x| x == 0));
            b[len - 1] = 1;
        }
    }
}
