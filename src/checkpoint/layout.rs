//! The tensors a Spark2_5 checkpoint must contain (docs/MODEL.md §3), and
//! the check of a real checkpoint against them.

use std::collections::BTreeSet;

use safetensors::Dtype;
use serde::Serialize;

use super::config::SparkConfig;
use super::store::TensorStore;

#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum TensorClass {
    Embedding,
    AttentionQkv,
    AttentionGate,
    AttentionOut,
    Mlp,
    Norm,
    LmHead,
}

impl TensorClass {
    pub fn label(self) -> &'static str {
        match self {
            TensorClass::Embedding => "embedding",
            TensorClass::AttentionQkv => "attention q/k/v",
            TensorClass::AttentionGate => "attention gate (g_proj)",
            TensorClass::AttentionOut => "attention out_proj",
            TensorClass::Mlp => "mlp gate/up/down",
            TensorClass::Norm => "norms",
            TensorClass::LmHead => "lm_head (untied)",
        }
    }
}

/// How a layer stores its q/k/v projection.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, serde::Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum QkvLayout {
    /// One `q_k_v_proj` with rows [q | k | v], as the published checkpoints.
    Fused,
    /// Separate `q_proj`, `k_proj`, `v_proj`.
    Split,
}

#[derive(Debug, Clone)]
pub struct ExpectedTensor {
    pub name: String,
    pub shape: Vec<usize>,
    pub class: TensorClass,
}

pub fn layer_prefix(i: usize) -> String {
    format!("model.layers.{i}.")
}

/// The fused q/k/v module of the published checkpoints: rows `[q | k | v]`.
pub const FUSED_QKV: &str = "self_attn.q_k_v_proj";

/// One projection of a decoder layer. This table (module name, shape, input, fused rows) is
/// the one place the model, the graph builder, quantize and its output learn a layer's linears.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Proj {
    Q,
    K,
    V,
    G,
    Out,
    Gate,
    Up,
    Down,
}

/// The activation a projection reads; projections with the same input share a Hessian.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ProjInput {
    /// RMSNorm of the residual (q, k, v and the head gate g).
    AttnNorm,
    /// Gated attention output (out_proj).
    Attention,
    /// RMSNorm of the residual after attention (gate, up).
    MlpNorm,
    /// gelu(gate) ⊙ up (down).
    MlpAct,
}

impl Proj {
    /// In checkpoint order.
    pub const ALL: [Proj; 8] = [
        Proj::Q,
        Proj::K,
        Proj::V,
        Proj::G,
        Proj::Out,
        Proj::Gate,
        Proj::Up,
        Proj::Down,
    ];
    /// What quantize writes as GPTQ; `g_proj` (one row per head) stays 16-bit
    /// (docs/GPTQ_FORMAT.md §6).
    pub const QUANTIZED: [Proj; 7] = [
        Proj::Q,
        Proj::K,
        Proj::V,
        Proj::Out,
        Proj::Gate,
        Proj::Up,
        Proj::Down,
    ];

