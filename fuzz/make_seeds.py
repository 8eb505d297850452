#!/usr/bin/env python3
"""Write the seed corpus of every fuzz target into fuzz/seeds/<target>/ (stdlib only).

The seeds are small valid inputs (a tiny dense, sharded and GPTQ checkpoint, configs, a
phone manifest, chat texts) so that libFuzzer starts past the parsers' first checks.
Multi-file inputs use the `=====FILE <name>` framing of fuzz/src/lib.rs.
"""
import json
import os
import struct
import sys

ROOT = os.path.dirname(os.path.abspath(__file__))
SEEDS = os.path.join(ROOT, "seeds")


def st(tensors):
    """A safetensors file from [(name, dtype, shape, bytes)]."""
    header, data = {}, b""
    for name, dtype, shape, raw in tensors:
        header[name] = {"dtype": dtype, "shape": shape, "data_offsets": [len(data), len(data) + len(raw)]}
        data += raw
    h = json.dumps(header, separators=(",", ":")).encode()
    h += b" " * (-len(h) % 8)
    return struct.pack("<Q", len(h)) + h + data


def bf16(shape, v=0x3F80):
    n = 1
    for d in shape:
        n *= d
    return struct.pack("<%dH" % n, *([v] * n))


def i32(shape, v):
    n = 1
    for d in shape:
        n *= d
    return struct.pack("<%dI" % n, *([v & 0xFFFFFFFF] * n))


def f16(shape):
    n = 1
    for d in shape:
        n *= d
    return struct.pack("<%dH" % n, *([0x2000] * n))


def files(*recs):
    """`=====FILE name\\n<content>` records."""
    out = b""
    for name, content in recs:
        out += b"=====FILE " + name.encode() + b"\n" + content
    return out


def config(hidden, inter, heads, kv, hd, vocab, types, qc=None, window=4):
    c = {
        "model_type": "spark2_5", "hidden_size": hidden, "intermediate_size": inter,
        "num_hidden_layers": len(types), "num_attention_heads": heads, "num_key_value_heads": kv,
        "head_dim": hd, "vocab_size": vocab, "sliding_window": window, "layer_types": types,
        "rope_parameters": {
            "full_attention": {"rope_theta": 5000000.0, "partial_rotary_factor": 0.5, "rope_type": "default"},
            "sliding_attention": {"rope_theta": 10000.0, "partial_rotary_factor": 1.0}},
        "rms_norm_eps": 1e-6, "hidden_act": "gelu", "headwise_attn_output_gate": True,
        "gate_attn_act_mode": "sigmoid", "attention_bias": False, "mlp_bias": False,
        "tie_word_embeddings": True, "bos_token_id": 0, "eos_token_id": [1, 2], "pad_token_id": 3,
    }
    if qc:
        c["quantization_config"] = qc
    return json.dumps(c, indent=1).encode()


def dense(hidden=8, inter=16, heads=2, kv=1, hd=4, vocab=16, layers=1, split=False, head=False):
    q, k = heads * hd, kv * hd
    t = [("model.embedding.weight", "BF16", [vocab, hidden], bf16([vocab, hidden]))]
    for l in range(layers):
        p = "model.layers.%d." % l
        t.append((p + "input_layernorm.weight", "BF16", [hidden], bf16([hidden])))
        if split:
            for m, rows in (("q_proj", q), ("k_proj", k), ("v_proj", k)):
                t.append((p + "self_attn.%s.weight" % m, "BF16", [rows, hidden], bf16([rows, hidden])))
        else:
            t.append((p + "self_attn.q_k_v_proj.weight", "BF16", [q + 2 * k, hidden], bf16([q + 2 * k, hidden])))
        t += [
            (p + "self_attn.g_proj.weight", "F32", [heads, hidden], b"\0\0\x80\x3f" * heads * hidden),
            (p + "self_attn.out_proj.weight", "F16", [hidden, q], f16([hidden, q])),
            (p + "post_attention_layernorm.weight", "BF16", [hidden], bf16([hidden])),
            (p + "mlp.gate_proj.weight", "BF16", [inter, hidden], bf16([inter, hidden])),
            (p + "mlp.up_proj.weight", "BF16", [inter, hidden], bf16([inter, hidden])),
            (p + "mlp.down_proj.weight", "BF16", [hidden, inter], bf16([hidden, inter])),
        ]
    t.append(("model.norm.weight", "BF16", [hidden], bf16([hidden])))
    if head:
        t.append(("lm_head.weight", "BF16", [vocab, hidden], bf16([vocab, hidden], 0x3F00)))
    return t


