#!/usr/bin/env python3
"""QNN HTP readiness check of a `spark-tool export-phone` folder, offline on x86-64 Linux.

Uses Qualcomm's own HTP backend shipped in the `onnxruntime-qnn` plugin package (its HTP
simulator runs on x86; docs/PHONE_IO.md §10): for every part of the export it
  1. creates a session on the QNN EP with CPU fallback *disabled* and soc_model SM8750
     (HTP v79) — any node QNN cannot place on HTP makes this fail, naming the node;
  2. reads the EP's framework op trace: unsupported nodes, QNN op counts, and `Convert`
     ops (the EP inserts them for u16×u16 attention matmuls, which lose precision);
  3. compiles an offline context binary and checks its header names soc_type=SM8750;arch=79;
  4. with --run, drives the export on ONNX Runtime CPU with the app's step loop over --steps
     tokens it samples from its own logits (so caches and residual stream hold what the model
     really writes there), then runs the next --compare steps in the simulator and on the CPU
     on the same inputs and reports, per output over all compared steps: the SNR of simulator
     vs CPU, and of each against the same graph with float activations (its activation
     Q/DQ pairs removed), which separates what the HTP adds from what the 16-bit grid costs
     both. `--state random` is the older check: one step, cache integers drawn inside their
     encodings, a random embedding row.
Exit 0 when every part is ready (and, with --run, every output reaches --min-snr dB and the HTP's
SNR against float activations is at most --max-excess dB below the CPU's).

    python tools/qnn_check.py EXPORT_DIR [--run] [--json report.json]
Needs: pip install onnxruntime-qnn==2.7.0 onnx numpy (tools/requirements-qnn.txt), Python 3.11, glibc >= 2.35.
"""
import argparse
import glob
import json
import os
import re
import shutil
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from st_numpy import read_file  # noqa: E402

DTYPES = {"float32": np.float32, "int16": np.int16, "uint16": np.uint16, "uint8": np.uint8,
          "int8": np.int8, "int32": np.int32, "int64": np.int64}


def qnn_options(ort, devs, soc, trace_dir, cfg=None, ep_extra=None):
    so = ort.SessionOptions()
    so.log_severity_level = 3
    so.add_session_config_entry("session.disable_cpu_ep_fallback", "1")
    for k, v in (cfg or {}).items():
        so.add_session_config_entry(k, v)
    ep = {"backend_type": "htp", "soc_model": soc, "enable_framework_op_trace": "1",
          "framework_op_trace_dir": os.path.abspath(trace_dir)}
    ep.update(ep_extra or {})
    so.add_provider_for_devices(devs, ep)
    return so


def mask_or_angles(man, io, pos):
    """The per-layer-type input `io` (mask, cos or sin) at position `pos`, as the host builds it;
    None for any other input."""
    name = io["name"]
    t = next((k for k, v in man["types"].items() if name in (v["mask"], v["cos"], v["sin"])), None)
    if t is None:
        return None
    info = man["types"][t]
    if name == info["mask"]:
        past = info["past_len"]
        m = np.full(past + 1, man["mask_value"], np.float32)
        m[:min(pos, past)] = 0.0
        m[-1] = 0.0
        return m.reshape(io["shape"])
    r = info["rotary_dims"]
    inv = 1.0 / (np.float32(info["rope_theta"]) ** (np.arange(0, r, 2, dtype=np.float32) / r))
    ang = np.float32(pos) * inv
    return (np.cos(ang) if name == info["cos"] else np.sin(ang)).astype(np.float32).reshape(io["shape"])


