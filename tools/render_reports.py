#!/usr/bin/env python3
"""Render every kind of spark-tool report page in headless Chromium and check what a person would see.

    python3 tools/render_reports.py [--out DIR] [--docs]

Makes the pages on the bundled fixture (quantize → quant_report.html; parity against the quantized copy, with a
first run as --baseline → parity.html and parity.md; bench --stages with the llama.cpp comparison transcribed in
docs/data/ → bench.html), screenshots each with Debian's chromium (installed with apt-get when missing, as CI runs
as root on Debian 12), and fails unless, for every page:
  - Chromium logged no console message (the pages carry no script: any message is an error, a blocked load or a
    parse failure);
  - the screenshot is not blank: enough non-white pixels, and the charts' first colour (#0072B2, Okabe-Ito blue)
    is on screen, so the inline SVG was drawn, not just the tables.
The checker checks itself first: a page with a script error must be flagged, and a blank page must be flagged.
PNGs are decoded with zlib and numpy (tools/requirements.txt), no image library.

--docs also writes the half-scale screenshots kept in docs/img/ (report-parity.png, report-quantize.png,
report-bench.png).
"""

from __future__ import annotations

import argparse
import os
import shutil
import struct
import subprocess
import sys
import tempfile
import time
import zlib
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parent.parent
CHART_BLUE = (0, 114, 178)
CHROMIUM_FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                  "--disable-background-networking", "--disable-component-update", "--disable-sync",
                  "--hide-scrollbars", "--enable-logging=stderr", "--v=0"]


def log(msg: str) -> None:
    print(f"[render_reports] {msg}", file=sys.stderr, flush=True)


def ensure_chromium() -> str:
    found = shutil.which("chromium")
    if found:
        return found
    log("chromium missing: apt-get install chromium")
    env = dict(os.environ, DEBIAN_FRONTEND="noninteractive")
    subprocess.run(["apt-get", "update", "-qq"], check=True, env=env)
    subprocess.run(["apt-get", "install", "-y", "-qq", "chromium"], check=True, env=env,
                   stdout=subprocess.DEVNULL)
    found = shutil.which("chromium")
    if not found:
        sys.exit("error: chromium is still missing after apt-get install chromium")
    return found


def screenshot(chromium: str, page: Path, png: Path, size=(1200, 1600), scale: float = 1.0) -> list[str]:
    """Screenshot `page`; returns the console messages Chromium logged."""
    with tempfile.TemporaryDirectory() as profile:
        args = [chromium, *CHROMIUM_FLAGS, f"--user-data-dir={profile}", f"--screenshot={png}",
                f"--window-size={size[0]},{size[1]}", f"--force-device-scale-factor={scale}",
                page.resolve().as_uri()]
        r = subprocess.run(args, capture_output=True, text=True, timeout=120)
    if r.returncode != 0 or not png.exists():
        sys.exit(f"error: chromium failed on {page} (exit {r.returncode}):\n{r.stderr[-2000:]}")
    return [line for line in r.stderr.splitlines() if ":CONSOLE" in line or "Uncaught" in line]


def decode_png(path: Path) -> np.ndarray:
    """8-bit RGB or RGBA PNG (what Chromium writes) → array [height, width, channels]."""
    data = path.read_bytes()
    if data[:8] != b"\x89PNG\r\n\x1a\n":
        sys.exit(f"error: {path} is not a PNG")
    pos, idat = 8, []
    while pos < len(data):
        n, kind = struct.unpack(">I4s", data[pos:pos + 8])
        body = data[pos + 8:pos + 8 + n]
        pos += 12 + n
        if kind == b"IHDR":
            w, h, depth, color, _, _, interlace = struct.unpack(">IIBBBBB", body)
        elif kind == b"IDAT":
            idat.append(body)
    channels = {2: 3, 6: 4}.get(color)
    if depth != 8 or channels is None or interlace:
        sys.exit(f"error: {path}: unexpected PNG layout (depth {depth}, colour type {color}, interlace {interlace})")
    raw = np.frombuffer(zlib.decompress(b"".join(idat)), dtype=np.uint8)
    stride = w * channels
    rows = raw.reshape(h, stride + 1)
    out = np.zeros((h, stride), dtype=np.uint8)
    prev = np.zeros(stride, dtype=np.uint8)
    for y in range(h):
        f, line = rows[y, 0], rows[y, 1:]
        if f == 0:
            cur = line.copy()
        elif f == 1:  # Sub: a running sum per channel, mod 256
            cur = (np.cumsum(line.reshape(w, channels).astype(np.uint32), axis=0) % 256).astype(np.uint8).ravel()
        elif f == 2:  # Up
            cur = line + prev
        elif f in (3, 4):  # Average, Paeth: each byte needs the one reconstructed to its left
            cur = bytearray(stride)
            ln, up = line.tolist(), prev.tolist()
            for i in range(stride):
                a = cur[i - channels] if i >= channels else 0
                b = up[i]
                if f == 3:
                    cur[i] = (ln[i] + ((a + b) >> 1)) & 0xFF
                else:
                    c = up[i - channels] if i >= channels else 0
                    p = a + b - c
                    pa, pb, pc = abs(p - a), abs(p - b), abs(p - c)
                    pred = a if pa <= pb and pa <= pc else (b if pb <= pc else c)
                    cur[i] = (ln[i] + pred) & 0xFF
            cur = np.frombuffer(bytes(cur), dtype=np.uint8)
        else:
            sys.exit(f"error: {path}: bad PNG filter {f} in row {y}")
        out[y] = cur
        prev = cur
    return out.reshape(h, w, channels)[:, :, :3]


