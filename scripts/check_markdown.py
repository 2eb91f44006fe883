#!/usr/bin/env python3
# Copyright (c) 2026 The contrastive authors. SPDX-License-Identifier: Apache-2.0
"""Checks the repository's Markdown: no prose line over 120 characters (fenced code and table rows excepted; the
README's table rows too are held to it), and every relative link resolves: the file exists and a #anchor names a
heading of the target (GitHub's slugs). Prints each problem as path:line: message; exit status 1 if any.

    python3 scripts/check_markdown.py [repository root]          # ctest: docs.markdown
"""

import os
import re
import subprocess
import sys

LIMIT = 120
LINK = re.compile(r"(?<!!)\[[^\]]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)|!\[[^\]]*\]\(([^)\s]+)\)")


def slug(heading):
    """GitHub's anchor for a heading: lower case, punctuation but '-' and '_' dropped, spaces to '-'."""
    text = re.sub(r"`([^`]*)`", r"\1", heading.strip().lower())
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", text)
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def anchors(path, cache={}):
    if path not in cache:
        found, seen, fenced = set(), {}, False
        with open(path, encoding="utf-8") as f:
            for line in f:
                if line.lstrip().startswith("```"):
                    fenced = not fenced
                    continue
                m = None if fenced else re.match(r"#{1,6}\s+(.*?)\s*#*\s*$", line)
                if m:
                    s = slug(m.group(1))
                    n = seen.get(s, 0)
                    seen[s] = n + 1
                    found.add(s if n == 0 else f"{s}-{n}")
        cache[path] = found
    return cache[path]


def markdown_files(root):
    out = subprocess.run(["git", "-C", root, "ls-files", "*.md"], capture_output=True, text=True)
    if out.returncode == 0 and out.stdout.strip():
        return [os.path.join(root, p) for p in out.stdout.split()]
    return [os.path.join(d, f) for d, _, fs in os.walk(root) for f in fs if f.endswith(".md") and "/." not in d]


def check(path, root):
    problems = []
    readme = os.path.abspath(path) == os.path.abspath(os.path.join(root, "README.md"))
    fenced = False
    with open(path, encoding="utf-8") as f:
        lines = f.read().split("\n")
    for number, line in enumerate(lines, 1):
        if line.lstrip().startswith("```"):
            fenced = not fenced
            continue
        if fenced:
            continue
        table = line.lstrip().startswith("|")
        if len(line) > LIMIT and (not table or readme):
            problems.append(f"{path}:{number}: {'table row' if table else 'line'} of {len(line)} characters "
                            f"(at most {LIMIT})")
        for m in LINK.finditer(re.sub(r"`[^`]*`", "", line)):
            target = m.group(1) or m.group(2)
            if re.match(r"^[a-z][a-z0-9+.-]*:", target):  # http:, mailto:, ...
                continue
            file_part, _, anchor = target.partition("#")
            dest = os.path.normpath(os.path.join(os.path.dirname(path), file_part)) if file_part else path
            if not os.path.exists(dest):
                problems.append(f"{path}:{number}: link to {target}: {file_part} does not exist")
            elif anchor and dest.endswith(".md") and anchor not in anchors(dest):
                problems.append(f"{path}:{number}: link to {target}: no heading with anchor #{anchor} in "
                                f"{os.path.relpath(dest, root)}")
    return problems


def main():
    root = os.path.abspath(sys.argv[1] if len(sys.argv) > 1 else os.path.join(os.path.dirname(__file__), ".."))
    problems = [p for path in markdown_files(root) for p in check(path, root)]
    for p in problems:
        print(os.path.relpath(p, root) if p.startswith(root) else p)
    print(f"check_markdown: {len(problems)} problem(s) in {len(markdown_files(root))} files")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
