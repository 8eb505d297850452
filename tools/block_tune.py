#!/usr/bin/env python3
"""Block tuning of a spark-tool GPTQ checkpoint: a measurement prototype for issue #15 (docs/FIDELITY.md).

GPTQ fits each linear to its own output; this fits each decoder *block* to the float model's block output,
so that the errors of q_k_v, out, gate, up and down may cancel through attention, GELU and the product.
Layer by layer, in order (as in GPTAQ, the float model's output is the target and the input is the stream of
the already tuned quantized layers below):

- every code may move by one step: code = clamp(round(q − 8 + V), −8, 7), V ∈ [−0.5, 0.5], straight-through
  rounding (AutoRound's parameterization, started from the GPTQ codes instead of from round-to-nearest);
- every group scale takes a factor in [0.5, 1.5];
- optionally (`--norms`) the two RMSNorm gains of the block, which stay bf16 in the checkpoint, take a factor;
- the block's output MSE over a random batch of calibration windows is minimised by Adam (or signed SGD,
  AutoRound's optimiser) with a linearly decaying step; every `--check` steps the state is scored on all
  windows and the best one is kept; a layer whose error did not fall keeps the GPTQ solution unchanged.

The output is a copy of the checkpoint with qweight, scales (and the norms) patched in place: the same GPTQ v1
layout, same shapes and dtypes, zero point 8, so vLLM and `spark-tool run`/`parity` take it as before.

    python3 tools/block_tune.py fixtures/spark-tiny GPTQ_DIR OUT_DIR --calibration calib.jsonl --norms 1e-3

Calibration windows are cut exactly as `spark-tool quantize` cuts them (documents tokenized without special
tokens, concatenated, `--samples` windows of `--seq-len`). Packages: tools/requirements-blocktune.txt.
"""

from __future__ import annotations

import argparse
import json
import shutil
import struct
import sys
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from tokenizers import Tokenizer

sys.path.insert(0, str(Path(__file__).resolve().parent))
import gptq_decode  # noqa: E402
import st_numpy  # noqa: E402

# The quantized linears of a layer as the checkpoint stores them (q_k_v stays fused, as vLLM loads it).
LINEARS = {"qkv": "self_attn.q_k_v_proj", "out": "self_attn.out_proj", "gate": "mlp.gate_proj",
           "up": "mlp.up_proj", "down": "mlp.down_proj"}
NORMS = {"ln_in": "input_layernorm.weight", "ln_post": "post_attention_layernorm.weight"}
CHUNK = 8  # windows per forward when scoring all of them


def windows(model: Path, calib: Path, samples: int, seq: int) -> torch.Tensor:
    tok = Tokenizer.from_file(str(model / "tokenizer.json"))
    stream, need = [], samples * seq
    for line in calib.read_text(encoding="utf-8").splitlines():
        if len(stream) >= need:
            break
        if line.strip():
            stream.extend(tok.encode(json.loads(line)["text"], add_special_tokens=False).ids)
    if len(stream) < need:
        sys.exit(f"{calib}: {len(stream)} tokens, {samples} x {seq} = {need} needed")
    return torch.tensor(stream[:need]).view(samples, seq)


def bf16(x: torch.Tensor) -> torch.Tensor:
    return torch.tensor(st_numpy.to_bf16_bits(x.detach().numpy()).astype(np.uint32) << 16).view(torch.float32)


def int8_tokens(x: torch.Tensor) -> torch.Tensor:
    """W4A8's per-token symmetric int8 rounding of a linear's input, straight-through."""
    s = x.abs().amax(-1, keepdim=True).clamp_min(1e-12) / 127.0
    return x + (torch.round(x / s).clamp(-127, 127) * s - x).detach()


