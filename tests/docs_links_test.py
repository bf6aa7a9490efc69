#!/usr/bin/env python3
"""Checks that every relative link of the given Markdown files resolves: the
file or directory exists in the repository, and a `#fragment` names a heading
of the target (GitHub's anchor of it) or an explicit `<a id="...">`.

  docs_links_test.py SOURCE_DIR [FILE.md ...]

Without files: README.md, docs/*.md, docs/perf/*.md and python/README.md.
External links (http:, https:, mailto:) are not fetched. Exits 1 listing
every broken link.
"""
import glob
import os
import re
import sys

LINK = re.compile(r"(?<!\!)\[[^\]]*\]\(([^)\s]+)\)")
ANCHOR = re.compile(r"<a\s+id=\"([^\"]+)\"")
FENCE = re.compile(r"^\s*```")


def slug(heading):
    """GitHub's anchor of a heading: lower case, punctuation dropped except
    hyphens and underscores, spaces to hyphens."""
    text = re.sub(r"`", "", heading.strip().lower())
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def prose_lines(path):
    """(line number, text) of the lines outside fenced code blocks."""
    out, in_fence = [], False
    with open(path, encoding="utf-8") as f:
        for number, line in enumerate(f, 1):
            if FENCE.match(line):
                in_fence = not in_fence
                continue
            if not in_fence:
                out.append((number, line))
    return out


def anchors(path, cache={}):
    if path not in cache:
        found, seen = set(), {}
        for _, line in prose_lines(path):
            m = re.match(r"^(#{1,6})\s+(.*?)\s*#*\s*$", line)
            if m:
                base = slug(m.group(2))
                n = seen.get(base, 0)
                seen[base] = n + 1
                found.add(base if n == 0 else f"{base}-{n}")
            found.update(ANCHOR.findall(line))
        cache[path] = found
    return cache[path]


def check(path, root):
    broken = []
    for number, line in prose_lines(path):
        # Inline code spans are not links.
        for target in LINK.findall(re.sub(r"`[^`]*`", "", line)):
            if re.match(r"^[a-z]+:", target):
                continue
            file_part, _, fragment = target.partition("#")
            dest = path if not file_part else os.path.normpath(
                os.path.join(os.path.dirname(path), file_part))
            where = f"{os.path.relpath(path, root)}:{number}: {target}"
            if not os.path.exists(dest):
                broken.append(f"{where}: no such file")
            elif fragment and dest.endswith(".md") and fragment not in anchors(dest):
                broken.append(f"{where}: no heading or anchor '{fragment}'")
    return broken


def main():
    if len(sys.argv) < 2:
        sys.exit(__doc__)
    root = os.path.abspath(sys.argv[1])
    files = [os.path.join(root, f) for f in sys.argv[2:]]
    if not files:
        files = [os.path.join(root, "README.md"), os.path.join(root, "python", "README.md")]
        files += sorted(glob.glob(os.path.join(root, "docs", "*.md")))
        files += sorted(glob.glob(os.path.join(root, "docs", "perf", "*.md")))
    broken = []
    for path in files:
        broken += check(path, root)
    for b in broken:
        print(b)
    print(f"== {len(files)} files, {len(broken)} broken links")
    sys.exit(1 if broken else 0)


if __name__ == "__main__":
    main()
