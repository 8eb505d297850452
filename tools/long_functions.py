#!/usr/bin/env python3
"""Functions in src/ whose body is longer than a limit (150 lines unless told).

Each `fn NAME` with a body is measured from the line of its opening brace to that of its closing
one, both included (a long signature does not count); braces are matched on the code with strings,
raw strings, char literals and comments blanked out. `#[cfg(test)] mod NAME { … }` blocks, files
their parent declares under `#[cfg(test)]`, and files whose header says `@generated` (the prost
types of export/onnx/) are skipped. Prints `FILE:LINE NAME LINES`, longest first, and exits 1 if
there is one.

    python3 tools/long_functions.py [SRC] [--max LINES]
"""
import re
import sys
from pathlib import Path

LIMIT = 150


def blank(text: str) -> str:
    """`text` with every string, char literal and comment replaced by spaces (newlines kept)."""
    out, i, n = list(text), 0, len(text)

    def clear(a, b):
        for j in range(a, b):
            if out[j] != "\n":
                out[j] = " "

    while i < n:
        c = text[i]
        if text.startswith("//", i):
            j = text.find("\n", i)
            j = n if j < 0 else j
            clear(i, j)
            i = j
        elif text.startswith("/*", i):  # Rust block comments nest
            depth, j = 1, i + 2
            while j < n and depth:
                if text.startswith("/*", j):
                    depth, j = depth + 1, j + 2
                elif text.startswith("*/", j):
                    depth, j = depth - 1, j + 2
                else:
                    j += 1
            clear(i, j)
            i = j
        elif m := re.compile(r'b?r(#*)"').match(text, i):
            if i and (text[i - 1].isalnum() or text[i - 1] == "_"):
                i += 1  # the tail of an identifier such as `br` in `abr"`
                continue
            end = text.find('"' + m.group(1), m.end())
            j = n if end < 0 else end + 1 + len(m.group(1))
            clear(i, j)
            i = j
        elif c == '"':
            j = i + 1
            while j < n and text[j] != '"':
                j += 2 if text[j] == "\\" else 1
            clear(i, j + 1)
            i = j + 1
        elif m := re.compile(r"'(?:\\(?:u\{[0-9a-fA-F]+\}|x[0-9a-fA-F]{2}|.)|[^'\\\n])'").match(text, i):
            clear(i, m.end())  # a char literal; a lifetime (`'a`) has no closing quote
            i = m.end()
        else:
            i += 1
    return "".join(out)


def match_brace(code: str, open_at: int) -> int:
    depth = 0
    for j in range(open_at, len(code)):
        if code[j] == "{":
            depth += 1
        elif code[j] == "}":
            depth -= 1
            if depth == 0:
                return j
    return len(code) - 1


def test_only_files(src: Path) -> set:
    out = set()
    for f in src.rglob("*.rs"):
        for name in re.findall(r"#\[cfg\(test\)\]\s*(?:pub(?:\([a-z]+\))?\s+)?mod\s+([a-z_0-9]+)\s*;", f.read_text()):
            base = f.parent if f.name in ("mod.rs", "lib.rs", "main.rs") else f.parent / f.stem
            out |= {base / f"{name}.rs", base / name / "mod.rs"}
    return out


def long_functions(f: Path, limit: int) -> list:
    text = f.read_text()
    if "@generated" in "\n".join(text.splitlines()[:5]):
        return []
    code = blank(text)
    skip = []  # character ranges of test modules
    for m in re.finditer(r"#\[cfg\(test\)\]\s*(?:pub(?:\([a-z]+\))?\s+)?mod\s+\w+\s*\{", code):
        skip.append((m.start(), match_brace(code, m.end() - 1)))
    found = []
    for m in re.finditer(r"\bfn\s+([A-Za-z_]\w*)", code):
        if any(a <= m.start() <= b for a, b in skip):
            continue
        # The body opens at the first `{` outside the signature's parentheses and brackets; a
        # `;` there first means a declaration without a body.
        depth, j = 0, m.end()
        while j < len(code):
            c = code[j]
            if c in "([":
                depth += 1
            elif c in ")]":
                depth -= 1
            elif depth == 0 and c in "{;":
                break
            j += 1
        if j >= len(code) or code[j] == ";":
            continue
        first = code.count("\n", 0, m.start()) + 1
        lines = code.count("\n", j, match_brace(code, j)) + 1
        if lines > limit:
            found.append((lines, f, first, m.group(1)))
    return found


def main() -> int:
    args = sys.argv[1:]
    limit = LIMIT
    if "--max" in args:
        k = args.index("--max")
        limit = int(args[k + 1])
        del args[k : k + 2]
    src = (Path(args[0]) if args else Path(__file__).parent.parent / "src").resolve()
    skip = test_only_files(src)
    found = []
    for f in sorted(src.rglob("*.rs")):
        if f not in skip:
            found += long_functions(f, limit)
    for lines, f, line, name in sorted(found, key=lambda x: (-x[0], x[1], x[2])):
        print(f"{f.relative_to(src.parent)}:{line} {name} {lines} lines")
    if not found:
        print(f"no function longer than {limit} lines")
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main())
