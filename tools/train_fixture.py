#!/usr/bin/env python3
"""Train the tiny Spark2_5 fixture (fixtures/spark-tiny) on CPU.

The model is written from docs/MODEL.md §4–§10 in PyTorch (autograd is the only
reason PyTorch is used here; golden outputs come from tools/spark_ref.py,
a separate numpy implementation). Output is a real HF layout: config.json
with every key of the real config, bf16 model.safetensors with a tied head,
generation_config.json, tokenizer.json, tokenizer_config.json and
TRAINING.md with the loss curve and held-out perplexity.

    python3 tools/train_fixture.py --out fixtures/spark-tiny --steps 1200
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
import docs_corpus  # noqa: E402
import fixture_tokenizer  # noqa: E402
import spark_corpus  # noqa: E402

# What each --corpus is, for TRAINING.md.
CORPORA = {
    "spark": ("every 10th document, never trained on",
              "Data (both redistributable): project-written synthetic chat / tool-call dialogues in Spark's chat "
              "frame in five languages with code and JSON (tools/spark_corpus.py, Apache-2.0), and text from the "
              "CPython 3.11 standard library (`pydoc_data/topics.py` prose and module sources; PSF License 2.0)."),
    "docs": ("whole books never trained on: " + ", ".join(docs_corpus.HELD_OUT_BOOKS),
             f"Data: the Rust {docs_corpus.TOOLCHAIN} documentation books of the `rust-docs` component (MIT OR "
             "Apache-2.0), one document per page (tools/docs_corpus.py). Trained on "
             + ", ".join(docs_corpus.TRAIN_BOOKS) + "; held out by book."),
}

CHAT_TEMPLATE = (
    # Project-written rendering of the frame in docs/MODEL.md §13 (tools block omitted).
    "{%- set B = '<｜start▁of▁sentence｜>' %}{%- set E = '<｜end▁of▁sentence｜>' %}"
    "{{- B + '<|System|>\\nyou are a helpful assistant.' }}"
    "{%- if messages and messages[0].role == 'system' %}{{- '\\n\\n' + messages[0].content }}{%- endif %}"
    "{{- E }}"
    "{%- for m in messages %}"
    "{%- if m.role == 'user' %}{{- B + '<|User|>' + m.content + E }}"
    "{%- elif m.role == 'assistant' %}{{- B + '<|Bot|></think>' + m.content + E }}"
    "{%- elif m.role == 'tool' %}{{- B + '<|Tool|><tool_response>' + m.content + '</tool_response>' + E }}"
    "{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- B + '<|Bot|>' }}"
    "{%- if enable_thinking is defined and not enable_thinking %}{{- '</think>' }}{%- else %}{{- '<think>' }}{%- endif %}"
    "{%- endif %}"
)


def spark_config(vocab: int) -> dict:
    layer_types = (["sliding_attention"] * 3 + ["full_attention"]) * 2
    return {
        "architectures": ["Spark2_5ForCausalLM"],
        "auto_map": {
            "AutoConfig": "configuration_spark.Spark2_5Config",
            "AutoModel": "modeling_spark.Spark2_5Model",
            "AutoModelForCausalLM": "modeling_spark.Spark2_5ForCausalLM",
        },
        "model_type": "spark2_5",
        "hidden_size": 256,
        "intermediate_size": 768,
        "num_hidden_layers": len(layer_types),
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 64,
        "vocab_size": vocab,
        "max_position_embeddings": 1048576,
        "sliding_window": 64,
        "layer_types": layer_types,
        "rope_parameters": {
            "full_attention": {"partial_rotary_factor": 0.25, "rope_theta": 5000000, "rope_type": "default"},
            "sliding_attention": {"partial_rotary_factor": 1.0, "rope_theta": 10000, "rope_type": "default"},
        },
        "rms_norm_eps": 1e-06,
        "hidden_act": "gelu",
        "headwise_attn_output_gate": True,
        "gate_attn_act_mode": "sigmoid",
        "attention_bias": False,
        "mlp_bias": False,
        "attention_dropout": 0.0,
        "tie_word_embeddings": True,
        "bos_token_id": 0,
        "eos_token_id": 1,
        "pad_token_id": 2,
        "dtype": "bfloat16",
        "use_cache": True,
        "transformers_version": "4.57.1",
        "initializer_range": 0.02,
    }


class Spark(torch.nn.Module):
    def __init__(self, c: dict):
        super().__init__()
        self.c = c
        H, hd = c["hidden_size"], c["head_dim"]
        self.nh, self.nkv, self.hd = c["num_attention_heads"], c["num_key_value_heads"], hd
        q_dim, kv_dim = self.nh * hd, self.nkv * hd
        std = c["initializer_range"]

        def lin(o, i):
            return torch.nn.Parameter(torch.randn(o, i) * std)

        self.embedding = torch.nn.Parameter(torch.randn(c["vocab_size"], H) * std)
        self.layers = torch.nn.ModuleList()
        for _ in range(c["num_hidden_layers"]):
            m = torch.nn.Module()
            m.ln_in = torch.nn.Parameter(torch.ones(H))
            m.qkv = lin(q_dim + 2 * kv_dim, H)
            m.g = lin(self.nh, H)
            m.out = lin(H, q_dim)
            m.ln_post = torch.nn.Parameter(torch.ones(H))
            m.gate = lin(c["intermediate_size"], H)
            m.up = lin(c["intermediate_size"], H)
            m.down = lin(H, c["intermediate_size"])
            self.layers.append(m)
        self.norm = torch.nn.Parameter(torch.ones(H))

    def rope_tables(self, T: int, kind: str):
        p = self.c["rope_parameters"][kind]
        R = int(self.hd * p["partial_rotary_factor"])
        inv = 1.0 / (float(p["rope_theta"]) ** (torch.arange(0, R, 2, dtype=torch.float32) / R))
        ang = torch.arange(T, dtype=torch.float32)[:, None] * inv[None, :]
        return R, torch.cos(ang), torch.sin(ang)

    @staticmethod
    def rope(x, R, cos, sin):
        r, rest = x[..., :R], x[..., R:]
        a, b = r[..., : R // 2], r[..., R // 2:]
        return torch.cat([a * cos - b * sin, b * cos + a * sin, rest], dim=-1)

    def rms(self, x, w):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.c["rms_norm_eps"]) * w

    def forward(self, ids):
        B, T = ids.shape
        c = self.c
        x = self.embedding[ids]
        i = torch.arange(T)
        causal = i[None, :] <= i[:, None]
        masks = {"full_attention": causal,
                 "sliding_attention": causal & (i[None, :] > i[:, None] - c["sliding_window"])}
        tables = {k: self.rope_tables(T, k) for k in masks}
        q_dim, kv_dim = self.nh * self.hd, self.nkv * self.hd
        for kind, m in zip(c["layer_types"], self.layers):
            h = self.rms(x, m.ln_in)
            qkv = h @ m.qkv.T
            q = qkv[..., :q_dim].view(B, T, self.nh, self.hd).transpose(1, 2)
            k = qkv[..., q_dim:q_dim + kv_dim].view(B, T, self.nkv, self.hd).transpose(1, 2)
            v = qkv[..., q_dim + kv_dim:].view(B, T, self.nkv, self.hd).transpose(1, 2)
            R, cos, sin = tables[kind]
            q, k = self.rope(q, R, cos, sin), self.rope(k, R, cos, sin)
            rep = self.nh // self.nkv
            k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
            a = F.scaled_dot_product_attention(q, k, v, attn_mask=masks[kind], scale=self.hd ** -0.5)
            gate = torch.sigmoid(h @ m.g.T).transpose(1, 2)[..., None]  # [B, nh, T, 1]
            a = (a * gate).transpose(1, 2).reshape(B, T, q_dim)
            x = x + a @ m.out.T
            h2 = self.rms(x, m.ln_post)
            x = x + (F.gelu(h2 @ m.gate.T) * (h2 @ m.up.T)) @ m.down.T
        return self.rms(x, self.norm) @ self.embedding.T

    def state_dict_hf(self) -> dict:
        sd = {"model.embedding.weight": self.embedding, "model.norm.weight": self.norm}
        for i, m in enumerate(self.layers):
            p = f"model.layers.{i}."
            sd[p + "input_layernorm.weight"] = m.ln_in
            sd[p + "self_attn.q_k_v_proj.weight"] = m.qkv
            sd[p + "self_attn.g_proj.weight"] = m.g
            sd[p + "self_attn.out_proj.weight"] = m.out
            sd[p + "post_attention_layernorm.weight"] = m.ln_post
            sd[p + "mlp.gate_proj.weight"] = m.gate
            sd[p + "mlp.up_proj.weight"] = m.up
            sd[p + "mlp.down_proj.weight"] = m.down
        return {k: v.detach().to(torch.bfloat16).contiguous() for k, v in sd.items()}


def batches(stream: torch.Tensor, batch: int, seq: int, gen: torch.Generator):
    while True:
        starts = torch.randint(0, len(stream) - seq - 1, (batch,), generator=gen)
        chunk = torch.stack([stream[s:s + seq + 1] for s in starts])
        yield chunk[:, :-1], chunk[:, 1:]


@torch.no_grad()
def held_out_ppl(model, stream, seq, max_windows=48):
    total, n = 0.0, 0
    for s in range(0, min(len(stream) - seq - 1, max_windows * seq), seq):
        chunk = stream[s:s + seq + 1][None]
        logits = model(chunk[:, :-1])
        total += F.cross_entropy(logits.flatten(0, 1), chunk[:, 1:].flatten(), reduction="sum").item()
        n += seq
    return math.exp(total / n)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=Path("fixtures/spark-tiny"))
    ap.add_argument("--steps", type=int, default=1200)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=256, help="4x the sliding window so the window is exercised")
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--vocab", type=int, default=4096)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--corpus", choices=sorted(CORPORA), default="spark",
                    help="spark: fixtures/spark-tiny's text; docs: the Rust books (fixtures/spark-docs)")
    args = ap.parse_args()
    torch.manual_seed(args.seed)
    args.out.mkdir(parents=True, exist_ok=True)

    train_docs, held_docs = (docs_corpus if args.corpus == "docs" else spark_corpus).corpus()
    tok = fixture_tokenizer.build(train_docs, args.vocab)
    fixture_tokenizer.write(tok, args.out, CHAT_TEMPLATE)
    enc = lambda docs: torch.tensor([t for d in docs for t in tok.encode(d).ids], dtype=torch.long)  # noqa: E731
    train, held = enc(train_docs), enc(held_docs)
    print(f"train tokens {len(train)}, held-out tokens {len(held)}", flush=True)

    cfg = spark_config(args.vocab)
    model = Spark(cfg)
    n_params = sum(p.numel() for p in model.parameters())
    decay = [p for p in model.parameters() if p.dim() == 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.05}, {"params": no_decay, "weight_decay": 0.0}],
                            lr=args.lr, betas=(0.9, 0.95))
    warm = max(1, args.steps // 20)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min(1.0, (s + 1) / warm) * 0.5 * (1 + math.cos(math.pi * min(1.0, s / args.steps))))
    gen = torch.Generator().manual_seed(args.seed)
    it = batches(train, args.batch, args.seq, gen)
    curve, t0, smooth = [], time.time(), None
    for step in range(1, args.steps + 1):
        x, y = next(it)
        loss = F.cross_entropy(model(x).flatten(0, 1), y.flatten())
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        smooth = loss.item() if smooth is None else 0.95 * smooth + 0.05 * loss.item()
        if step % 50 == 0 or step == 1:
            row = {"step": step, "loss": round(smooth, 4), "elapsed_s": round(time.time() - t0, 1)}
            if step % 300 == 0 or step == args.steps:
                row["held_out_ppl"] = round(held_out_ppl(model, held, args.seq), 2)
            curve.append(row)
            print(json.dumps(row), flush=True)
    final_ppl = held_out_ppl(model, held, args.seq)

    from safetensors.torch import save_file

    (args.out / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    gen_cfg = {"bos_token_id": 0, "eos_token_id": 1, "pad_token_id": 2, "do_sample": True,
               "temperature": 1.0, "top_p": 0.95, "top_k": -1, "repetition_penalty": 1.0,
               "transformers_version": "4.57.1"}
    (args.out / "generation_config.json").write_text(json.dumps(gen_cfg, indent=2) + "\n")
    save_file(model.state_dict_hf(), str(args.out / "model.safetensors"), metadata={"format": "pt"})
    (args.out / "training_curve.json").write_text(json.dumps(curve, indent=1) + "\n")

    lines = [
        f"# {args.out.name}: how it was trained", "",
        f"Command: `python3 tools/train_fixture.py --out {args.out} --steps {args.steps} --batch {args.batch} "
        f"--seq {args.seq} --lr {args.lr} --vocab {args.vocab} --seed {args.seed} --corpus {args.corpus}` "
        f"(torch {torch.__version__}, {torch.get_num_threads()} threads, {time.time() - t0:.0f} s).", "",
        f"Parameters: {n_params:,} (tied head), stored bf16. Tokens: {len(train):,} train, "
        f"{len(held):,} held out ({CORPORA[args.corpus][0]}).", "",
        CORPORA[args.corpus][1], "",
        f"**Held-out perplexity (fp32 weights, seq {args.seq}): {final_ppl:.2f}** "
        f"(uniform over the vocab would be {args.vocab}).", "",
        "| step | train loss (EMA) | held-out ppl | elapsed s |", "|---:|---:|---:|---:|",
    ]
    for r in curve:
        lines.append(f"| {r['step']} | {r['loss']:.3f} | {r.get('held_out_ppl', '')} | {r['elapsed_s']} |")
    (args.out / "TRAINING.md").write_text("\n".join(lines) + "\n")
    print(f"done: held-out ppl {final_ppl:.2f}")


if __name__ == "__main__":
    main()
