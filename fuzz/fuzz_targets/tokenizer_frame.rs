//! The chat frame and text ↔ ids with the fixture's `tokenizer.json`: `render_chat` →
//! `encode` → `decode`, and `StreamDecoder` over the encoded ids and over raw ids (any u32,
//! in or out of the vocabulary). Input: byte 0 = flags (bit 0 thinking, bit 1 system
//! message), then the user text, a 0x01 byte, the system text (lossy UTF-8), and after a
//! 0x02 byte the raw ids as little-endian u16 (offset into or past the vocabulary).
#![no_main]

use std::sync::OnceLock;

use libfuzzer_sys::fuzz_target;
use spark_tool::tokenizer::{render_chat, SparkTokenizer, StreamDecoder};

fn tok() -> &'static SparkTokenizer {
    static T: OnceLock<SparkTokenizer> = OnceLock::new();
    T.get_or_init(|| {
        SparkTokenizer::from_file(&spark_tool::bundled_fixture().join("tokenizer.json"))
            .expect("fixture tokenizer")
    })
}

/// Stream `ids`; when every id decodes, the streamed pieces must add up to the full text.
fn stream(tok: &SparkTokenizer, ids: &[u32]) {
    let mut sd = StreamDecoder::default();
    let mut streamed = String::new();
    for &id in ids {
        match sd.push(tok, id) {
            Ok(s) => streamed.push_str(&s),
            Err(_) => return,
        }
    }
    if let Ok(full) = tok.decode(ids) {
        if !full.ends_with('\u{FFFD}') {
            assert_eq!(
                streamed, full,
                "streamed text differs from decoding all ids"
            );
        }
    }
}

fuzz_target!(|data: &[u8]| {
    let Some((&flags, rest)) = data.split_first() else {
        return;
    };
    let tok = tok();
    let (text, raw) = match rest.iter().position(|&b| b == 2) {
        Some(i) => (&rest[..i], &rest[i + 1..]),
        None => (rest, &[][..]),
    };
    let text = String::from_utf8_lossy(text);
    let (user, system) = match text.split_once('\u{1}') {
        Some((u, s)) => (u, (flags & 2 != 0).then_some(s)),
        None => (&*text, None),
    };
    let frame = render_chat(user, system, flags & 1 != 0);
    if let Ok(ids) = tok.encode(&frame) {
        if let Ok(back) = tok.decode(&ids) {
            let _ = back;
        }
        stream(tok, &ids[..ids.len().min(128)]);
    }
    if let Ok(ids) = tok.encode(user) {
        stream(tok, &ids[..ids.len().min(128)]);
    }
    let v = tok.vocab_size() as u32;
    let raw: Vec<u32> = raw
        .chunks_exact(2)
        .take(64)
        .map(|c| {
            let x = u16::from_le_bytes([c[0], c[1]]) as u32;
            if x >= 0xFF00 {
                u32::MAX - (x & 0xFF)
            } else {
                x % (v + 64)
            }
        })
        .collect();
    stream(tok, &raw);
    let _ = tok.token_id(user);
});
