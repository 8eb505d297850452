//! What llama.cpp's CPU backend does to a matmul's activations before the dot products: each
//! weight type has a `vec_dot_type`, and the f32 activations are converted to it row by row
//! (ggml-cpu `type_traits_cpu`, `quantize_row_q8_0` / `quantize_row_q8_K`). Running a GGUF with
//! these numerics makes `spark-tool parity` predict llama.cpp's own figures for the same file
//! (docs/GGUF.md §6).

use half::{bf16, f16};

use super::GgmlType;

/// The activation encoding one weight type's dot product consumes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ActQuant {
    F32,
    F16,
    Bf16,
    /// 32-element blocks, `d = amax/127` stored as fp16, `q = round(x·127/amax)` (the AVX path
    /// rounds half to even). Q8_1, which Q4_1 consumes, holds the same values.
    Q8_0,
    /// 256-element blocks, `d = max/−127` in f32 (max = the signed value of largest magnitude),
    /// `q = min(127, round(x/d))` half to even.
    Q8K,
}

impl ActQuant {
    /// ggml's `vec_dot_type` of weights of type `t`.
    pub fn for_weights(t: GgmlType) -> Self {
        match t {
            GgmlType::F32 => ActQuant::F32,
            GgmlType::F16 => ActQuant::F16,
            GgmlType::BF16 => ActQuant::Bf16,
            GgmlType::Q4_0 | GgmlType::Q4_1 | GgmlType::Q5_0 | GgmlType::Q8_0 => ActQuant::Q8_0,
            GgmlType::Q4_K | GgmlType::Q5_K | GgmlType::Q6_K => ActQuant::Q8K,
        }
    }

    pub fn block(self) -> usize {
        match self {
            ActQuant::Q8_0 => 32,
            ActQuant::Q8K => 256,
            _ => 1,
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            ActQuant::F32 => "f32",
            ActQuant::F16 => "f16",
            ActQuant::Bf16 => "bf16",
            ActQuant::Q8_0 => "q8_0",
            ActQuant::Q8K => "q8_K",
        }
    }

    /// Replace `x` (whole rows; its length a multiple of [`Self::block`]) by the values the dot
    /// product sees.
    pub fn round(self, x: &mut [f32]) {
        match self {
            ActQuant::F32 => {}
            ActQuant::F16 => x.iter_mut().for_each(|v| *v = f16::from_f32(*v).to_f32()),
            ActQuant::Bf16 => x.iter_mut().for_each(|v| *v = bf16::from_f32(*v).to_f32()),
            ActQuant::Q8_0 => x.chunks_exact_mut(32).for_each(q8_0_block),
            ActQuant::Q8K => x.chunks_exact_mut(256).for_each(q8_k_block),
        }
    }
}

fn q8_0_block(b: &mut [f32]) {
    let amax = b.iter().fold(0f32, |m, v| m.max(v.abs()));
    let d = f16::from_f32(amax / 127.0).to_f32();
    let id = if amax != 0.0 { 127.0 / amax } else { 0.0 };
    for v in b {
        *v = d * (*v * id).round_ties_even();
    }
}

fn q8_k_block(b: &mut [f32]) {
    // The first element of largest magnitude, with its sign (ggml scans with a strict `>`).
    let (mut amax, mut max) = (0f32, 0f32);
    for &v in b.iter() {
        if v.abs() > amax {
            amax = v.abs();
            max = v;
        }
    }
    if amax == 0.0 {
        b.fill(0.0);
        return;
    }
    let iscale = -127.0 / max;
    let d = 1.0 / iscale;
    for v in b {
        *v = d * (iscale * *v).round_ties_even().min(127.0);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn q8_0_keeps_the_block_maximum_and_rounds_to_the_grid() {
        let mut x: Vec<f32> = (0..32).map(|i| (i as f32 - 10.0) * 0.37).collect();
        let amax = 21.0 * 0.37;
        ActQuant::Q8_0.round(&mut x);
        let d = f16::from_f32(amax / 127.0).to_f32();
        assert_eq!(x[31], d * 127.0);
        for v in &x {
            let q = v / d;
            assert!(
                (q - q.round()).abs() < 1e-4,
                "{v} is not on the grid of {d}"
            );
        }
    }

    #[test]
    fn q8_k_uses_the_signed_maximum() {
        // The largest magnitude is negative (first of two): iscale > 0, it maps to −127 and the
        // later +2.0 to +127.
        let mut x = vec![0.5f32; 256];
        x[3] = -2.0;
        x[200] = 2.0;
        ActQuant::Q8K.round(&mut x);
        let d = 2.0 / 127.0;
        assert!((x[3] + 2.0).abs() < 1e-6);
        assert!((x[200] - 2.0).abs() < 1e-6);
        assert!((x[0] - d * (0.5f32 / d).round_ties_even()).abs() < 1e-6);
        // Largest magnitude positive: iscale < 0, the signs flip in q and back in d.
        let mut y = vec![0f32; 256];
        y[0] = 1.0;
        y[1] = -1.0;
        y[2] = 0.3;
        ActQuant::Q8K.round(&mut y);
        assert_eq!(y[0], 1.0);
        assert!((y[1] + 1.0).abs() < 1e-6);
        assert!((y[2] - (38.0 / 127.0)).abs() < 1e-6);
    }

    #[test]
    fn zero_blocks_stay_zero_and_each_type_has_its_vec_dot_type() {
        let mut z = vec![0f32; 256];
        ActQuant::Q8K.round(&mut z);
        ActQuant::Q8_0.round(&mut z);
        assert!(z.iter().all(|v| *v == 0.0));
        assert_eq!(ActQuant::for_weights(GgmlType::Q4_K), ActQuant::Q8K);
        assert_eq!(ActQuant::for_weights(GgmlType::Q4_0), ActQuant::Q8_0);
        assert_eq!(ActQuant::for_weights(GgmlType::F32), ActQuant::F32);
    }
}
