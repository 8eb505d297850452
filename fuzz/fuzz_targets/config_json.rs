//! `config.json` → `SparkConfig::from_json_str`, then every derived size and the expected
//! tensor list that `Checkpoint::open` builds from an accepted config.
#![no_main]

use libfuzzer_sys::fuzz_target;
use spark_tool::checkpoint::layout::{expected_tensors, stored_linears};
use spark_tool::checkpoint::{Proj, QkvLayout, SparkConfig};

fuzz_target!(|data: &[u8]| {
    let Ok(text) = std::str::from_utf8(data) else {
        return;
    };
    let Ok(c) = SparkConfig::from_json_str(text, "config.json") else {
        return;
    };
    let _ = (c.q_dim(), c.kv_dim(), c.gqa_group());
    for &t in &c.layer_types {
        let r = c.rope_for(t);
        assert!(r.rotary_dims > 0 && r.rotary_dims <= c.head_dim && r.rotary_dims % 2 == 0);
    }
    for p in Proj::ALL {
        let [n, k] = p.shape(&c);
        let _ = n.checked_mul(k).expect("projection size fits usize");
        let _ = p.fused_rows(&c);
    }
    for qkv in [QkvLayout::Fused, QkvLayout::Split] {
        let layouts = vec![qkv; c.num_hidden_layers];
        for tied in [false, true] {
            for t in expected_tensors(&c, tied, &layouts) {
                let _ = t.shape.iter().try_fold(1usize, |a, &d| a.checked_mul(d));
            }
        }
        let _ = stored_linears(0, qkv, &Proj::QUANTIZED);
    }
    if let Some(info) = &c.gptq {
        assert!([32, 64, 128].contains(&info.group_size));
    }
});
