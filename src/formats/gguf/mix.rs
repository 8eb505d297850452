//! Which GGML type each Spark tensor gets in a GGUF file: llama.cpp's own per-tensor rule for the
//! file types we write (docs/GGUF.md §3), so our file and `llama-quantize`'s hold the same types
//! and differ only in how the codes were chosen.

use super::GgmlType;

/// A GGUF file type (llama.cpp's `ftype`), i.e. a rule giving every tensor its type.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum FileType {
    /// Q4_0 everywhere; the head (tied embedding) Q6_K.
    Q4_0,
    /// Q4_K, with Q6_K for the head and for `attn_qkv` / `ffn_down` in the layers llama.cpp
    /// gives more bits.
    #[serde(rename = "q4_k_m", alias = "q4_km")]
    Q4KM,
    /// Q5_K, with Q6_K where Q4_K_M has it and for `attn_qkv` / `ffn_down` likewise.
    #[serde(rename = "q5_k_m", alias = "q5_km")]
    Q5KM,
    /// Q8_0 everywhere, the head included.
    Q8_0,
}

/// The weight tensors of a Spark GGUF whose type the rule decides (norms are always F32).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Tensor {
    /// `output.weight`, or `token_embd.weight` when the head is tied to it.
    Head,
    /// `token_embd.weight` of an untied model.
    Embedding,
    /// `blk.{layer}.attn_qkv`.
    AttnQkv { layer: usize },
    /// `blk.{layer}.ffn_down`.
    FfnDown { layer: usize },
    /// Every other 2-D weight of a layer (attn_gate, attn_output, ffn_gate, ffn_up).
    Other,
}

impl FileType {
    /// Whether the solve may give this type's blocks negative scales: Q4_0 and Q8_0 store one
    /// signed fp16 `d` per block and llama.cpp multiplies by it as stored (its own Q4_0
    /// quantizer makes `d` negative whenever a block's largest magnitude is positive). Q4_K_M's
    /// sub-block scales are unsigned.
    pub fn signed_scales(self) -> bool {
        matches!(self, FileType::Q4_0 | FileType::Q8_0)
    }

    /// llama.cpp's `general.file_type` value (`LLAMA_FTYPE_MOSTLY_*`).
    pub fn id(self) -> u32 {
        match self {
            FileType::Q4_0 => 2,
            FileType::Q8_0 => 7,
            FileType::Q4KM => 15,
            FileType::Q5KM => 17,
        }
    }

    /// The name `llama-quantize` takes for it.
    pub fn llama_name(self) -> &'static str {
        match self {
            FileType::Q4_0 => "Q4_0",
            FileType::Q4KM => "Q4_K_M",
            FileType::Q5KM => "Q5_K_M",
            FileType::Q8_0 => "Q8_0",
        }
    }

    fn base(self) -> GgmlType {
        match self {
            FileType::Q4_0 => GgmlType::Q4_0,
            FileType::Q4KM => GgmlType::Q4_K,
            FileType::Q5KM => GgmlType::Q5_K,
            FileType::Q8_0 => GgmlType::Q8_0,
        }
    }

    /// The type of `tensor` in a model of `layers` layers (llama.cpp `llama_tensor_get_type_impl`
    /// without an imatrix, for these three file types) when its rows fit every block; see
    /// [`GgmlType::fitting`] for rows that do not.
    pub fn rule(self, tensor: Tensor, layers: usize) -> GgmlType {
        // llama.cpp's use_more_bits: the first and last eighth, and every third layer between.
        let more_bits = |i: usize| {
            let n = layers;
            i < n / 8 || i >= 7 * n / 8 || (i as isize - (n / 8) as isize).rem_euclid(3) == 2
        };
        match (self, tensor) {
            (FileType::Q8_0, _) => GgmlType::Q8_0,
            (_, Tensor::Head) => GgmlType::Q6_K,
            (
                FileType::Q4KM | FileType::Q5KM,
                Tensor::AttnQkv { layer } | Tensor::FfnDown { layer },
            ) if more_bits(layer) => GgmlType::Q6_K,
            _ => self.base(),
        }
    }
}