def gptq_linear(prefix, n, k, g, zeros=0x77777777, g_idx=True):
    t = [
        (prefix + ".qweight", "I32", [k // 8, n], i32([k // 8, n], 0x12345678)),
        (prefix + ".qzeros", "I32", [k // g, n // 8], i32([k // g, n // 8], zeros)),
        (prefix + ".scales", "F16", [k // g, n], f16([k // g, n])),
    ]
    if g_idx:
        t.append((prefix + ".g_idx", "I32", [k], struct.pack("<%di" % k, *[kk // g for kk in range(k)])))
    return t


def gptq_checkpoint():
    hidden, inter, heads, kv, hd, g = 32, 32, 2, 1, 16, 32
    t = []
    for name, dtype, shape, raw in dense(hidden, inter, heads, kv, hd, 16):
        prefix = name[: -len(".weight")]
        quantized = any(m in name for m in ("q_k_v_proj", "out_proj", "gate_proj", "up_proj", "down_proj"))
        if quantized:
            t += gptq_linear(prefix, shape[0], shape[1], g, g_idx="down" not in name)
        else:
            t.append((name, dtype, shape, raw))
    qc = {"quant_method": "gptq", "bits": 4, "group_size": g, "desc_act": False, "sym": True,
          "lm_head": False, "checkpoint_format": "gptq", "meta": {"spark_tool": {"format": "w4a16"}}}
    return t, config(hidden, inter, heads, kv, hd, 16, ["full_attention"], qc)


def manifest(layers=("sliding", "full"), context=16, window=4, quant=False):
    kvh, hd, hidden, vocab = 1, 4, 8, 16
    past = {"sliding": window - 1, "full": context - 1}
    enc = {"dtype": "uint16", "scale": 0.001, "zero_point": 32768, "min": -32.768, "max": 32.767}
    kvenc = {"dtype": "int16", "scale": 0.0001, "zero_point": 0, "min": -3.2767, "max": 3.2767}
    types = {}
    for t in sorted(set(layers)):
        types[t] = {
            "layers": [i for i, x in enumerate(layers) if x == t], "past_len": past[t],
            "mask": "attention_mask_" + t, "cos": "position_ids_cos_" + t, "sin": "position_ids_sin_" + t,
            "rope_theta": 10000.0 if t == "sliding" else 5000000.0,
            "rotary_dims": 4 if t == "sliding" else 2, "slot_rule": "see docs/PHONE_IO.md"}
    caches, inputs, outputs = [], [], []
    io = lambda n, d, s, e=None: dict({"name": n, "dtype": d, "shape": s}, **({"encoding": e} if e else {}))
    inputs.append(io("input_embeds", "float32", [1, 1, hidden]))
    for t, i in types.items():
        inputs += [io(i["mask"], "float32", [1, 1, 1, i["past_len"] + 1]),
                   io(i["cos"], "float32", [1, 1, i["rotary_dims"] // 2]),
                   io(i["sin"], "float32", [1, 1, i["rotary_dims"] // 2])]
    kvd = "int16" if quant else "float32"
    for l, t in enumerate(layers):
        p = past[t]
        caches.append({"layer": l, "layer_type": t, "key_in": "past_key_%d_in" % l, "key_out": "past_key_%d_out" % l,
                       "value_in": "past_value_%d_in" % l, "value_out": "past_value_%d_out" % l,
                       "key_shape": [kvh, 1, hd, p], "value_shape": [kvh, 1, p, hd], "dtype": kvd})
        e = kvenc if quant else None
        inputs += [io("past_key_%d_in" % l, kvd, [kvh, 1, hd, p], e), io("past_value_%d_in" % l, kvd, [kvh, 1, p, hd], e)]
        outputs += [io("past_key_%d_out" % l, kvd, [kvh, 1, hd, 1], e), io("past_value_%d_out" % l, kvd, [kvh, 1, 1, hd], e)]
    outputs.append(io("logits", "uint16" if quant else "float32", [1, 1, vocab], enc if quant else None))
    m = {
        "format": "spark-tool phone decode step", "version": 1, "spark_tool_version": "0.1.0",
        "runs_in_vllm": False, "precision": "w8a16" if quant else "f32", "context": context,
        "sliding_window": window, "hidden_size": hidden, "vocab_size": vocab, "layer_types": list(layers),
        "bos_token_id": 0, "eos_token_ids": [1], "pad_token_id": None,
        "embedding": {"file": "embedding.safetensors", "tensor": "embed_tokens", "lookup": "host"},
        "mask_value": -50.0 if quant else -1000.0, "types": types, "caches": caches,
        "parts": [{"file": "decode.onnx", "graph_name": "decode", "layers": [0, len(layers)], "head": True,
                   "inputs": inputs, "outputs": outputs}],
        "kv_cache_bytes": 0, "kv_cache_bytes_if_all_full": 0, "how_to_step": ["pos = tokens so far"],
    }
    return json.dumps(m, indent=1).encode()


def main():
    seeds = {}
    tiny = dense()
    seeds["safetensors_store"] = {
        "dense_single": st(tiny),
        "dense_split_untied": st(dense(split=True, head=True)),
        "sharded": files(
            ("model.safetensors.index.json", json.dumps({"metadata": {"total_size": 0}, "weight_map": {
                n: ("model-00001-of-00002.safetensors" if i < 5 else "model-00002-of-00002.safetensors")
                for i, (n, *_r) in enumerate(tiny)}}, indent=1).encode()),
            ("model-00001-of-00002.safetensors", st(tiny[:5])),
            ("model-00002-of-00002.safetensors", st(tiny[5:]))),
        "gptq": (lambda t, c: files(("config.json", c), ("model.safetensors", st(t))))(*gptq_checkpoint()),
        "empty_header": struct.pack("<Q", 8) + b"{}      ",
    }
    fixture = open(os.path.join(ROOT, "..", "fixtures", "spark-tiny", "config.json"), "rb").read()
    seeds["config_json"] = {
        "fixture": fixture,
        "tiny_mixed": config(8, 16, 2, 1, 4, 16, ["sliding_attention", "full_attention"]),
        "gptq": gptq_checkpoint()[1],
    }
    seeds["gptq_tensors"] = {
        "v1_g32": st(gptq_linear("x", 8, 32, 32)),
        "v2_g64_args": files(("x.safetensors", st(gptq_linear("x", 16, 64, 64, 0x88888888, False))),
                             ("qc.json", b'{"quant_method":"gptq","bits":4,"group_size":64,"checkpoint_format":"gptq_v2"}'),
                             ("args", b"16 64 64 3 11")),
    }
    seeds["phone_manifest"] = {"f32": manifest(), "w8a16": manifest(("sliding", "sliding", "full"), 32, 8, True)}
    seeds["tokenizer_frame"] = {
        "hi": b"\x00Hi",
        "system": b"\x03Hello there, how are you?\x01Be brief.",
        "unicode": "\x01héllo 世界 🙂 <think>x</think>".encode(),
        "ids": b"\x00ok\x02" + struct.pack("<8H", 0, 1, 2, 100, 4095, 4096, 0xFFFF, 300),
    }
    for target, s in seeds.items():
        d = os.path.join(SEEDS, target)
        os.makedirs(d, exist_ok=True)
        for name, data in s.items():
            with open(os.path.join(d, name), "wb") as f:
                f.write(data)
        print("%s: %d seeds, %d bytes" % (target, len(s), sum(map(len, s.values()))), file=sys.stderr)


if __name__ == "__main__":
    main()