def step_inputs(part, man, emb, pos, rng):
    """Inputs of one decode step at position `pos` with random caches (`--state random`)."""
    feeds = {}
    for io in part["inputs"]:
        name, shape, dt = io["name"], io["shape"], DTYPES[io["dtype"]]
        host = mask_or_angles(man, io, pos)
        if host is not None:
            feeds[name] = host
        elif name.startswith("past_"):
            enc = io.get("encoding")
            if enc is None:
                feeds[name] = (rng.standard_normal(shape) * 0.5).astype(np.float32)
            else:
                lo, hi = np.iinfo(dt).min, np.iinfo(dt).max
                q = rng.standard_normal(shape) * (hi - lo) / 12 + enc["zero_point"]
                feeds[name] = np.clip(np.round(q), lo, hi).astype(dt)
        else:  # residual stream: a real embedding row
            row = emb[rng.integers(0, emb.shape[0])].astype(np.float32)
            feeds[name] = row.reshape(shape)
    return feeds


class HostLoop:
    """The app's step loop (docs/PHONE_EXPORT.md, the manifest's `how_to_step`) on ONNX Runtime CPU:
    per-type masks and cos/sin, the host-owned caches (a ring of W-1 slots for sliding layers, slot =
    position for full layers) and the raw integers of each new K/V entry copied into them."""

    def __init__(self, man, emb, sessions):
        self.man, self.emb, self.sessions, self.pos = man, emb, sessions, 0
        zero = {io["name"]: (io.get("encoding") or {}).get("zero_point", 0)
                for p in man["parts"] for io in p["inputs"]}
        dt = lambda c: DTYPES[c["dtype"]]
        self.caches = {}
        for c in man["caches"]:
            self.caches[c["key_in"]] = np.full(c["key_shape"], zero[c["key_in"]], dt(c))
            self.caches[c["value_in"]] = np.full(c["value_shape"], zero[c["value_in"]], dt(c))

    def feeds(self, part, hidden):
        f = {}
        for io in part["inputs"]:
            name = io["name"]
            host = mask_or_angles(self.man, io, self.pos)
            if name in self.caches:
                f[name] = self.caches[name]
            elif host is not None:
                f[name] = host
            else:
                f[name] = hidden.reshape(io["shape"]).astype(np.float32)
        return f

    def store(self, outs):
        """Copy each new K/V entry into its slot; the step's last position stores nothing."""
        man, pos = self.man, self.pos
        for c in man["caches"]:
            past = c["key_shape"][3]
            if c["layer_type"] == "sliding":
                slot = pos % past if past else None
            else:
                slot = pos if pos < past else None
            if slot is None or pos + 1 >= man["context"]:
                continue
            if c["key_out"] in outs:
                self.caches[c["key_in"]][:, :, :, slot] = outs[c["key_out"]][:, :, :, 0]
            if c["value_out"] in outs:
                self.caches[c["value_in"]][:, :, slot, :] = outs[c["value_out"]][:, :, 0, :]

    def step(self, token, keep=False):
        """One step through every part; with `keep`, also each part's feeds {part file: feeds}."""
        hidden = self.emb[token].astype(np.float32)
        kept, logits = {}, None
        for part, sess in zip(self.man["parts"], self.sessions):
            feeds = self.feeds(part, hidden)
            if keep:
                kept[part["file"]] = {k: v.copy() for k, v in feeds.items()}
            names = [o.name for o in sess.get_outputs()]
            outs = dict(zip(names, sess.run(names, feeds)))
            self.store(outs)
            if "logits" in outs:
                logits = outs["logits"].reshape(-1)
            else:
                hidden = next(v for k, v in outs.items() if k.startswith("hidden_states"))
        self.pos += 1
        return logits, kept