class Block:
    """One Spark decoder layer in f32 (docs/MODEL.md): gated GQA attention with per-type RoPE and mask, GELU MLP."""

    def __init__(self, c: dict, T: int):
        self.eps = c["rms_norm_eps"]
        self.nh, self.nkv, self.hd = c["num_attention_heads"], c["num_key_value_heads"], c["head_dim"]
        i = torch.arange(T)
        causal = i[None, :] <= i[:, None]
        self.masks = {"full_attention": causal,
                      "sliding_attention": causal & (i[None, :] > i[:, None] - c["sliding_window"])}
        self.rope_tables = {}
        for kind in self.masks:
            p = c["rope_parameters"][kind]
            R = int(self.hd * p["partial_rotary_factor"])
            inv = 1.0 / (float(p["rope_theta"]) ** (torch.arange(0, R, 2, dtype=torch.float32) / R))
            ang = torch.arange(T, dtype=torch.float32)[:, None] * inv[None, :]
            self.rope_tables[kind] = (R, torch.cos(ang), torch.sin(ang))

    def rms(self, x, w):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * w

    @staticmethod
    def rope(x, R, cos, sin):
        r, rest = x[..., :R], x[..., R:]
        a, b = r[..., : R // 2], r[..., R // 2:]
        return torch.cat([a * cos - b * sin, b * cos + a * sin, rest], dim=-1)

    def __call__(self, x, L: dict, kind: str, int8_inputs: bool = False):
        B, T, _ = x.shape
        q_dim, kv_dim = self.nh * self.hd, self.nkv * self.hd
        lin_in = int8_tokens if int8_inputs else (lambda t: t)
        h = self.rms(x, L["ln_in"])
        qkv = lin_in(h) @ L["qkv"].T
        q = qkv[..., :q_dim].view(B, T, self.nh, self.hd).transpose(1, 2)
        k = qkv[..., q_dim:q_dim + kv_dim].view(B, T, self.nkv, self.hd).transpose(1, 2)
        v = qkv[..., q_dim + kv_dim:].view(B, T, self.nkv, self.hd).transpose(1, 2)
        R, cos, sin = self.rope_tables[kind]
        q, k = self.rope(q, R, cos[:T], sin[:T]), self.rope(k, R, cos[:T], sin[:T])
        rep = self.nh // self.nkv
        k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
        a = F.scaled_dot_product_attention(q, k, v, attn_mask=self.masks[kind][:T, :T], scale=self.hd ** -0.5)
        gate = torch.sigmoid(h @ L["g"].T).transpose(1, 2)[..., None]  # g_proj stays 16-bit
        a = (a * gate).transpose(1, 2).reshape(B, T, q_dim)
        x = x + lin_in(a) @ L["out"].T
        h2 = self.rms(x, L["ln_post"])
        m = F.gelu(lin_in(h2) @ L["gate"].T) * (lin_in(h2) @ L["up"].T)
        return x + lin_in(m) @ L["down"].T


def ste_round(z):
    return z + (torch.round(z) - z).detach()


class QLinear:
    """GPTQ codes q − 8 [N, K] and scales [N, K/G], with the tuned offsets V and scale factors a."""

    def __init__(self, codes: np.ndarray, scales: np.ndarray, G: int):
        self.q = torch.tensor(codes.T.astype(np.float32) - 8.0)
        self.s = torch.tensor(scales.T.astype(np.float32))
        self.G = G
        self.V = torch.zeros_like(self.q, requires_grad=True)
        self.a = torch.ones_like(self.s, requires_grad=True)

    def weight(self) -> torch.Tensor:
        codes = torch.clamp(ste_round(self.q + self.V), -8, 7)
        return codes * (self.s * self.a).repeat_interleave(self.G, dim=1)

    def stored(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(codes q − 8 [N, K], scales [N, K/G] rounded to fp16) as the checkpoint will hold them."""
        with torch.no_grad():
            return torch.clamp(torch.round(self.q + self.V), -8, 7), (self.s * self.a).half().float()

    def stored_weight(self) -> torch.Tensor:
        c, s = self.stored()
        return c * s.repeat_interleave(self.G, dim=1)

    def export(self) -> tuple[np.ndarray, np.ndarray]:
        """(codes 0..15 [K, N], fp16 scales [K/G, N]) in the checkpoint's orientation."""
        c, s = self.stored()
        return (c + 8).to(torch.int64).numpy().T, s.numpy().T.astype(np.float16)


def patch_checkpoint(src: Path, out: Path, linears: dict, norms: dict) -> None:
    """Copy src to out and overwrite the tuned tensors in place (same shapes and dtypes); out appears whole."""
    tmp = out.with_name("." + out.name + ".partial")
    if tmp.exists():
        shutil.rmtree(tmp)
    shutil.copytree(src, tmp)
    path = tmp / "model.safetensors"
    raw = bytearray(path.read_bytes())
    (n,) = struct.unpack("<Q", raw[:8])
    header, base = json.loads(raw[8:8 + n]), 8 + n

    def put(name, data):
        o0, o1 = header[name]["data_offsets"]
        if o1 - o0 != len(data):
            sys.exit(f"{path}: {name} has {o1 - o0} bytes, {len(data)} tuned")
        raw[base + o0:base + o1] = data

    for pre, (codes, scales) in linears.items():
        words = np.zeros((codes.shape[0] // 8, codes.shape[1]), dtype=np.int64)
        for j in range(8):  # GPTQ v1: input row 8r + j in bits 4j..4j+3 of word [r, n]
            words |= codes[j::8].astype(np.int64) << (4 * j)
        put(pre + ".qweight", words.astype(np.uint32).view(np.int32).astype("<i4").tobytes())
        put(pre + ".scales", scales.astype("<f2").tobytes())
    for name, v in norms.items():
        put(name, st_numpy.to_bf16_bits(v).astype("<u2").tobytes() if header[name]["dtype"] == "BF16"
            else v.astype("<f4").tobytes())
    path.write_bytes(bytes(raw))
    tmp.rename(out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model", type=Path, help="the float checkpoint the GPTQ checkpoint was made from")
    ap.add_argument("gptq", type=Path, help="a GPTQ v1 checkpoint written by spark-tool quantize")
    ap.add_argument("out", type=Path, help="new folder for the tuned copy (must not exist)")
    ap.add_argument("--calibration", type=Path, required=True)
    ap.add_argument("--samples", type=int, default=128)
    ap.add_argument("--seq-len", type=int, default=512)
    ap.add_argument("--iters", type=int, default=200)
    ap.add_argument("--batch", type=int, default=8, help="windows per step")
    ap.add_argument("--optimizer", choices=["adam", "sign"], default="adam")
    ap.add_argument("--lr", type=float, default=2e-2, help="step for the code offsets (scale factors: lr / 5)")
    ap.add_argument("--norms", type=float, default=0.0, help="step for the norms' gain factors (0: not tuned)")
    ap.add_argument("--check", type=int, default=25, help="score all windows every N steps, keep the best (0: off)")
    ap.add_argument("--int8-inputs", action="store_true", help="tune with W4A8's int8-rounded linear inputs")
    ap.add_argument("--layers", type=int, help="tune only the first N layers (the rest stay as GPTQ wrote them)")
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args()
    if a.out.exists():
        sys.exit(f"{a.out} exists; choose a new folder")
    torch.manual_seed(a.seed)
    c = json.loads((a.model / "config.json").read_text())
    G = json.loads((a.gptq / "quantize_config.json").read_text())["group_size"]
    fw = {k: torch.from_numpy(v if v.flags.writeable else v.copy())  # no second copy of a 1.7B model
          for k, v in st_numpy.read_checkpoint(a.model).items()}
    qt = st_numpy.read_checkpoint(a.gptq)
    ids = windows(a.model, a.calibration, a.samples, a.seq_len)
    block = Block(c, a.seq_len)
    xf = fw["model.embedding.weight"][ids]
    xq = xf.clone()
    tuned_linears, tuned_norms = {}, {}
    t0 = time.time()
    for li, kind in enumerate(c["layer_types"][: a.layers]):
        p = f"model.layers.{li}."
        Lf = {"g": fw[p + "self_attn.g_proj.weight"], **{k: fw[p + n] for k, n in NORMS.items()},
              **{k: fw[p + n + ".weight"] for k, n in LINEARS.items()}}
        ql = {k: QLinear(gptq_decode.unpack_along_rows(qt[p + n + ".qweight"]), qt[p + n + ".scales"], G)
              for k, n in LINEARS.items()}
        fixed = {"g": torch.tensor(qt[p + "self_attn.g_proj.weight"]),
                 **{k: torch.tensor(qt[p + n]) for k, n in NORMS.items()}}
        gains = {k: torch.ones_like(fixed[k], requires_grad=True) for k in NORMS}

        def weights(stored=False):
            w = {k: (q.stored_weight() if stored else q.weight()) for k, q in ql.items()}
            norms = {k: fixed[k] * gains[k] for k in NORMS}
            if stored:
                norms = {k: bf16(v) for k, v in norms.items()}
            return {**fixed, **norms, **w}

        tensors = [t for q in ql.values() for t in (q.V, q.a)] + list(gains.values())

        def snapshot():
            return [t.detach().clone() for t in tensors]

        def restore(state):
            with torch.no_grad():
                for t, v in zip(tensors, state):
                    t.copy_(v)

        with torch.no_grad():
            y = torch.cat([block(xf[i:i + CHUNK], Lf, kind) for i in range(0, a.samples, CHUNK)])

            def error(W):  # output MSE on all windows, relative to the target's mean square
                se = sum(F.mse_loss(block(xq[i:i + CHUNK], W, kind, a.int8_inputs), y[i:i + CHUNK],
                                    reduction="sum").item() for i in range(0, a.samples, CHUNK))
                return se / y.pow(2).sum().item()

            initial = snapshot()
            before = error(weights(stored=True))
        # Adam moves the scale factors at a fifth of the offsets' step; signed SGD moves both alike (AutoRound).
        groups = [([q.V for q in ql.values()], a.lr),
                  ([q.a for q in ql.values()], a.lr / 5 if a.optimizer == "adam" else a.lr)]
        if a.norms:
            groups.append((list(gains.values()), a.norms))
        opt = torch.optim.Adam([{"params": ps, "lr": lr} for ps, lr in groups]) if a.optimizer == "adam" else None
        best = (before, initial)
        t_steps = time.time()
        for it in range(a.iters):
            if a.check and it and it % a.check == 0:
                with torch.no_grad():
                    e = error(weights(stored=True))
                if e < best[0]:
                    best = (e, snapshot())
            idx = torch.randperm(a.samples)[: a.batch]
            loss = F.mse_loss(block(xq[idx], weights(), kind, a.int8_inputs), y[idx])
            for t in tensors:
                t.grad = None
            loss.backward()
            decay = 1 - it / a.iters
            with torch.no_grad():
                if opt is None:
                    for ps, lr in groups:
                        for t in ps:
                            t -= lr * decay * torch.sign(t.grad)
                else:
                    for g, (_, lr) in zip(opt.param_groups, groups):
                        g["lr"] = lr * decay
                    opt.step()
                for q in ql.values():
                    q.V.clamp_(-0.5, 0.5)
                    q.a.clamp_(0.5, 1.5)
        t_steps = (time.time() - t_steps) / max(a.iters, 1)
        with torch.no_grad():
            after = error(weights(stored=True))
            if best[0] < after:
                restore(best[1])
                after = best[0]
            if after >= before:  # tuning did not help on all windows: keep the GPTQ solution
                restore(initial)
                after = before
            W = weights(stored=True)
            moved = sum(int((q.stored()[0] != q.q).sum()) for q in ql.values())
            total = sum(q.q.numel() for q in ql.values())
            print(f"layer {li} ({kind}): block output error {before:.4e} -> {after:.4e} ({after / before - 1:+.1%}), "
                  f"codes moved {moved}/{total}, {t_steps:.2f} s per step, {time.time() - t0:.0f} s", flush=True)
            for k, n in LINEARS.items():
                tuned_linears[p + n] = ql[k].export()
            for k, n in NORMS.items():
                tuned_norms[p + n] = W[k].numpy()
            xq = torch.cat([block(xq[i:i + CHUNK], W, kind) for i in range(0, a.samples, CHUNK)])
            xf = y
    patch_checkpoint(a.gptq, a.out, tuned_linears, tuned_norms)
    print(f"wrote {a.out} in {time.time() - t0:.0f} s")


if __name__ == "__main__":
    main()
