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
}

impl<T: Pod> Weights<T> {
    /// `len` zero values.
    pub(crate) fn zeroed(len: usize) -> Self {
        let len = len * size_of::<T>();
        if len == 0 {
            return Self::default();
        }
        if len >= MIN_LEN
            && let Some(backing) = mapped(len, huge_pages_on())
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
fn on_off_setting(value: Option<&str>) -> Option<bool> {
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
    Some(Backing::Mapped { map, start, len })
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
        }
    }

    #[inline(always)]
    fn bytes_mut(&mut self) -> &mut [u8] {
        match self {
            Self::Empty => &mut [],
            Self::Heap { v, start, len } => &mut v[*start..*start + *len],
            Self::Mapped { map, start, len } => &mut map[*start..*start + *len],
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