    /// The module name inside a layer, as in the HF checkpoint (split q/k/v).
    pub fn module(self) -> &'static str {
        match self {
            Proj::Q => "self_attn.q_proj",
            Proj::K => "self_attn.k_proj",
            Proj::V => "self_attn.v_proj",
            Proj::G => "self_attn.g_proj",
            Proj::Out => "self_attn.out_proj",
            Proj::Gate => "mlp.gate_proj",
            Proj::Up => "mlp.up_proj",
            Proj::Down => "mlp.down_proj",
        }
    }

    /// A short stable key (resume files).
    pub fn key(self) -> &'static str {
        match self {
            Proj::Q => "q",
            Proj::K => "k",
            Proj::V => "v",
            Proj::G => "g",
            Proj::Out => "out",
            Proj::Gate => "gate",
            Proj::Up => "up",
            Proj::Down => "down",
        }
    }

    pub fn input(self) -> ProjInput {
        match self {
            Proj::Q | Proj::K | Proj::V | Proj::G => ProjInput::AttnNorm,
            Proj::Out => ProjInput::Attention,
            Proj::Gate | Proj::Up => ProjInput::MlpNorm,
            Proj::Down => ProjInput::MlpAct,
        }
    }

    /// `[out_features, in_features]`.
    pub fn shape(self, cfg: &SparkConfig) -> [usize; 2] {
        let (h, q, kv, i) = (
            cfg.hidden_size,
            cfg.q_dim(),
            cfg.kv_dim(),
            cfg.intermediate_size,
        );
        match self {
            Proj::Q => [q, h],
            Proj::K | Proj::V => [kv, h],
            Proj::G => [cfg.num_attention_heads, h],
            Proj::Out => [h, q],
            Proj::Gate | Proj::Up => [i, h],
            Proj::Down => [h, i],
        }
    }

    fn class(self) -> TensorClass {
        match self {
            Proj::Q | Proj::K | Proj::V => TensorClass::AttentionQkv,
            Proj::G => TensorClass::AttentionGate,
            Proj::Out => TensorClass::AttentionOut,
            Proj::Gate | Proj::Up | Proj::Down => TensorClass::Mlp,
        }
    }

    /// Its rows inside the fused `q_k_v_proj` (q, k and v only).
    pub fn fused_rows(self, cfg: &SparkConfig) -> Option<std::ops::Range<usize>> {
        let (q, kv) = (cfg.q_dim(), cfg.kv_dim());
        match self {
            Proj::Q => Some(0..q),
            Proj::K => Some(q..q + kv),
            Proj::V => Some(q + kv..q + 2 * kv),
            _ => None,
        }
    }

    /// Where layer `layer` stores this projection under `qkv`: the tensor prefix (no
    /// `.weight`), and for a fused q/k/v the rows of it that are this projection.
    pub fn stored_at(
        self,
        layer: usize,
        qkv: QkvLayout,
        cfg: &SparkConfig,
    ) -> (String, Option<std::ops::Range<usize>>) {
        match (qkv, self.fused_rows(cfg)) {
            (QkvLayout::Fused, Some(rows)) => {
                (format!("{}{FUSED_QKV}", layer_prefix(layer)), Some(rows))
            }
            _ => (format!("{}{}", layer_prefix(layer), self.module()), None),
        }
    }
}

/// The stored linears of layer `layer` among `projs` under `qkv`, in order: each tensor prefix
/// with the projections it holds (q, k, v together when fused).
pub fn stored_linears(layer: usize, qkv: QkvLayout, projs: &[Proj]) -> Vec<(String, Vec<Proj>)> {
    let mut out: Vec<(String, Vec<Proj>)> = Vec::new();
    for &p in projs {
        let fused = qkv == QkvLayout::Fused && matches!(p, Proj::Q | Proj::K | Proj::V);
        let name = if fused {
            format!("{}{FUSED_QKV}", layer_prefix(layer))
        } else {
            format!("{}{}", layer_prefix(layer), p.module())
        };
        match out.last_mut() {
            Some((n, v)) if *n == name => v.push(p),
            _ => out.push((name, vec![p])),
        }
    }
    out
}

/// Every tensor the checkpoint must hold, in file-independent order.
pub fn expected_tensors(cfg: &SparkConfig, tied: bool, qkv: &[QkvLayout]) -> Vec<ExpectedTensor> {
    let h = cfg.hidden_size;
    let mut out = Vec::new();
    let mut push =
        |name: String, shape: Vec<usize>, class| out.push(ExpectedTensor { name, shape, class });
    push(
        "model.embedding.weight".into(),
        vec![cfg.vocab_size, h],
        TensorClass::Embedding,
    );
    for (l, layout) in qkv.iter().enumerate().take(cfg.num_hidden_layers) {
        let p = layer_prefix(l);
        push(
            format!("{p}input_layernorm.weight"),
            vec![h],
            TensorClass::Norm,
        );
        for (name, projs) in stored_linears(l, *layout, &Proj::ALL) {
            if projs[0] == Proj::Gate {
                push(
                    format!("{p}post_attention_layernorm.weight"),
                    vec![h],
                    TensorClass::Norm,
                );
            }
            let rows = projs.iter().map(|p| p.shape(cfg)[0]).sum();
            let k = projs[0].shape(cfg)[1];
            push(format!("{name}.weight"), vec![rows, k], projs[0].class());
        }
    }
    push("model.norm.weight".into(), vec![h], TensorClass::Norm);
    if !tied {
        push(
            "lm_head.weight".into(),
            vec![cfg.vocab_size, h],
            TensorClass::LmHead,
        );
    }
    out
}

