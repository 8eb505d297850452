#!/usr/bin/env python3
"""Peer benchmark: GPTQModel (CPU) on a random-weight model with Spark-1.7B linear shapes.

GPTQModel has no Spark2_5 support, so the peer model is a Llama with the same
per-layer linear shapes (hidden 2048, intermediate 6656, q 2048 / k 512 /
v 512, out 2048×2048), as in docs/GPTQ_FORMAT.md §15. Calibration uses exactly the
windows `spark-tool quantize` cuts from calibration/spark-calib.jsonl with the
fixture tokenizer, so both tools see the same tokens.

    pip install gptqmodel==7.7.0          # docs/GPTQ_FORMAT.md §15; pulls torch/transformers
    GPTQMODEL_CPU_WORKERS=2 python3 tools/bench_gptqmodel.py --layers 2 --samples 32 --seq-len 512

Prints wall time, time per layer and peak RSS. Results: docs/QUANTIZE.md.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def calibration_windows(samples: int, seq_len: int) -> list[list[int]]:
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(ROOT / "fixtures/spark-tiny/tokenizer.json"))
    stream: list[int] = []
    with open(ROOT / "calibration/spark-calib.jsonl", encoding="utf-8") as f:
        for line in f:
            if len(stream) >= samples * seq_len:
                break
            stream.extend(tok.encode(json.loads(line)["text"], add_special_tokens=False).ids)
    if len(stream) < samples * seq_len:
        sys.exit(f"calibration too short: {len(stream)} tokens")
    return [stream[i * seq_len:(i + 1) * seq_len] for i in range(samples)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--samples", type=int, default=32)
    ap.add_argument("--seq-len", type=int, default=512)
    ap.add_argument("--group-size", type=int, default=128)
    a = ap.parse_args()
    os.environ.setdefault("GPTQMODEL_CPU_WORKERS", "2")

    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from gptqmodel import GPTQModel, QuantizeConfig

    work = Path(tempfile.mkdtemp(prefix="gptqmodel-bench-"))
    src = work / "llama-spark-shaped"
    cfg = LlamaConfig(hidden_size=2048, intermediate_size=6656, num_hidden_layers=a.layers,
                      num_attention_heads=16, num_key_value_heads=4, head_dim=128, vocab_size=4096,
                      max_position_embeddings=4096, tie_word_embeddings=True, torch_dtype="bfloat16")
    torch.manual_seed(0)
    LlamaForCausalLM(cfg).to(torch.bfloat16).save_pretrained(src)
    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(ROOT / "fixtures/spark-tiny" / f, src / f)
    calib = [{"input_ids": w, "attention_mask": [1] * len(w)} for w in calibration_windows(a.samples, a.seq_len)]

    qcfg = QuantizeConfig(bits=4, group_size=a.group_size, sym=True, desc_act=False)
    t0 = time.time()
    model = GPTQModel.load(str(src), qcfg, device="cpu")
    t_load = time.time() - t0
    t1 = time.time()
    model.quantize(calib, batch_size=1)
    t_quant = time.time() - t1
    model.save(str(work / "out"))
    wall = time.time() - t0
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    print(json.dumps({
        "peer": "GPTQModel 7.7.0 (CPU)", "layers": a.layers, "samples": a.samples, "seq_len": a.seq_len,
        "tokens": a.samples * a.seq_len, "group_size": a.group_size, "threads": torch.get_num_threads(),
        "load_s": round(t_load, 1), "quantize_s": round(t_quant, 1), "per_layer_s": round(t_quant / a.layers, 1),
        "wall_s": round(wall, 1), "peak_rss_gb": round(rss / 1e9, 2)}))
    shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
