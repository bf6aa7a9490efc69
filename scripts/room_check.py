#!/usr/bin/env python3
"""Room sizes: files over 800 lines and functions over 100 lines.

Usage: scripts/room_check.py [--strict] [--top N] [path ...]
  paths default to server/ client/ common/ (the rooms the size rule covers);
  --strict exits 1 when something is over and carries no written reason;
  --top N also lists the N largest files and functions (a layout report).

A file is excused by a line containing "Size exception:" and its reason in
its first 40 lines; a function by such a line among the 5 lines above it.
Functions are found by a brace scan at namespace and class scope (comments,
strings and preprocessor lines removed first): good enough for this tree's
style, not a C++ parser.
"""
import os
import re
import sys

MAX_FILE_LINES = 800
MAX_FUNCTION_LINES = 100
EXTS = (".h", ".cc", ".cu", ".cuh")
MARK = "Size exception:"
NOT_FUNCTION = re.compile(
    r"^\s*(?:template\s*<.*>\s*)?(namespace|class|struct|union|enum|extern)\b|=\s*$|=\s*\[|\b(if|for|while|switch|catch|do)\s*\(")


def strip(text):
    """Blanks comments, string/char literals and preprocessor lines, keeping newlines."""
    out = []
    i, n = 0, len(text)
    at_line_start = True
    while i < n:
        c = text[i]
        if at_line_start and c == "#":
            while i < n and text[i] != "\n":
                if text[i] == "\\" and i + 1 < n and text[i + 1] == "\n":
                    out.append(" \n")
                    i += 2
                    continue
                out.append(" ")
                i += 1
            continue
        if c == "/" and text.startswith("//", i):
            while i < n and text[i] != "\n":
                out.append(" ")
                i += 1
            continue
        if c == "/" and text.startswith("/*", i):
            end = text.find("*/", i + 2)
            end = n if end < 0 else end + 2
            out.append("".join("\n" if ch == "\n" else " " for ch in text[i:end]))
            i = end
            continue
        if c == 'R' and text.startswith('R"', i):
            m = re.match(r'R"([^(]*)\(', text[i:])
            if m:
                close = ")" + m.group(1) + '"'
                end = text.find(close, i)
                end = n if end < 0 else end + len(close)
                out.append("".join("\n" if ch == "\n" else " " for ch in text[i:end]))
                i = end
                continue
        if c in "\"'":
            j = i + 1
            while j < n and text[j] != c and text[j] != "\n":
                j += 2 if text[j] == "\\" else 1
            out.append(c + " " * (min(j, n) - i - 1) + c)
            i = j + 1
            continue
        at_line_start = c == "\n" or (at_line_start and c in " \t")
        out.append(c)
        i += 1
    return "".join(out)


def functions(path, text):
    """Yields (name, first_line, last_line) of functions at namespace/class scope."""
    code = strip(text)
    stack = []  # scope kinds: 'ns', 'class', 'fn', 'other'
    head_start = 0  # index where the current declaration's text begins
    line_of = []
    line = 1
    for ch in code:
        line_of.append(line)
        if ch == "\n":
            line += 1
    for i, ch in enumerate(code):
        if ch in ";":
            if not stack or stack[-1] in ("ns", "class"):
                head_start = i + 1
        elif ch == "{":
            if stack and stack[-1] not in ("ns", "class"):
                stack.append("other")
                continue
            head = code[head_start:i]
            flat = " ".join(head.split())
            kind = "other"
            if re.match(r"^(?:inline\s+)?namespace\b", flat) or flat.startswith('extern "') or re.match(r'^extern\s+"', flat):
                kind = "ns"
            elif re.match(r"^(?:template\s*<.*>\s*)?(class|struct|union)\b", flat) and "(" not in flat.split(":")[0]:
                kind = "class"
            elif re.match(r"^(?:template\s*<.*>\s*)?enum\b", flat):
                kind = "other"
            elif ")" in flat and not NOT_FUNCTION.search(flat):
                kind = "fn"
                name_m = re.search(r"([~\w:]+)\s*\(", flat)
                name = name_m.group(1) if name_m else flat[:40]
                # first non-blank char of the head
                k = head_start
                while k < i and code[k].isspace():
                    k += 1
                stack.append(("fn", name, line_of[k]))
                continue
            elif flat == "" and not stack:
                kind = "other"
            stack.append(kind)
        elif ch == "}":
            if not stack:
                continue
            top = stack.pop()
            if isinstance(top, tuple):
                yield top[1], top[2], line_of[i]
            if not stack or stack[-1] in ("ns", "class"):
                head_start = i + 1
        elif ch == ":" and stack and stack[-1] == "class":
            # access specifiers end a declaration head
            if re.search(r"\b(public|private|protected)\s*$", code[head_start:i]):
                head_start = i + 1


def main(argv):
    strict = "--strict" in argv
    top = 0
    args = [a for a in argv if a != "--strict"]
    if "--top" in args:
        k = args.index("--top")
        top = int(args[k + 1])
        del args[k:k + 2]
    roots = args or ["server", "client", "common"]
    files = []
    for root in roots:
        if os.path.isfile(root):
            files.append(root)
            continue
        for dirpath, _, names in os.walk(root):
            files += [os.path.join(dirpath, f) for f in names if f.endswith(EXTS)]
    over = []
    all_files, all_fns = [], []
    for path in sorted(files):
        with open(path, encoding="utf-8", errors="replace") as f:
            text = f.read()
        lines = text.split("\n")
        nlines = len(lines) - (1 if text.endswith("\n") else 0)
        excused = any(MARK in l for l in lines[:40])
        all_files.append((nlines, path))
        if nlines > MAX_FILE_LINES:
            over.append((excused, f"{path}: {nlines} lines (> {MAX_FILE_LINES})"))
        for name, first, last in functions(path, text):
            length = last - first + 1
            all_fns.append((length, f"{path}:{first} {name}"))
            if length > MAX_FUNCTION_LINES:
                fn_excused = excused or any(MARK in l for l in lines[max(0, first - 6):first - 1])
                over.append((fn_excused, f"{path}:{first}: {name} is {length} lines (> {MAX_FUNCTION_LINES})"))
    for excused, msg in over:
        print(("excused  " if excused else "OVER     ") + msg)
    if top:
        print(f"== {len(all_files)} files, {sum(n for n, _ in all_files)} lines; largest files:")
        for n, p in sorted(all_files, reverse=True)[:top]:
            print(f"  {n:6d}  {p}")
        print("== largest functions:")
        for n, p in sorted(all_fns, reverse=True)[:top]:
            print(f"  {n:6d}  {p}")
    bad = [m for e, m in over if not e]
    print(f"== room check: {len(bad)} over without a reason, {len(over) - len(bad)} excused")
    return 1 if (strict and bad) else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