/// Result of checking a store against the config.
#[derive(Debug, Clone)]
pub struct CheckedLayout {
    pub tied: bool,
    /// Linears stored as GPTQ (`prefix.qweight/qzeros/scales[/g_idx]`), by prefix.
    pub gptq: std::collections::BTreeSet<String>,
    pub qkv: Vec<QkvLayout>,
    pub expected: Vec<ExpectedTensor>,
    pub warnings: Vec<String>,
}

/// Buffers some exporters leave in; they carry no information we use.
fn is_ignorable(name: &str) -> bool {
    name.ends_with(".rotary_emb.inv_freq")
}

pub fn check(cfg: &SparkConfig, store: &TensorStore) -> Result<CheckedLayout, Vec<String>> {
    let mut c = LayoutCheck {
        cfg,
        store,
        problems: Vec::new(),
        warnings: Vec::new(),
    };
    let tied = c.tied();
    let qkv = c.qkv_layouts();
    let expected = expected_tensors(cfg, tied, &qkv);
    let gptq = c.check_expected(&expected);
    c.check_unexpected(&expected, &gptq, tied);
    c.check_gptq_head(&gptq);
    if c.problems.is_empty() {
        Ok(CheckedLayout {
            tied,
            gptq,
            qkv,
            expected,
            warnings: c.warnings,
        })
    } else {
        Err(c.problems)
    }
}

/// A checkpoint's tensors against its config: every problem found, and the warnings.
struct LayoutCheck<'a> {
    cfg: &'a SparkConfig,
    store: &'a TensorStore,
    problems: Vec<String>,
    warnings: Vec<String>,
}

