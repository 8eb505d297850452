#!/usr/bin/env python3
"""Cycles among the library's top-level modules, read from the `crate::MODULE` paths in src/.

Each file under src/ (but main.rs and cli/, the binary, and files its parent declares under
`#[cfg(test)]`) belongs to the top-level module of its first path component; a `crate::X` path in
it (a `use` or an inline path, outside its `#[cfg(test)] mod tests`) is an edge to X. Prints every strongly connected component of more than
one module, with the edges inside it and one file that makes each, and exits 1 if there is one.

    python3 tools/module_cycles.py [SRC]
"""
import re
import sys
from collections import defaultdict
from pathlib import Path


def edges(src: Path) -> dict:
    modules = {p.stem for p in src.glob("*.rs")} | {p.name for p in src.iterdir() if p.is_dir()}
    modules -= {"main", "lib", "cli"}
    out = defaultdict(dict)  # module -> {target: example file}
    test_only = set()
    for f in src.rglob("*.rs"):
        for name in re.findall(r"#\[cfg\(test\)\]\s*(?:pub(?:\([a-z]+\))?\s+)?mod\s+([a-z_0-9]+)\s*;", f.read_text()):
            base = f.parent if f.name in ("mod.rs", "lib.rs") else f.parent / f.stem
            test_only |= {base / f"{name}.rs", base / name / "mod.rs"}
    for f in sorted(src.rglob("*.rs")):
        if f in test_only:
            continue
        parts = f.relative_to(src).parts
        mod = parts[0][:-3] if parts[0].endswith(".rs") else parts[0]
        if mod not in modules:
            continue
        text = re.split(r"#\[cfg\(test\)\]\s*mod tests", f.read_text())[0]
        for target in set(re.findall(r"\bcrate::([a-z_][a-z0-9_]*)", text)):
            if target in modules and target != mod:
                out[mod].setdefault(target, str(f.relative_to(src)))
    return out


def components(graph: dict) -> list:
    index, low, stack, on, found, counter = {}, {}, [], set(), [], [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in graph.get(v, {}):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            c = []
            while True:
                w = stack.pop()
                on.discard(w)
                c.append(w)
                if w == v:
                    break
            found.append(sorted(c))

    sys.setrecursionlimit(10000)
    for v in sorted(graph):
        if v not in index:
            visit(v)
    return [c for c in found if len(c) > 1]


def main() -> int:
    src = Path(sys.argv[1]) if len(sys.argv) > 1 else Path(__file__).resolve().parent.parent / "src"
    graph = edges(src)
    cycles = components(graph)
    for c in cycles:
        print("cycle: " + " ".join(c))
        for a in c:
            for b, f in sorted(graph[a].items()):
                if b in c:
                    print(f"  {a} -> {b}  ({f})")
    if not cycles:
        print("no module cycle")
    return 1 if cycles else 0


if __name__ == "__main__":
    sys.exit(main())