def real_state_feeds(ort, export_dir, man, emb, steps, seed, compared=1):
    """Inputs of every part at steps `steps`, `steps`+1, … (`compared` of them) of a sequence the
    export writes itself: from BOS, each next token sampled (temperature 1) from its own CPU
    logits, so every cache holds what the model really puts there (random cache integers put
    activations where calibration never saw them). Returns [{part file: feeds}] per step."""
    so = ort.SessionOptions()
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_BASIC
    sessions = [ort.InferenceSession(os.path.join(export_dir, p["file"]), so, providers=["CPUExecutionProvider"])
                for p in man["parts"]]
    # Sampling needs only plausible logits: a head-only last part runs with its weights folded to
    # float once (ORT otherwise dequantizes the whole vocabulary's int8 head at every step).
    fast = None
    last = man["parts"][-1]
    if not any(io["name"].startswith("past_") for io in last["inputs"]):
        fso = ort.SessionOptions()
        fso.add_session_config_entry("session.disable_quant_qdq", "1")
        fso.log_severity_level = 3
        fast = ort.InferenceSession(os.path.join(export_dir, last["file"]), fso, providers=["CPUExecutionProvider"])
    loop, rng, tok = HostLoop(man, emb, sessions), np.random.default_rng(seed), man["bos_token_id"]
    out = []
    for i in range(steps + compared):
        loop.sessions = sessions if (fast is None or i >= steps) else sessions[:-1] + [fast]
        logits, kept = loop.step(tok, keep=i >= steps)
        if i >= steps:
            out.append(kept)
        p = np.exp(logits.astype(np.float64) - logits.max())
        tok = int(rng.choice(len(p), p=p / p.sum()))
    return out


def float_activation_model(path):
    """The part with every activation QuantizeLinear→DequantizeLinear pair removed: the same
    weights (their DequantizeLinear nodes stay) and the same integer KV I/O, but float
    activations inside. Both the simulator and ONNX Runtime CPU are measured against it, so the
    HTP's own error is seen apart from the 16-bit grid's (which the CPU run shares). Serialized
    in memory: a copy beside the part's external data would be a write into the user's export."""
    import onnx
    m = onnx.load(path)
    outs = {o.name for o in m.graph.output}
    q_of = {n.output[0]: n.input[0] for n in m.graph.node
            if n.op_type == "QuantizeLinear" and n.output[0] not in outs}
    alias, kept = {}, []
    for n in m.graph.node:
        if n.op_type == "QuantizeLinear" and n.output[0] in q_of:
            continue
        if n.op_type == "DequantizeLinear" and n.input[0] in q_of:
            alias[n.output[0]] = q_of[n.input[0]]
            continue
        kept.append(n)
    for n in kept:
        for i, t in enumerate(n.input):
            n.input[i] = alias.get(t, t)
    for o in m.graph.output:
        if o.name in alias:
            kept.append(onnx.helper.make_node("Identity", [alias[o.name]], [o.name]))
    del m.graph.node[:]
    m.graph.node.extend(kept)
    return m.SerializeToString()


def snr_db(ref, x):
    ref, x = ref.astype(np.float64), x.astype(np.float64)
    noise = np.sum((ref - x) ** 2)
    return float("inf") if noise == 0 else float(10 * np.log10(np.sum(ref ** 2) / noise))