impl LayoutCheck<'_> {
    /// Whether the head is tied to the embedding: the config's word, else whether the
    /// checkpoint lacks `lm_head.weight`.
    fn tied(&mut self) -> bool {
        let (cfg, store, warnings) = (self.cfg, self.store, &mut self.warnings);
        let has_head = store.get("lm_head.weight").is_some();
        match cfg.tie_word_embeddings {
            Some(t) => t,
            None => {
                warnings.push(format!(
                    "config.json has no `tie_word_embeddings`; {} because the checkpoint {} `lm_head.weight`",
                    if has_head { "using the untied lm_head.weight" } else { "tying the head to the embedding" },
                    if has_head { "contains" } else { "has no" }
                ));
                !has_head
            }
        }
    }

    /// Each layer's q/k/v storage: split when it has `q_proj` and no `q_k_v_proj`.
    fn qkv_layouts(&self) -> Vec<QkvLayout> {
        let (cfg, store) = (self.cfg, self.store);
        (0..cfg.num_hidden_layers)
            .map(|l| {
                let p = layer_prefix(l);
                // `.weight` for dense checkpoints, `.qweight` for GPTQ ones.
                let has = |m: &str| {
                    ["weight", "qweight"]
                        .iter()
                        .any(|t| store.get(&format!("{p}self_attn.{m}.{t}")).is_some())
                };
                if !has("q_k_v_proj") && has("q_proj") {
                    QkvLayout::Split
                } else {
                    QkvLayout::Fused
                }
            })
            .collect()
    }

    /// Check every expected tensor (dense, or a GPTQ set where the config allows one); returns
    /// the prefixes of the linears stored as GPTQ.
    fn check_expected(&mut self, expected: &[ExpectedTensor]) -> BTreeSet<String> {
        let (cfg, store, problems) = (self.cfg, self.store, &mut self.problems);
        let mut gptq = BTreeSet::new();
        for t in expected {
            let quantizable = matches!(
                t.class,
                TensorClass::AttentionQkv
                    | TensorClass::AttentionOut
                    | TensorClass::Mlp
                    | TensorClass::LmHead
            );
            if let (Some(info), Some(prefix), None) = (
                &cfg.gptq,
                t.name.strip_suffix(".weight"),
                store.get(&t.name),
            ) {
                if quantizable && store.get(&format!("{prefix}.qweight")).is_some() {
                    super::gptq::check_tensors(
                        store,
                        prefix,
                        t.shape[0],
                        t.shape[1],
                        info.group_size,
                        problems,
                    );
                    gptq.insert(prefix.to_string());
                    continue;
                }
            }
            // The rest of a GPTQ linear without its qweight: say that, not "missing .weight".
            let partial_gptq = t.name.strip_suffix(".weight").and_then(|prefix| {
                let have: Vec<&str> = super::gptq::GPTQ_PARTS
                    .iter()
                    .copied()
                    .filter(|p| store.get(&format!("{prefix}.{p}")).is_some())
                    .collect();
                (!have.is_empty()).then_some((prefix, have))
            });
            match store.get(&t.name) {
                None if partial_gptq
                    .as_ref()
                    .is_some_and(|(_, have)| have.contains(&"qweight"))
                    && cfg.gptq.is_none() =>
                {
                    let (prefix, have) = partial_gptq.expect("checked");
                    problems.push(format!(
                        "linear `{prefix}` is stored as GPTQ ({}) but config.json has no \
                         `quantization_config` (quant_method \"gptq\", bits 4, group_size, sym, \
                         desc_act) to read it with; restore it from the checkpoint's source",
                        have.join(", "),
                    ));
                }
                None if partial_gptq.is_some() => {
                    let (prefix, have) = partial_gptq.expect("checked");
                    problems.push(format!(
                        "linear `{prefix}` has GPTQ tensors ({}) but no `{prefix}.qweight`; expected a complete \
                         GPTQ set (qweight, qzeros, scales) or a dense `{}` of shape {:?}",
                        have.join(", "),
                        t.name,
                        t.shape
                    ));
                }
                None => problems.push(format!(
                    "missing tensor `{}` (expected shape {:?})",
                    t.name, t.shape
                )),
                Some(e) => {
                    if e.shape != t.shape {
                        problems.push(format!(
                            "tensor `{}` in {} has shape {:?}, expected {:?}",
                            t.name,
                            store.file_of(e).display(),
                            e.shape,
                            t.shape
                        ));
                    }
                    if !matches!(e.dtype, Dtype::BF16 | Dtype::F16 | Dtype::F32) {
                        problems.push(format!(
                            "tensor `{}` in {} has dtype {:?}, expected BF16, F16 or F32",
                            t.name,
                            store.file_of(e).display(),
                            e.dtype
                        ));
                    }
                }
            }
        }
        gptq
    }

    /// Every stored tensor the layout does not expect: ignored with a warning, or a problem.
    fn check_unexpected(
        &mut self,
        expected: &[ExpectedTensor],
        gptq: &BTreeSet<String>,
        tied: bool,
    ) {
        let (store, problems, warnings) = (self.store, &mut self.problems, &mut self.warnings);
        for e in store.entries() {
            if expected.iter().any(|t| t.name == e.name) {
                continue;
            }
            if let Some((prefix, part)) = e.name.rsplit_once('.') {
                if gptq.contains(prefix) && super::gptq::GPTQ_PARTS.contains(&part) {
                    continue;
                }
            }
            if e.name == "lm_head.weight" && tied {
                let emb = store.get("model.embedding.weight");
                let same =
                    emb.is_some_and(|m| m.dtype == e.dtype && store.bytes(m) == store.bytes(e));
                warnings.push(if same {
                    "`lm_head.weight` is present but config says tie_word_embeddings=true; it equals the embedding and is ignored".into()
                } else {
                    "`lm_head.weight` is present but config says tie_word_embeddings=true and it DIFFERS from the embedding; it is ignored, as HF and vLLM do — check the config".into()
                });
            } else if is_ignorable(&e.name) {
                warnings.push(format!("ignoring buffer `{}`", e.name));
            } else {
                problems.push(format!(
                    "unexpected tensor `{}` in {} (shape {:?}, {:?}) is not part of Spark2_5",
                    e.name,
                    store.file_of(e).display(),
                    e.shape,
                    e.dtype
                ));
            }
        }
    }

    fn check_gptq_head(&mut self, gptq: &BTreeSet<String>) {
        let (cfg, problems) = (self.cfg, &mut self.problems);
        // vLLM quantizes the head only when the config says so, and then needs its GPTQ tensors.
        if cfg.gptq.as_ref().is_some_and(|g| g.lm_head) && !gptq.contains("lm_head") {
            problems.push(
                "config.json's quantization_config.lm_head is true but the checkpoint has no GPTQ head \
                 (lm_head.qweight, qzeros, scales); set it to false or restore the head's tensors"
                    .into(),
            );
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cfg(json: serde_json::Value) -> SparkConfig {
        SparkConfig::from_json_str(&json.to_string(), "config.json").unwrap()
    }

    fn real(hidden: usize, inter: usize, layers: usize, heads: usize, kv: usize) -> SparkConfig {
        let types: Vec<&str> = (0..layers)
            .map(|i| {
                if (i + 1) % 4 == 0 {
                    "full_attention"
                } else {
                    "sliding_attention"
                }
            })
            .collect();
        cfg(serde_json::json!({
            "model_type": "spark2_5", "hidden_size": hidden, "intermediate_size": inter,
            "num_hidden_layers": layers, "num_attention_heads": heads, "num_key_value_heads": kv,
            "head_dim": 256, "vocab_size": 131072, "sliding_window": 512, "layer_types": types,
            "rope_parameters": {"full_attention": {"partial_rotary_factor": 0.25, "rope_theta": 5000000},
                                "sliding_attention": {"partial_rotary_factor": 1.0, "rope_theta": 10000}},
            "hidden_act": "gelu", "tie_word_embeddings": true
        }))
    }

    fn count(c: &SparkConfig) -> (usize, usize) {
        let t = expected_tensors(c, true, &vec![QkvLayout::Fused; c.num_hidden_layers]);
        (
            t.len(),
            t.iter().map(|t| t.shape.iter().product::<usize>()).sum(),
        )
    }

    #[test]
    fn spec_parameter_counts() {
        // docs/MODEL.md §3 and §15.
        assert_eq!(count(&real(2048, 6656, 28, 8, 2)), (226, 1_707_657_216));
        assert_eq!(count(&real(2560, 10240, 36, 16, 4)).1, 4_112_079_360);
    }

    #[test]
    fn projection_table_matches_the_checkpoint_names() {
        let c = real(2048, 6656, 28, 8, 2);
        let fused = stored_linears(3, QkvLayout::Fused, &Proj::QUANTIZED);
        let names: Vec<&str> = fused.iter().map(|(n, _)| n.as_str()).collect();
        assert_eq!(
            names,
            [
                "model.layers.3.self_attn.q_k_v_proj",
                "model.layers.3.self_attn.out_proj",
                "model.layers.3.mlp.gate_proj",
                "model.layers.3.mlp.up_proj",
                "model.layers.3.mlp.down_proj",
            ]
        );
        assert_eq!(fused[0].1, [Proj::Q, Proj::K, Proj::V]);
        assert_eq!(
            stored_linears(0, QkvLayout::Split, &Proj::QUANTIZED).len(),
            7
        );
        // The fused rows tile q_k_v_proj exactly, in order q | k | v.
        let mut next = 0;
        for p in [Proj::Q, Proj::K, Proj::V] {
            let r = p.fused_rows(&c).unwrap();
            assert_eq!((r.start, r.len()), (next, p.shape(&c)[0]));
            next = r.end;
            let (name, rows) = p.stored_at(1, QkvLayout::Fused, &c);
            assert_eq!(
                (name.as_str(), rows),
                ("model.layers.1.self_attn.q_k_v_proj", Some(r))
            );
            assert_eq!(p.stored_at(1, QkvLayout::Split, &c).1, None);
        }
        assert_eq!(next, c.q_dim() + 2 * c.kv_dim());
        assert_eq!(Proj::Out.shape(&c), [2048, c.q_dim()]);
        assert_eq!(Proj::Down.input(), ProjInput::MlpAct);
    }

    #[test]
    fn split_layout_has_same_parameters() {
        let c = real(2048, 6656, 28, 8, 2);
        let split = expected_tensors(&c, true, &[QkvLayout::Split; 28]);
        let n: usize = split
            .iter()
            .map(|t| t.shape.iter().product::<usize>())
            .sum();
        assert_eq!((split.len(), n), (226 + 2 * 28, 1_707_657_216));
    }
}
