//! `model.safetensors` / `model.safetensors.index.json` + shards, opened through
//! `TensorStore::open` and `Checkpoint::open` from a real folder. Input: the
//! bare bytes of `model.safetensors`, or `=====FILE <name>` records (an index,
//! shards, a `config.json`; without one the tiny config of the fuzz lib is used).
#![no_main]

use libfuzzer_sys::fuzz_target;
use spark_tool::checkpoint::{Checkpoint, TensorStore};
use spark_tool::formats::gptq;
use spark_tool_fuzz::{split_files, write_files, TINY_CONFIG};

/// Everything a loader does with a store that opened.
fn exercise(store: &TensorStore) {
    for e in store.entries() {
        let b = store.bytes(e);
        assert_eq!(b.len(), e.end - e.start);
        let _ = store.file_of(e);
        if let Some(v) = store.u16_view(e, 0..b.len()) {
            assert_eq!(v.len(), b.len() / 2);
        }
        if let Ok(v) = store.to_f32(e) {
            assert_eq!(v.len(), e.numel());
            if e.shape.len() == 2 {
                let r = e.shape[0];
                let rows = store
                    .rows_to_f32(e, r / 2, r)
                    .expect("rows of a float tensor");
                assert_eq!(rows.len(), (r - r / 2) * e.shape[1]);
            }
        }
    }
}

fuzz_target!(|data: &[u8]| {
    let files = split_files(data, "model.safetensors");
    let dir = tempfile::tempdir().expect("tempdir");
    if !files.iter().any(|(n, _)| *n == "config.json") {
        std::fs::write(dir.path().join("config.json"), TINY_CONFIG).expect("write config");
    }
    write_files(dir.path(), &files);
    if let Ok(store) = TensorStore::open(dir.path()) {
        exercise(&store);
    }
    let Ok(ck) = Checkpoint::open(dir.path()) else {
        return;
    };
    // What the model loader reads once the layout check passed.
    for t in &ck.layout.expected {
        match t.name.strip_suffix(".weight") {
            Some(prefix) if ck.layout.gptq.contains(prefix) => {
                let info = ck
                    .config
                    .gptq
                    .as_ref()
                    .expect("GPTQ tensors need the config block");
                // The layout check proves shapes and dtypes; `g_idx` values are data, checked
                // (with a clean error) when the linear is read.
                if let Ok(d) = gptq::read_linear(&ck.store, info, prefix, 0..t.shape[0]) {
                    assert_eq!(d.zeros.len(), d.scales.len());
                    let _ = d.contiguous();
                }
            }
            _ => {
                let w = ck.tensor_f32(&t.name).expect("a checked tensor converts");
                assert_eq!(w.len(), t.shape.iter().product::<usize>());
            }
        }
    }
});
