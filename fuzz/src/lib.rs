//! Helpers shared by the fuzz targets.
//!
//! Several targets need a folder of files, not one buffer. Their input is a
//! list of records `=====FILE <name>\n<content>`, each content running to the
//! next `=====FILE ` or the end; bytes before the first record are the content
//! of the target's default file. So a bare safetensors file is a valid input,
//! and `fuzz/make_seeds.py` writes multi-file seeds in the same framing.

use std::path::Path;

pub const MARK: &[u8] = b"=====FILE ";

/// A small valid Spark2_5 config (1 full-attention layer, hidden 8): used when
/// an input brings no `config.json` of its own, so that tiny tensor sets can
/// pass the layout check and reach the code after it.
pub const TINY_CONFIG: &str = r#"{"model_type":"spark2_5","hidden_size":8,"intermediate_size":16,
"num_hidden_layers":1,"num_attention_heads":2,"num_key_value_heads":1,"head_dim":4,
"vocab_size":16,"layer_types":["full_attention"],
"rope_parameters":{"full_attention":{"rope_theta":10000.0,"partial_rotary_factor":1.0}},
"hidden_act":"gelu","tie_word_embeddings":true,"bos_token_id":0,"eos_token_id":1}"#;

fn find(hay: &[u8], needle: &[u8]) -> Option<usize> {
    hay.windows(needle.len()).position(|w| w == needle)
}

/// A file name the fuzzer may create: `[A-Za-z0-9._-]{1,64}`, not `.`/`..`.
fn plain_name(name: &[u8]) -> Option<&str> {
    let ok = !name.is_empty()
        && name.len() <= 64
        && name
            .iter()
            .all(|c| c.is_ascii_alphanumeric() || b"._-".contains(c))
        && name != b"."
        && name != b"..";
    ok.then(|| std::str::from_utf8(name).expect("ascii"))
}

/// Split `data` into `(name, content)` records (see the module docs).
pub fn split_files<'a>(data: &'a [u8], default: &'a str) -> Vec<(&'a str, &'a [u8])> {
    let mut out = Vec::new();
    let mut rest = data;
    let first = find(rest, MARK).unwrap_or(rest.len());
    if first > 0 {
        out.push((default, &rest[..first]));
    }
    rest = &rest[first..];
    while rest.starts_with(MARK) {
        rest = &rest[MARK.len()..];
        let end = find(rest, MARK).unwrap_or(rest.len());
        let rec = &rest[..end];
        rest = &rest[end..];
        let nl = rec.iter().position(|&c| c == b'\n').unwrap_or(rec.len());
        if let Some(name) = plain_name(&rec[..nl]) {
            out.push((name, rec.get(nl + 1..).unwrap_or_default()));
        }
    }
    out
}

/// Write the records into `dir` (a later record of the same name wins).
pub fn write_files(dir: &Path, files: &[(&str, &[u8])]) {
    for (name, content) in files {
        std::fs::write(dir.join(name), content).expect("write fuzz input file");
    }
}
