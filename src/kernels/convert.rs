//! Bulk conversion of little-endian 16/32-bit floats to f32.
//!
//! Written over byte slices because safetensors only guarantees alignment to
//! the 8-byte data start, not to what a `&[u16]` cast would need.

use half::f16;
use rayon::prelude::*;

/// Elements per parallel chunk; small tensors stay on the calling thread.
const CHUNK: usize = 1 << 16;

fn convert<const N: usize>(bytes: &[u8], out: &mut [f32], f: impl Fn([u8; N]) -> f32 + Sync) {
    debug_assert_eq!(bytes.len(), out.len() * N);
    let run = |(src, dst): (&[u8], &mut [f32])| {
        for (b, o) in src.chunks_exact(N).zip(dst.iter_mut()) {
            let mut a = [0u8; N];
            a.copy_from_slice(b);
            *o = f(a);
        }
    };
    if out.len() <= CHUNK {
        run((bytes, out));
    } else {
        bytes
            .par_chunks(CHUNK * N)
            .zip(out.par_chunks_mut(CHUNK))
            .for_each(run);
    }
}

/// bf16 is the top half of an f32, so widening is exact.
pub fn bf16_bytes_to_f32(bytes: &[u8], out: &mut [f32]) {
    convert::<2>(bytes, out, |b| {
        f32::from_bits((u16::from_le_bytes(b) as u32) << 16)
    });
}

pub fn f16_bytes_to_f32(bytes: &[u8], out: &mut [f32]) {
    convert::<2>(bytes, out, |b| {
        f16::from_bits(u16::from_le_bytes(b)).to_f32()
    });
}

pub fn f32_bytes_to_f32(bytes: &[u8], out: &mut [f32]) {
    convert::<4>(bytes, out, f32::from_le_bytes);
}

/// `half::bf16::from_f32(x).to_bits()`: round to nearest even on the bit pattern, NaN made
/// quiet; branch-free, so loops over it vectorise.
#[inline(always)]
pub fn bf16_bits(x: f32) -> u16 {
    (rounded_bits(x.to_bits()) >> 16) as u16
}

/// The f32 bits of `bits` rounded to bf16 (low half zero): the arithmetic of [`bf16_bits`].
#[inline(always)]
fn rounded_bits(bits: u32) -> u32 {
    let rounded = bits.wrapping_add(0x7FFF + ((bits >> 16) & 1)) & 0xFFFF_0000;
    let quiet = (bits | 0x0040_0000) & 0xFFFF_0000;
    let nan = bits & 0x7FFF_FFFF > 0x7F80_0000;
    if nan {
        quiet
    } else {
        rounded
    }
}

/// `half::bf16::from_f32(v).to_f32()` for every value, in place: round to nearest even on the
/// bit pattern, NaN made quiet. Branch-free so that it vectorises (half's conversion does not;
/// over a prefill's activations it was 12 % of the time), and spread over threads for long
/// slices.
pub fn round_bf16_in_place(x: &mut [f32]) {
    let run = |x: &mut [f32]| {
        for v in x.iter_mut() {
            *v = f32::from_bits(rounded_bits(v.to_bits()));
        }
    };
    if x.len() <= CHUNK {
        run(x);
    } else {
        x.par_chunks_mut(CHUNK).for_each(run);
    }
}

/// An element of stored keys and values: f32, or bf16 (a model whose keys and values are bf16
/// values already stores them in half the bytes; docs/MODEL.md §8). Sealed: the attention
/// kernels read 16 of them by their size, which only these two types promise.
pub trait KvElem: sealed::Sealed + Copy + Default + Send + Sync + 'static {
    /// Whether this is `bf16` (the AVX-512 kernel widens 16 of them by a shift).
    const BF16: bool;
    /// `x` (f32 or already stored) as this type: exact, or for an f32 stored as bf16 rounded to
    /// nearest even by [`bf16_bits`] (exact for a bf16 value).
    fn store<S: KvElem>(x: S) -> Self;
    /// The value (exact).
    fn widen(self) -> f32;
    /// The bits of the value rounded to bf16 (exact for a bf16 value).
    fn bf16_bits(self) -> u16;
}