impl GgmlType {
    /// This type, or llama.cpp's fallback when rows of `row` elements are not whole 256-element
    /// K-quant blocks (`convert_incompatible_tensor`): Q4_K → Q5_0, Q6_K → Q8_0; Q5_K → Q5_0,
    /// where llama.cpp takes Q5_1, whose free minimum our symmetric grid leaves unused (Q5_0
    /// holds the same lattice in 2 bytes less per 32). Callers still
    /// check the result's block with [`GgmlType::row_bytes`].
    pub fn fitting(self, row: usize) -> GgmlType {
        if row.is_multiple_of(self.block_len()) {
            return self;
        }
        match self {
            GgmlType::Q4_K | GgmlType::Q5_K => GgmlType::Q5_0,
            GgmlType::Q6_K => GgmlType::Q8_0,
            other => other,
        }
    }

    /// The types a solved linear can be written as (`--tensor-type`), by llama.cpp's names.
    pub const SOLVABLE: [GgmlType; 6] = [
        GgmlType::Q4_0,
        GgmlType::Q5_0,
        GgmlType::Q8_0,
        GgmlType::Q4_K,
        GgmlType::Q5_K,
        GgmlType::Q6_K,
    ];

    /// One of [`GgmlType::SOLVABLE`] by its name, in any case (`q4_k`, `Q8_0`).
    pub fn solvable_named(name: &str) -> Option<GgmlType> {
        GgmlType::SOLVABLE
            .into_iter()
            .find(|t| t.name().eq_ignore_ascii_case(name))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn q4_k_m_gives_more_bits_where_llama_cpp_does() {
        // 36 layers (the 4B): n/8 = 4, 7n/8 = 31; between, (i − 4) % 3 == 2 → 6, 9, …, 30.
        let six: Vec<usize> = (0..36)
            .filter(|&i| {
                FileType::Q4KM
                    .rule(Tensor::FfnDown { layer: i }, 36)
                    .fitting(256)
                    == GgmlType::Q6_K
            })
            .collect();
        let want: Vec<usize> = (0..4).chain((6..31).step_by(3)).chain(31..36).collect();
        assert_eq!(six, want);
        // 8 layers (the fixture): 0, 3, 6, 7.
        let six: Vec<usize> = (0..8)
            .filter(|&i| {
                FileType::Q4KM
                    .rule(Tensor::AttnQkv { layer: i }, 8)
                    .fitting(256)
                    == GgmlType::Q6_K
            })
            .collect();
        assert_eq!(six, [0, 3, 6, 7]);
        assert_eq!(
            FileType::Q4KM.rule(Tensor::Other, 8).fitting(256),
            GgmlType::Q4_K
        );
        assert_eq!(
            FileType::Q4KM.rule(Tensor::Head, 8).fitting(256),
            GgmlType::Q6_K
        );
    }

    #[test]
    fn q4_0_and_q8_0_are_uniform_but_for_the_head() {
        for t in [
            Tensor::AttnQkv { layer: 0 },
            Tensor::FfnDown { layer: 0 },
            Tensor::Other,
        ] {
            assert_eq!(FileType::Q4_0.rule(t, 28).fitting(256), GgmlType::Q4_0);
            assert_eq!(FileType::Q8_0.rule(t, 28).fitting(256), GgmlType::Q8_0);
        }
        assert_eq!(
            FileType::Q4_0.rule(Tensor::Head, 28).fitting(256),
            GgmlType::Q6_K
        );
        assert_eq!(
            FileType::Q8_0.rule(Tensor::Head, 28).fitting(256),
            GgmlType::Q8_0
        );
    }

    #[test]
    fn rows_that_are_not_whole_k_blocks_fall_back_as_llama_cpp_does() {
        // 704 = 2.75 × 256: Q4_K → Q5_0, Q6_K → Q8_0; 32-element types are kept.
        assert_eq!(
            FileType::Q4KM.rule(Tensor::Other, 8).fitting(704),
            GgmlType::Q5_0
        );
        let down = |layer| {
            FileType::Q4KM
                .rule(Tensor::FfnDown { layer }, 8)
                .fitting(704)
        };
        assert_eq!((down(0), down(1)), (GgmlType::Q8_0, GgmlType::Q5_0));
        assert_eq!(
            FileType::Q4_0.rule(Tensor::Head, 8).fitting(128),
            GgmlType::Q8_0
        );
        assert_eq!(
            FileType::Q4_0.rule(Tensor::Other, 8).fitting(704),
            GgmlType::Q4_0
        );
        assert_eq!(
            FileType::Q4KM.rule(Tensor::Other, 8).fitting(512),
            GgmlType::Q4_K
        );
    }
}
