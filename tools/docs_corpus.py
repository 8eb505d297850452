#!/usr/bin/env python3
"""Text of the Rust 1.95.0 documentation books, for the second trained fixture (fixtures/spark-docs).

The books ship with the toolchain as the `rust-docs` rustup component (`rustup component add rust-docs
--toolchain 1.95.0`), under MIT OR Apache-2.0 (share/doc/rust/COPYRIGHT.html), so the text is free to
redistribute and every run on any machine reads the same pages. Each HTML page of a book is one document:
the text inside its `<main>` element, prose and code blocks alike; pages under 400 characters (redirects,
stubs) are dropped.

The split is by **book**, so held-out text is unseen in kind as well as in content:

* training: The Rust Programming Language (`book`), the Reference, Rust by Example, the Cargo Book, the
  rustc book — tutorial prose, a formal specification, example-driven code, command-line manuals;
* held out (never trained on, never used for calibration): the Rustonomicon (`nomicon`, unsafe code),
  the Edition Guide and the Embedded Rust Book — other authors, other subjects.

Calibration for `quantize` comes from the training books (as a user would calibrate on text like what the
model was trained on); perplexity and the parity prompts come from the held-out books.

    python3 tools/docs_corpus.py --stats
    python3 tools/docs_corpus.py --write calibration/docs   # the committed calibration and held-out sets
"""

from __future__ import annotations

import argparse
import html.parser
import json
import random
import re
import subprocess
from pathlib import Path

TOOLCHAIN = "1.95.0"
TRAIN_BOOKS = ["book", "reference", "rust-by-example", "cargo", "rustc"]
HELD_OUT_BOOKS = ["nomicon", "edition-guide", "embedded-book"]
MIN_CHARS = 400
SKIP = {"print.html", "toc.html", "404.html", "index.html"}


def docs_root() -> Path:
    """share/doc/rust/html of the pinned toolchain; a clear error when the component is missing."""
    run = lambda *a: subprocess.run(["rustc", *a], check=True, capture_output=True, text=True).stdout  # noqa: E731
    version = run("-V").split()[1]
    if version != TOOLCHAIN:
        raise SystemExit(f"rustc is {version}; the fixture's text is that of the {TOOLCHAIN} books "
                         f"(rustup default {TOOLCHAIN})")
    root = Path(run("--print", "sysroot").strip()) / "share/doc/rust/html"
    if not (root / "book").is_dir():
        raise SystemExit(f"{root}: no Rust books; run `rustup component add rust-docs --toolchain {TOOLCHAIN}`")
    return root


class _Main(html.parser.HTMLParser):
    """Collects the text inside <main>, with line breaks at block elements."""

    BLOCK = {"p", "div", "pre", "li", "h1", "h2", "h3", "h4", "h5", "h6", "tr", "br", "table", "blockquote"}

    def __init__(self) -> None:
        super().__init__(convert_charrefs=True)
        self.depth = 0
        self.pre = 0
        self.parts: list[str] = []

    def handle_starttag(self, tag, attrs):
        if tag == "main":
            self.depth += 1
        if self.depth and tag == "pre":
            self.pre += 1
        if self.depth and tag in self.BLOCK:
            self.parts.append("\n")

    def handle_endtag(self, tag):
        if self.depth and tag == "pre":
            self.pre -= 1
        if self.depth and tag in self.BLOCK:
            self.parts.append("\n")
        if tag == "main":
            self.depth -= 1

    def handle_data(self, data):
        if self.depth:
            self.parts.append(data if self.pre else re.sub(r"\s+", " ", data))


def page_text(path: Path) -> str:
    p = _Main()
    p.feed(path.read_text(encoding="utf-8", errors="replace"))
    text = "".join(p.parts)
    text = re.sub(r"[ \t]+\n", "\n", text)
    return re.sub(r"\n{3,}", "\n\n", text).strip()


def book_documents(root: Path, book: str) -> list[str]:
    docs = []
    for path in sorted((root / book).rglob("*.html")):
        if path.name in SKIP:
            continue
        text = page_text(path)
        if len(text) >= MIN_CHARS:
            docs.append(text)
    return docs


def corpus() -> tuple[list[str], list[str]]:
    """(training documents, held-out documents), in a fixed order."""
    root = docs_root()
    train = [d for b in TRAIN_BOOKS for d in book_documents(root, b)]
    held = [d for b in HELD_OUT_BOOKS for d in book_documents(root, b)]
    return train, held


CALIB_CHARS = 320_000  # per calibration set: > 128 × 512 tokens of this tokenizer
PROMPTS = 14
HELDOUT_CHARS = 250_000  # perplexity text: > 32K tokens


def write_sets(out: Path) -> None:
    """Two disjoint calibration sets (a, b) from the training books, the held-out text for perplexity and
    the parity prompts from the held-out books."""
    root = docs_root()
    train = [(b, d) for b in TRAIN_BOOKS for d in book_documents(root, b)]
    held = [(b, d) for b in HELD_OUT_BOOKS for d in book_documents(root, b)]
    rng = random.Random(20261201)
    rng.shuffle(train)
    rng.shuffle(held)
    out.mkdir(parents=True, exist_ok=True)

    def take(pool, chars):
        got, n = [], 0
        while pool and n < chars:
            got.append(pool.pop())
            n += len(got[-1][1])
        return got

    def jsonl(name, docs):
        with open(out / name, "w", encoding="utf-8") as f:
            for book, text in docs:
                f.write(json.dumps({"source": f"rust-{TOOLCHAIN}-{book}", "text": text}, ensure_ascii=False) + "\n")

    jsonl("calib-a.jsonl", take(train, CALIB_CHARS))
    jsonl("calib-b.jsonl", take(train, CALIB_CHARS))
    prompts = []
    for i, (book, text) in enumerate(held[:PROMPTS]):
        # Two long prompts (far beyond the fixture's 64-token window), the rest a paragraph or two.
        cut = 4000 if i < 2 else 500 + 100 * i
        prompts.append({"name": f"{book}_{i:02d}", "chat": False, "text": text[:cut]})
    note = (f"Parity prompts cut from held-out Rust {TOOLCHAIN} books ({', '.join(HELD_OUT_BOOKS)}; MIT OR "
            "Apache-2.0), which fixtures/spark-docs never saw in training and quantize never reads.")
    (out / "prompts.json").write_text(json.dumps({"_note": note, "prompts": prompts}, indent=1,
                                                 ensure_ascii=False) + "\n", encoding="utf-8")
    jsonl("heldout.jsonl", take(held[PROMPTS:], HELDOUT_CHARS))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--stats", action="store_true")
    ap.add_argument("--write", type=Path, help="write the calibration and held-out sets to this folder")
    a = ap.parse_args()
    if a.write:
        write_sets(a.write)
        for p in sorted(a.write.iterdir()):
            print(f"{p}: {p.stat().st_size:,} bytes")
        return
    root = docs_root()
    for b in TRAIN_BOOKS + HELD_OUT_BOOKS:
        docs = book_documents(root, b)
        kind = "train" if b in TRAIN_BOOKS else "held out"
        print(f"{b:16s} {kind:9s} {len(docs):5d} pages {sum(map(len, docs)):10,d} chars")
    if a.stats:
        print(page_text(root / "nomicon" / "ownership.html")[:600])


if __name__ == "__main__":
    main()