def check_part(ort, qnn, devs, export_dir, part, man, emb, a, real_feeds=None):
    path = os.path.join(export_dir, part["file"])
    out = os.path.join(a.out, os.path.splitext(part["file"])[0])
    shutil.rmtree(out, ignore_errors=True)
    os.makedirs(out)
    rep = {"part": part["file"], "graph": part["graph_name"]}
    ok = True
    t = time.perf_counter()
    sess = None
    try:
        sess = ort.InferenceSession(path, qnn_options(ort, devs, a.soc, out))
        rep["session_s"] = round(time.perf_counter() - t, 2)
    except Exception as e:  # the EP names the offending nodes in the message
        rep["session_error"] = str(e)[:2000]
        ok = False
    trace = os.path.join(out, "qnn_op_trace.json")
    if os.path.exists(trace):
        tr = json.load(open(trace))
        rep["unsupported_nodes"] = tr.get("unsupported_nodes") or []
        ops = [m["dst_qnn_op_type"] for sg in tr.get("subgraph_traces", []) for m in sg.get("op_mappings", [])]
        rep["qnn_op_counts"] = {o: ops.count(o) for o in sorted(set(ops))}
        rep["convert_ops"] = ops.count("Convert")
        if rep["unsupported_nodes"] or rep["convert_ops"]:
            ok = False
    else:
        rep["trace_missing"] = True
        ok = False
    if ok and a.run:
        if real_feeds is not None:
            steps = [f[part["file"]] for f in real_feeds]
        else:
            rng = np.random.default_rng(0)
            steps = [step_inputs(part, man, emb, min(a.steps, man["context"] - 1), rng)]
        rep["state"] = a.state
        rep["steps_compared"] = len(steps)
        so = ort.SessionOptions()
        so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_BASIC
        cpu = ort.InferenceSession(path, so, providers=["CPUExecutionProvider"])
        names = [o.name for o in cpu.get_outputs()]
        quantized = man["precision"] not in ("f32", "f16")
        fso = ort.SessionOptions()
        fso.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_BASIC
        fso.log_severity_level = 3  # the scales and zero points it no longer uses
        fa = ort.InferenceSession(float_activation_model(path), fso, providers=["CPUExecutionProvider"]) \
            if quantized else None
        encs = {io["name"]: io.get("encoding") for io in part["outputs"]}
        got = {n: ([], [], []) for n in names}  # simulator, ORT CPU, float activations
        t = time.perf_counter()
        for feeds in steps:
            runs = [sess.run(names, feeds), cpu.run(names, feeds)]
            runs.append(fa.run(names, feeds) if fa else runs[1])
            for i, n in enumerate(names):
                e = encs.get(n)
                for k, v in enumerate(r[i] for r in runs):
                    if e is not None and v.dtype != np.float32:  # raw integers: compare real values
                        v = (v.astype(np.float64) - e["zero_point"]) * e["scale"]
                    got[n][k].append(np.asarray(v, np.float64).reshape(-1))
        rep["sim_steps_s"] = round(time.perf_counter() - t, 2)
        # Over every compared step at once: one step's figure moves by a few dB with the token.
        sim, ref, flt = ({n: np.concatenate(got[n][k]) for n in names} for k in range(3))
        snrs = {n: round(snr_db(ref[n], sim[n]), 1) for n in names}
        if quantized:
            # The HTP's error against float activations, next to the CPU's: what the 16-bit grid
            # costs is in both; what the HTP adds is the difference.
            rep["cpu_vs_float_act_snr_db"] = {n: round(snr_db(flt[n], ref[n]), 1) for n in names}
            rep["sim_vs_float_act_snr_db"] = {n: round(snr_db(flt[n], sim[n]), 1) for n in names}
            rep["htp_excess_db"] = round(max(rep["cpu_vs_float_act_snr_db"][n] - rep["sim_vs_float_act_snr_db"][n]
                                             for n in names), 1)
            if rep["htp_excess_db"] > a.max_excess:
                ok = False
        rep["sim_vs_cpu_snr_db"] = snrs
        rep["min_snr_db"] = min(snrs.values())
        if rep["min_snr_db"] < a.min_snr:
            ok = False
    del sess
    if ok and not a.no_ctx:
        ctx = os.path.join(out, "ctx", os.path.splitext(part["file"])[0] + "_ctx.onnx")
        os.makedirs(os.path.dirname(ctx))
        t = time.perf_counter()
        try:
            s2 = ort.InferenceSession(path, qnn_options(
                ort, devs, a.soc, out,
                {"ep.context_enable": "1", "ep.context_file_path": ctx, "ep.context_embed_mode": "0"},
                {"enable_htp_prepare_only": "1"}))
            del s2
            rep["context_binary_s"] = round(time.perf_counter() - t, 2)
            bins = glob.glob(os.path.join(os.path.dirname(ctx), "*.bin"))
            rep["context_files"] = {os.path.basename(f): os.path.getsize(f) for f in glob.glob(os.path.join(os.path.dirname(ctx), "*"))}
            targets = set()
            for b in bins:
                with open(b, "rb") as f:
                    m = re.search(rb"soc_type=(\w+);arch=(\d+)", f.read(1 << 22))
                targets.add(m.group(0).decode() if m else None)
            rep["context_target"] = sorted(str(x) for x in targets)
            if not bins or targets != {a.expect_target}:
                ok = False
        except Exception as e:
            rep["context_error"] = str(e)[:2000]
            ok = False
    rep["qnn_ready"] = ok
    return rep


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("export", help="folder written by spark-tool export-phone")
    ap.add_argument("--soc", default="69", help="QNN soc_model (69 = SM8750, Snapdragon 8 Elite, HTP v79)")
    ap.add_argument("--expect-target", default="soc_type=SM8750;arch=79")
    ap.add_argument("--out", default=None, help="work folder (default EXPORT/qnn_check)")
    ap.add_argument("--run", action="store_true", help="simulate one step and compare with ONNX Runtime CPU")
    ap.add_argument("--min-snr", type=float, default=25.0, help="with --run: lowest acceptable simulator-vs-CPU SNR (dB)")
    ap.add_argument("--max-excess", type=float, default=6.0,
                    help="with --run on a quantized export: most dB by which the simulator's SNR against the "
                         "float-activation graph may fall below ONNX Runtime CPU's (the HTP's own error)")
    ap.add_argument("--state", choices=["real", "random"], default="real",
                    help="with --run: the step's caches and residual stream as the export itself writes them over "
                         "--steps self-generated tokens (real), or cache integers drawn inside their encodings and "
                         "a random embedding row (random)")
    ap.add_argument("--steps", type=int, default=200, help="with --run: the position of the (first) compared step")
    ap.add_argument("--compare", type=int, default=8,
                    help="with --run and --state real: consecutive steps compared (SNR over all of them)")
    ap.add_argument("--no-ctx", action="store_true", help="skip context-binary generation")
    ap.add_argument("--parts", default=None, help="comma-separated part files to check (default all)")
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    try:
        import onnxruntime as ort
        import onnxruntime_qnn as qnn
    except ImportError as e:
        sys.exit(f"qnn_check: {e}; install with `pip install -r tools/requirements-qnn.txt` (Linux x86-64, Python 3.11)")
    man_path = os.path.join(a.export, "phone_manifest.json")
    if not os.path.exists(man_path):
        sys.exit(f"qnn_check: {man_path} not found (is {a.export} a spark-tool export-phone folder?)")
    man = json.load(open(man_path))
    a.out = a.out or os.path.join(a.export, "qnn_check")
    os.makedirs(a.out, exist_ok=True)
    ort.register_execution_provider_library("QNNExecutionProvider", qnn.get_library_path())
    devs = [d for d in ort.get_ep_devices() if d.ep_name == "QNNExecutionProvider"]
    if not devs:
        sys.exit("qnn_check: the QNN execution provider registered no device")
    emb = read_file(Path(os.path.join(a.export, man["embedding"]["file"])))[man["embedding"]["tensor"]]
    wanted = set(a.parts.split(",")) if a.parts else None
    real_feeds = None
    if a.run and a.state == "real":
        t = time.perf_counter()
        real_feeds = real_state_feeds(ort, a.export, man, emb, min(a.steps, man["context"] - 1 - a.compare), 0,
                                      a.compare)
        print(f"real state: {min(a.steps, man['context'] - 1)} self-generated steps on ONNX Runtime CPU "
              f"in {time.perf_counter() - t:.1f} s", flush=True)
    reports = []
    for part in man["parts"]:
        if wanted and part["file"] not in wanted:
            continue
        r = check_part(ort, qnn, devs, a.export, part, man, emb, a, real_feeds)
        reports.append(r)
        print(json.dumps(r), flush=True)
    summary = {"export": a.export, "precision": man["precision"], "soc_model": a.soc,
               "onnxruntime": ort.__version__, "onnxruntime_qnn": getattr(qnn, "__version__", "?"),
               "parts": reports, "qnn_ready": bool(reports) and all(r["qnn_ready"] for r in reports)}
    if a.json:
        with open(a.json, "w") as f:
            json.dump(summary, f, indent=1)
    print(f"qnn_ready: {summary['qnn_ready']} ({sum(r['qnn_ready'] for r in reports)}/{len(reports)} parts)")
    sys.exit(0 if summary["qnn_ready"] else 1)


if __name__ == "__main__":
    main()
