#!/usr/bin/env python3
"""Independent numpy reference of Spark2_5 (float64), written from docs/MODEL.md §4–§10.

It shares no code with the Rust engine and deliberately works differently:
whole-sequence attention with explicit masks (no KV cache, no ring buffer),
float64 throughout, weights widened from bf16/f16/f32. Golden outputs for the
Rust tests come from here.

    python3 tools/spark_ref.py golden fixtures/spark-tiny   # prompts: tests/golden/prompts/spark-tiny.json
    python3 tools/spark_ref.py logits fixtures/spark-tiny --tokens 0,4084,53
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np
from scipy.special import erf

sys.path.insert(0, str(Path(__file__).resolve().parent))
import st_numpy  # noqa: E402


class SparkRef:
    def __init__(self, folder: Path):
        self.folder = Path(folder)
        self.c = json.loads((self.folder / "config.json").read_text())
        c = self.c
        assert c["model_type"] == "spark2_5" and c["hidden_act"] == "gelu"
        w = {k: v.astype(np.float64) for k, v in st_numpy.read_checkpoint(self.folder).items()}
        self.w = w
        self.nh, self.nkv, self.hd = c["num_attention_heads"], c["num_key_value_heads"], c["head_dim"]
        self.q_dim, self.kv_dim = self.nh * self.hd, self.nkv * self.hd
        self.emb = w["model.embedding.weight"]
        tied = c.get("tie_word_embeddings", "lm_head.weight" not in w)
        self.head = self.emb if tied else w["lm_head.weight"]

    def _rms(self, x, weight):
        return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + self.c["rms_norm_eps"]) * weight

    def _rope(self, x, kind, T):
        """x: [heads, T, hd]; NeoX rotate-half on the first R dims, denominator R."""
        p = self.c["rope_parameters"][kind]
        R = int(round(self.hd * p.get("partial_rotary_factor", 1.0)))
        j = np.arange(R // 2, dtype=np.float64)
        inv = float(p["rope_theta"]) ** (-2.0 * j / R)
        ang = np.arange(T, dtype=np.float64)[:, None] * inv[None, :]
        cos, sin = np.cos(ang), np.sin(ang)
        a, b, rest = x[..., : R // 2], x[..., R // 2:R], x[..., R:]
        return np.concatenate([a * cos - b * sin, b * cos + a * sin, rest], axis=-1)

    def qkv(self, p, h):
        fused = p + "self_attn.q_k_v_proj.weight"
        if fused in self.w:
            W = self.w[fused]
            return h @ W[:self.q_dim].T, h @ W[self.q_dim:self.q_dim + self.kv_dim].T, h @ W[self.q_dim + self.kv_dim:].T
        return tuple(h @ self.w[p + f"self_attn.{n}_proj.weight"].T for n in "qkv")

    def forward(self, ids: list[int]) -> np.ndarray:
        """Logits [T, vocab] for every position of `ids` (positions 0..T-1)."""
        c, T = self.c, len(ids)
        x = self.emb[np.asarray(ids)]
        i = np.arange(T)
        allowed = {"full_attention": i[None, :] <= i[:, None]}
        allowed["sliding_attention"] = allowed["full_attention"] & (i[None, :] > i[:, None] - c.get("sliding_window", T))
        for li, kind in enumerate(c["layer_types"]):
            p = f"model.layers.{li}."
            h = self._rms(x, self.w[p + "input_layernorm.weight"])
            q, k, v = self.qkv(p, h)
            q = self._rope(q.reshape(T, self.nh, self.hd).transpose(1, 0, 2), kind, T)
            k = self._rope(k.reshape(T, self.nkv, self.hd).transpose(1, 0, 2), kind, T)
            v = v.reshape(T, self.nkv, self.hd).transpose(1, 0, 2)
            rep = self.nh // self.nkv
            k, v = np.repeat(k, rep, axis=0), np.repeat(v, rep, axis=0)  # head h -> kv head h // rep
            s = q @ k.transpose(0, 2, 1) / np.sqrt(self.hd)
            s = np.where(allowed[kind][None], s, -np.inf)
            s = np.exp(s - s.max(-1, keepdims=True))
            a = (s / s.sum(-1, keepdims=True)) @ v  # [nh, T, hd]
            g = 1.0 / (1.0 + np.exp(-(h @ self.w[p + "self_attn.g_proj.weight"].T)))  # [T, nh]
            a = a * g.T[:, :, None]
            x = x + a.transpose(1, 0, 2).reshape(T, self.q_dim) @ self.w[p + "self_attn.out_proj.weight"].T
            h2 = self._rms(x, self.w[p + "post_attention_layernorm.weight"])
            gate = h2 @ self.w[p + "mlp.gate_proj.weight"].T
            act = 0.5 * gate * (1.0 + erf(gate / np.sqrt(2.0)))
            x = x + (act * (h2 @ self.w[p + "mlp.up_proj.weight"].T)) @ self.w[p + "mlp.down_proj.weight"].T
        return self._rms(x, self.w["model.norm.weight"]) @ self.head.T

    def greedy(self, ids: list[int], n: int) -> tuple[list[int], list[float]]:
        """n greedy tokens (ties to the lowest id), recomputing the whole sequence each step.
        Also returns the top-1 minus top-2 logit margin of each step."""
        seq, out, margins = list(ids), [], []
        for _ in range(n):
            last = self.forward(seq)[-1]
            t = int(np.argmax(last))
            top2 = np.partition(last, -2)[-2:]
            margins.append(float(top2[1] - top2[0]))
            out.append(t)
            seq.append(t)
        return out, margins


def load_prompts(path: Path) -> list[dict]:
    return json.loads(Path(path).read_text())["prompts"]


def tokenize(folder: Path, prompts: list[dict]) -> list[dict]:
    """Fill `tokens` for text prompts with the Python `tokenizers` package; chat prompts are
    rendered in the chat frame first (docs/MODEL.md §13)."""
    out = []
    tok = None
    for pr in prompts:
        pr = dict(pr)
        if "tokens" not in pr:
            if tok is None:
                from tokenizers import Tokenizer
                tok = Tokenizer.from_file(str(Path(folder) / "tokenizer.json"))
            text = pr["text"]
            if pr.get("chat"):
                B, E = "<｜start▁of▁sentence｜>", "<｜end▁of▁sentence｜>"
                sys_part = f"\n\n{pr['system']}" if pr.get("system") else ""
                text = (f"{B}<|System|>\nyou are a helpful assistant.{sys_part}{E}{B}<|User|>{text}{E}{B}<|Bot|>"
                        + ("<think>" if pr.get("thinking", True) else "</think>"))
            pr["tokens"] = tok.encode(text, add_special_tokens=False).ids
        out.append(pr)
    return out


def cmd_golden(a) -> None:
    ref = SparkRef(a.model)
    prompts = tokenize(a.model, load_prompts(a.prompts))
    tensors, entries = {}, []
    for i, pr in enumerate(prompts):
        logits = ref.forward(pr["tokens"])
        greedy, margins = ref.greedy(pr["tokens"], a.greedy)
        tensors[f"p{i}.logits"] = (a.dtype, logits.astype(np.float32))
        entries.append({**pr, "greedy": greedy, "greedy_margins": [round(m, 6) for m in margins]})
        print(f"  {pr['name']}: {len(pr['tokens'])} tokens, greedy {greedy[:8]}...", flush=True)
    a.out.mkdir(parents=True, exist_ok=True)
    name = Path(a.model).name
    st_numpy.write_file(a.out / f"{name}.safetensors", tensors, {"generator": "tools/spark_ref.py (numpy float64)"})
    meta = {"fixture": name, "generator": "tools/spark_ref.py (numpy float64, whole-sequence recompute)",
            "logits_dtype": a.dtype, "greedy_tokens": a.greedy, "prompts": entries}
    (a.out / f"{name}.json").write_text(json.dumps(meta, indent=1, ensure_ascii=False) + "\n")
    print(f"wrote {a.out / name}.json/.safetensors")


def cmd_logits(a) -> None:
    ref = SparkRef(a.model)
    ids = [int(t) for t in a.tokens.split(",")]
    logits = ref.forward(ids)
    for t, row in enumerate(logits):
        top = np.argsort(-row, kind="stable")[:5]
        print(t, [(int(i), round(float(row[i]), 4)) for i in top])


GREEDY_TIE = 1e-6


def cmd_compare(a) -> None:
    """Committed goldens (f16 logits) must equal freshly generated ones up to storage rounding.

    The tolerance, |Δ| <= 2^-10·|x| + 1e-6, is twice f16's rounding of the committed copy (2^-11
    relative) plus an absolute term for values near zero; a float64 forward through another BLAS
    moves a logit by ~1e-13, far inside it."""
    old = json.loads(Path(f"{a.committed}.json").read_text())
    new = json.loads(Path(f"{a.fresh}.json").read_text())
    ot, nt = st_numpy.read_file(Path(f"{a.committed}.safetensors")), st_numpy.read_file(Path(f"{a.fresh}.safetensors"))
    problems = []
    for i, (po, pn) in enumerate(zip(old["prompts"], new["prompts"])):
        if po["tokens"] != pn["tokens"]:
            problems.append(f"{po['name']}: tokens differ")
        # Greedy tokens are discrete, but a step whose top-2 margin is within float64 noise of the
        # BLAS build (~1e-13 here; GREEDY_TIE leaves seven orders of magnitude) may pick either
        # token, and everything after it legitimately differs.
        for step, (was, now) in enumerate(zip(po["greedy"], pn["greedy"])):
            if was != now:
                if min(po["greedy_margins"][step], pn["greedy_margins"][step]) >= GREEDY_TIE:
                    problems.append(f"{po['name']}: greedy token {step} is {now}, committed {was}")
                break
        if len(po["greedy"]) != len(pn["greedy"]):
            problems.append(f"{po['name']}: greedy lengths differ")
        lo, ln = ot[f"p{i}.logits"].astype(np.float64), nt[f"p{i}.logits"].astype(np.float64)
        if lo.shape != ln.shape or np.any(np.abs(lo - ln) > np.abs(ln) * 2.0 ** -10 + 1e-6):
            problems.append(f"{po['name']}: logits differ beyond f16 rounding")
    if len(old["prompts"]) != len(new["prompts"]):
        problems.append("prompt count differs")
    if problems:
        sys.exit(f"{a.committed}: committed goldens are stale (regenerate with `spark_ref.py golden`):\n  "
                 + "\n  ".join(problems))
    print(f"{a.committed}: committed goldens match the reference")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    g = sub.add_parser("golden", help="write golden logits + greedy tokens for a prompt set")
    g.add_argument("model", type=Path)
    g.add_argument("--prompts", type=Path, help="prompt set JSON (default: tests/golden/prompts/NAME.json)")
    g.add_argument("--out", type=Path, default=Path("tests/golden"))
    g.add_argument("--dtype", choices=["F16", "F32"], default="F16",
                   help="storage dtype of the logits (F16 keeps committed goldens small)")
    g.add_argument("--greedy", type=int, default=32)
    lg = sub.add_parser("logits", help="print top-5 logits per position")
    lg.add_argument("model", type=Path)
    lg.add_argument("--tokens", required=True)
    cp = sub.add_parser("compare", help="check committed goldens against freshly generated ones")
    cp.add_argument("committed", help="path prefix, e.g. tests/golden/spark-tiny")
    cp.add_argument("fresh", help="path prefix of the fresh set")
    a = ap.parse_args()
    if a.cmd == "compare":
        cmd_compare(a)
    elif a.cmd == "golden":
        a.prompts = a.prompts or Path("tests/golden/prompts") / f"{Path(a.model).name}.json"
        cmd_golden(a)
    else:
        cmd_logits(a)


if __name__ == "__main__":
    main()
