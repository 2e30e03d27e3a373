//! Intel AMX (Advanced Matrix Extensions): whether this process may use the tile
//! registers, and their configuration for the prefill kernels (`packed32/amx.rs`).
//!
//! AMX multiplies a tile of 16 rows of signed bytes by a tile of 16 columns of signed
//! bytes into 16 × 16 exact 32-bit integer sums in one instruction (`tdpbssd`). The
//! sums are the very integers the AVX-512 and AVX2 kernels compute, so the outputs keep
//! their bits; AMX only changes how fast a prefill gets them.
//!
//! Used when all of these hold: the AVX-512 kernels are in use (`AGENTSTACK_KERNELS`
//! unset; `avx512`, `avx2` or `scalar` turn AMX off), the CPU lists AMX-TILE and
//! AMX-INT8, the OS enables the tile state (XCR0 bits 17 and 18), and Linux grants this
//! process the tile data (`arch_prctl(ARCH_REQ_XCOMP_PERM)`): a VM may list AMX yet not
//! let a process use it. Rust's AMX intrinsics are not stable, so the tile
//! instructions are written as inline assembly.

/// Rows of a tile and activation rows per AMX product.
pub(super) const TILE_ROWS: usize = 16;

/// Whether the AMX kernels run in this process (checked once).
pub(super) fn available() -> bool {
    static AVAILABLE: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *AVAILABLE
        .get_or_init(|| !super::capped() && super::simd() == super::Simd::Avx512Vnni && granted())
}

#[cfg(all(target_arch = "x86_64", target_os = "linux"))]
#[expect(unsafe_code, reason = "cpuid, xgetbv and the arch_prctl system call")]
fn granted() -> bool {
    use std::arch::x86_64::{__cpuid_count, _xgetbv};
    /// `arch_prctl` request for a dynamically enabled XSAVE feature (asm/prctl.h).
    const ARCH_REQ_XCOMP_PERM: libc::c_long = 0x1023;
    /// The XSAVE feature number of AMX's tile data.
    const XFEATURE_XTILEDATA: libc::c_long = 18;
    let leaf7 = __cpuid_count(7, 0);
    let (tile, int8) = (leaf7.edx & (1 << 24) != 0, leaf7.edx & (1 << 25) != 0);
    let osxsave = __cpuid_count(1, 0).ecx & (1 << 27) != 0;
    if !(tile && int8 && osxsave) {
        return false;
    }
    #[target_feature(enable = "xsave")]
    unsafe fn xcr0() -> u64 {
        // SAFETY: OSXSAVE was checked, so xgetbv may run.
        unsafe { _xgetbv(0) }
    }
    // SAFETY: OSXSAVE was checked (the OS set CR4.OSXSAVE, so XSAVE is there).
    let xcr0 = unsafe { xcr0() };
    if xcr0 & (0b11 << 17) != 0b11 << 17 {
        return false;
    }
    // SAFETY: a system call with two integer arguments and no memory.
    unsafe {
        libc::syscall(
            libc::SYS_arch_prctl,
            ARCH_REQ_XCOMP_PERM,
            XFEATURE_XTILEDATA,
        ) == 0
    }
}

#[cfg(not(all(target_arch = "x86_64", target_os = "linux")))]
fn granted() -> bool {
    false
}

/// A tile configuration (`ldtilecfg`'s 64 bytes, palette 1): tile `i` has `rows[i]`
/// rows of `colsb[i]` bytes.
#[repr(C, align(64))]
pub(super) struct TileConfig {
    palette: u8,
    start_row: u8,
    reserved: [u8; 14],
    colsb: [u16; 16],
    rows: [u8; 16],
}

impl TileConfig {
    /// Tiles `(rows, bytes per row)`, tile 0 first.
    pub(super) fn new(tiles: &[(u8, u16)]) -> Self {
        let mut c = Self {
            palette: 1,
            start_row: 0,
            reserved: [0; 14],
            colsb: [0; 16],
            rows: [0; 16],
        };
        for (i, &(rows, colsb)) in tiles.iter().enumerate() {
            c.rows[i] = rows;
            c.colsb[i] = colsb;
        }
        c
    }
}

/// One product's sums into `c`: tile `T + 1` loaded from `a` (16 rows, `k` bytes apart),
/// tile `T + 2` from `w` (rows 64 bytes apart), tile `T` zeroed, `tdpbssd`, then tile `T`
/// stored at `c` (rows 64 bytes apart). `P` picks the tiles: 0 for 0–2, 1 for 3–5, so that
/// one product runs while the vector steps of the one before do.
///
/// # Safety
/// AMX must be [`available`] and the tiles configured (`ldtilecfg`) with tiles 0–2 and
/// 3–5 as the caller's products need them; `a`, `w` and `c` must hold what those shapes
/// read and write.
#[inline(always)]
#[expect(unsafe_code, reason = "AMX instructions as inline assembly")]
pub(super) unsafe fn tile_sums<const P: usize>(a: *const i8, k: usize, w: *const i8, c: *mut i32) {
    // SAFETY: as the function requires.
    unsafe {
        if P == 0 {
            std::arch::asm!(
                "tilezero tmm0",
                "tileloadd tmm1, [{a} + {k} * 1]",
                "tileloadd tmm2, [{w} + {s} * 1]",
                "tdpbssd tmm0, tmm1, tmm2",
                "tilestored [{c} + {s} * 1], tmm0",
                a = in(reg) a, k = in(reg) k, w = in(reg) w, s = in(reg) 64usize, c = in(reg) c,
                options(nostack),
            );
        } else {
            std::arch::asm!(
                "tilezero tmm3",
                "tileloadd tmm4, [{a} + {k} * 1]",
                "tileloadd tmm5, [{w} + {s} * 1]",
                "tdpbssd tmm3, tmm4, tmm5",
                "tilestored [{c} + {s} * 1], tmm3",
                a = in(reg) a, k = in(reg) k, w = in(reg) w, s = in(reg) 64usize, c = in(reg) c,
                options(nostack),
            );
        }
    }
}