def looks_rendered(png: Path) -> tuple[bool, str]:
    px = decode_png(png)
    ink = float((px.min(axis=2) < 235).mean())
    blue = int(np.all(px == np.array(CHART_BLUE, dtype=np.uint8), axis=2).sum())
    why = f"{px.shape[1]}x{px.shape[0]}, {100 * ink:.1f} % non-white, {blue} chart-blue pixels"
    # A page of tables alone has ink but no chart colour; a blank one neither.
    return ink > 0.01 and blue >= 200, why


def spark(args: list, ok_codes=(0,)) -> None:
    binary = os.environ.get("SPARK_TOOL", str(REPO / "target/release/spark-tool"))
    if not Path(binary).exists():
        subprocess.run(["cargo", "build", "--release", "-q"], cwd=REPO, check=True)
    r = subprocess.run([binary, *map(str, args)], cwd=REPO, capture_output=True, text=True)
    if r.returncode not in ok_codes:
        sys.exit(f"error: spark-tool {' '.join(map(str, args))} exited {r.returncode}:\n{r.stderr[-3000:]}")


def make_pages(out: Path) -> dict[str, Path]:
    q = out / "q"
    spark(["quantize", "fixtures/spark-tiny", "--samples", "8", "--seq-len", "64", "--quiet", "--force", "--out", q])
    common = ["parity", "fixtures/spark-tiny", q, "--max-new-tokens", "16", "--eval-tokens", "512",
              "--eval-seq-len", "256", "--policy", "tests/parity_policy.json"]
    # Exit 1 is a drift verdict, still a page to look at.
    spark([*common, "--json", out / "baseline.json"], ok_codes=(0, 1))
    spark([*common, "--baseline", out / "baseline.json", "--json", out / "parity.json",
           "--html", out / "parity.html", "--markdown", out / "parity.md"], ok_codes=(0, 1))
    spark(["bench", "fixtures/spark-tiny", "--prompt-len", "128", "--gen", "32", "--repeat", "3", "--stages",
           "--html", out / "bench.html", "--llamacpp-json", REPO / "docs/data/bench-vs-llamacpp-2026-11-29.json"])
    return {"parity": out / "parity.html", "quantize": q / "quant_report.html", "bench": out / "bench.html"}


def self_check(chromium: str, work: Path) -> None:
    """The checks must be able to fail: a script error is caught, a blank page is caught."""
    bad = work / "control-script-error.html"
    bad.write_text("<!DOCTYPE html><html><body><p>control</p><script>not_defined()</script></body></html>")
    if not screenshot(chromium, bad, work / "control-script-error.png", (400, 300)):
        sys.exit("error: the console check missed a script error in a control page")
    blank = work / "control-blank.html"
    blank.write_text("<!DOCTYPE html><html><body></body></html>")
    screenshot(chromium, blank, work / "control-blank.png", (400, 300))
    if looks_rendered(work / "control-blank.png")[0]:
        sys.exit("error: the non-blank check passed a blank control page")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, help="keep the pages and screenshots here (default: a temporary folder)")
    ap.add_argument("--docs", action="store_true", help="also write the half-scale screenshots of docs/img/")
    a = ap.parse_args()
    t0 = time.monotonic()
    chromium = ensure_chromium()
    with tempfile.TemporaryDirectory() as tmp:
        out = a.out.resolve() if a.out else Path(tmp)
        out.mkdir(parents=True, exist_ok=True)
        self_check(chromium, out)
        pages = make_pages(out)
        failed = []
        for kind, page in pages.items():
            png = out / f"{kind}.png"
            console = screenshot(chromium, page, png, (1200, 2400))
            ok, why = looks_rendered(png)
            status = "ok" if ok and not console else "FAILED"
            log(f"{kind}: {page.name}: {why}; {len(console)} console message(s): {status}")
            for line in console:
                log(f"  {line}")
            if status != "ok":
                failed.append(kind)
            if a.docs:
                # Half scale keeps each PNG small; the top of the page holds the verdict and the first charts.
                img = REPO / "docs/img" / f"report-{kind}.png"
                img.parent.mkdir(parents=True, exist_ok=True)
                screenshot(chromium, page, img, (1200, 2000), scale=0.5)
                log(f"  wrote {img.relative_to(REPO)} ({img.stat().st_size // 1024} KiB)")
        if failed:
            sys.exit(f"error: pages that do not render as expected: {', '.join(failed)} (screenshots in {out})")
    log(f"all {len(pages)} pages render: {time.monotonic() - t0:.0f} s")


if __name__ == "__main__":
    main()
