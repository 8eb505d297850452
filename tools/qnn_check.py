#!/usr/bin/env python3
"""QNN HTP readiness check of a `spark-tool export-phone` folder, offline on x86-64 Linux.

Uses Qualcomm's own HTP backend shipped in the `onnxruntime-qnn` plugin package (its HTP
simulator runs on x86; docs/PHONE_IO.md §10): for every part of the export it
  1. creates a session on the QNN EP with CPU fallback *disabled* and soc_model SM8750
     (HTP v79) — any node QNN cannot place on HTP makes this fail, naming the node;
  2. reads the EP's framework op trace: unsupported nodes, QNN op counts, and `Convert`
     ops (the EP inserts them for u16×u16 attention matmuls, which lose precision);
  3. compiles an offline context binary and checks its header names soc_type=SM8750;arch=79;
  4. with --run, runs one decode step in the simulator and in ONNX Runtime CPU on the same
     inputs (real embedding row, masks/cos/sin of a real position, cache contents drawn
     inside their encodings) and reports the SNR of every output.
Exit 0 when every part is ready (and, with --run, every output reaches --min-snr dB).

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


def step_inputs(part, man, emb, pos, rng):
    """Inputs of one decode step at position `pos`, built as the host would."""
    feeds = {}
    types = man["types"]
    for io in part["inputs"]:
        name, shape, dt = io["name"], io["shape"], DTYPES[io["dtype"]]
        t = next((k for k, v in types.items() if name in (v["mask"], v["cos"], v["sin"])), None)
        if t is not None:
            info = types[t]
            if name == info["mask"]:
                past = info["past_len"]
                m = np.full(past + 1, man["mask_value"], np.float32)
                m[:min(pos, past)] = 0.0
                m[-1] = 0.0
                feeds[name] = m.reshape(shape)
            else:
                r = info["rotary_dims"]
                inv = 1.0 / (np.float32(info["rope_theta"]) ** (np.arange(0, r, 2, dtype=np.float32) / r))
                ang = np.float32(pos) * inv
                feeds[name] = (np.cos(ang) if name == info["cos"] else np.sin(ang)).astype(np.float32).reshape(shape)
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


def snr_db(ref, x):
    ref, x = ref.astype(np.float64), x.astype(np.float64)
    noise = np.sum((ref - x) ** 2)
    return float("inf") if noise == 0 else float(10 * np.log10(np.sum(ref ** 2) / noise))


def check_part(ort, qnn, devs, export_dir, part, man, emb, a):
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
        rng = np.random.default_rng(0)
        pos = min(200, man["context"] - 1)
        feeds = step_inputs(part, man, emb, pos, rng)
        so = ort.SessionOptions()
        so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_BASIC
        cpu = ort.InferenceSession(path, so, providers=["CPUExecutionProvider"])
        names = [o.name for o in cpu.get_outputs()]
        t = time.perf_counter()
        sim = sess.run(names, feeds)
        rep["sim_step_s"] = round(time.perf_counter() - t, 2)
        ref = cpu.run(names, feeds)
        encs = {io["name"]: io.get("encoding") for io in part["outputs"]}
        snrs = {}
        for n, r, s in zip(names, ref, sim):
            e = encs.get(n)
            if e is not None and r.dtype != np.float32:  # raw integers: compare real values
                r = (r.astype(np.float64) - e["zero_point"]) * e["scale"]
                s = (s.astype(np.float64) - e["zero_point"]) * e["scale"]
            snrs[n] = round(snr_db(r, s), 1)
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
    reports = []
    for part in man["parts"]:
        if wanted and part["file"] not in wanted:
            continue
        r = check_part(ort, qnn, devs, a.export, part, man, emb, a)
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
