//! `phone_manifest.json` → `Manifest::read` (parse + `Manifest::check`) from a real folder,
//! then the host-side arithmetic `PhoneModel` does with an accepted manifest short of
//! running ONNX Runtime: cache sizes, masks, rotary tables, encodings.
#![no_main]

use libfuzzer_sys::fuzz_target;
use spark_tool::checkpoint::RopeSpec;
use spark_tool::model::rope::Rope;
use spark_tool::phone::Manifest;

fuzz_target!(|data: &[u8]| {
    let dir = tempfile::tempdir().expect("tempdir");
    std::fs::write(dir.path().join("phone_manifest.json"), data).expect("write manifest");
    let Ok(m) = Manifest::read(dir.path()) else {
        return;
    };
    for c in &m.caches {
        let _: usize = c.key_shape.iter().product();
        let _: usize = c.value_shape.iter().product();
    }
    for info in m.types.values() {
        let last = m.context - 1;
        let _valid = last.min(info.past_len);
        // A legitimately huge export is a resource limit, not a parse error: build the tables
        // only at sizes a test can afford.
        if info.rotary_dims <= 1 << 16 {
            let rope = Rope::new(RopeSpec {
                theta: info.rope_theta,
                rotary_dims: info.rotary_dims,
            });
            let (cos, sin) = rope.angles(last);
            assert_eq!(
                (cos.len(), sin.len()),
                (info.rotary_dims / 2, info.rotary_dims / 2)
            );
        }
    }
    for part in &m.parts {
        for io in part.inputs.iter().chain(&part.outputs) {
            let _: usize = io.shape.iter().product();
            if let Some(e) = io.encoding {
                let (lo, hi) = e.dtype.range();
                for q in [lo, hi, e.zero_point] {
                    let x = e.dequantize(q);
                    let _ = e.quantize(x);
                }
                for x in [e.min, e.max, 0.0, f32::MAX, f32::MIN, f32::NAN] {
                    let q = e.quantize(x);
                    assert!((lo..=hi).contains(&q));
                }
            }
        }
    }
});