mod sealed {
    pub trait Sealed {}
    impl Sealed for f32 {}
    impl Sealed for half::bf16 {}
}

impl KvElem for f32 {
    const BF16: bool = false;
    #[inline(always)]
    fn store<S: KvElem>(x: S) -> Self {
        x.widen()
    }
    #[inline(always)]
    fn widen(self) -> f32 {
        self
    }
    #[inline(always)]
    fn bf16_bits(self) -> u16 {
        bf16_bits(self)
    }
}

impl KvElem for half::bf16 {
    const BF16: bool = true;
    #[inline(always)]
    fn store<S: KvElem>(x: S) -> Self {
        half::bf16::from_bits(x.bf16_bits())
    }
    #[inline(always)]
    fn widen(self) -> f32 {
        super::bf16::widen(self.to_bits())
    }
    #[inline(always)]
    fn bf16_bits(self) -> u16 {
        self.to_bits()
    }
}

/// `x` stored as `T` ([`KvElem::store`]), spread over threads for long slices.
pub fn stored<T: KvElem>(x: &[f32]) -> Vec<T> {
    if x.len() <= CHUNK {
        x.iter().map(|&x| T::store(x)).collect()
    } else {
        x.par_iter().map(|&x| T::store(x)).collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bf16_rounding_in_place_is_halfs() {
        // A stride through every bit pattern, plus ties (both parities), the overflow edge,
        // infinities, NaNs with and without payload in the kept half, subnormals.
        let mut bits: Vec<u32> = (0..=u32::MAX).step_by(65_521).collect();
        bits.extend([
            0x3F80_8000,
            0x3F81_8000,
            0xBF80_8000,
            0x7F7F_FFFF,
            0x7F7F_8000,
            0x7F80_0000,
            0xFF80_0000,
            0x7F80_0001,
            0x7FC0_0000,
            0xFFFF_FFFF,
            0x0000_8000,
            0x0001_8000,
            0x8000_0001,
            0,
        ]);
        let mut x: Vec<f32> = bits.iter().map(|b| f32::from_bits(*b)).collect();
        let want: Vec<u32> = x
            .iter()
            .map(|v| half::bf16::from_f32(*v).to_f32().to_bits())
            .collect();
        round_bf16_in_place(&mut x);
        for ((b, w), g) in bits.iter().zip(&want).zip(&x) {
            assert_eq!(g.to_bits(), *w, "bits {b:#010x}");
        }
    }

    #[test]
    fn widening_is_exact() {
        let vals = [0.0f32, -1.5, 3.140625, 65504.0, -2.0e-3];
        let bf: Vec<u8> = vals
            .iter()
            .flat_map(|v| half::bf16::from_f32(*v).to_bits().to_le_bytes())
            .collect();
        let hf: Vec<u8> = vals
            .iter()
            .flat_map(|v| f16::from_f32(*v).to_bits().to_le_bytes())
            .collect();
        let mut a = vec![0f32; vals.len()];
        bf16_bytes_to_f32(&bf, &mut a);
        for (x, v) in a.iter().zip(vals) {
            assert_eq!(*x, half::bf16::from_f32(v).to_f32());
        }
        f16_bytes_to_f32(&hf, &mut a);
        for (x, v) in a.iter().zip(vals) {
            assert_eq!(*x, f16::from_f32(v).to_f32());
        }
    }

    #[test]
    fn parallel_path_matches_serial() {
        let n = CHUNK * 3 + 17;
        let bytes: Vec<u8> = (0..n)
            .flat_map(|i| (i as f32 * 0.5).to_le_bytes())
            .collect();
        let mut out = vec![0f32; n];
        f32_bytes_to_f32(&bytes, &mut out);
        assert!(out.iter().enumerate().all(|(i, v)| *v == i as f32 * 0.5));
    }
}
