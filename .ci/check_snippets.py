#!/usr/bin/env python3
"""Checks that the code snippets of every README are the code they say they are.

A README takes a snippet from a source file with a marker line right before a fenced block:

    <!-- snippet: examples/memory/memory_cpu.cpp#quick_start -->
    ```cpp
    ...
    ```

and the source file delimits the region with two comment lines (any comment leader: //, #):

    // [snippet:quick_start]
    ...
    // [/snippet:quick_start]

The block must equal the region's lines with their common indentation removed (trailing spaces
ignored). A C++ or CUDA block (```cpp, ```c++, ```cuda) without a snippet marker must say that it
is not compiled, with `<!-- illustrative: why -->` on the line before it; anything else fails.

Fails (exit 1, every problem named with its file and line) on: a block that differs (a diff is
printed), a marker naming a missing file or region, a region opened twice or not closed, a marker
not followed by a fenced block, an unclosed fence, an unmarked C++/CUDA block. Prints what it
checked and exits 0 otherwise.

usage: check_snippets.py [--root DIR] [README ...]   (default: every README.md under DIR, the
       repository root, outside build*/ and dot folders other than .ci)
"""
import argparse
import difflib
import os
import re
import sys

MARKER = re.compile(r"^\s*<!--\s*snippet:\s*(\S+?)#(\S+?)\s*-->\s*$")
ILLUSTRATIVE = re.compile(r"^\s*<!--\s*illustrative:.*-->\s*$")
FENCE = re.compile(r"^(\s*)(`{3,})\s*([\w+-]*)\s*$")
REGION_OPEN = re.compile(r"\[snippet:([\w.-]+)\]")
REGION_CLOSE = re.compile(r"\[/snippet:([\w.-]+)\]")
CPP_LANGS = {"cpp", "c++", "cuda", "cu", "cxx"}


def find_readmes(root):
    found = []
    for folder, dirs, files in os.walk(root):
        dirs[:] = sorted(d for d in dirs
                         if not d.startswith("build") and (not d.startswith(".") or d == ".ci"))
        found += [os.path.join(folder, f) for f in sorted(files) if f == "README.md"]
    return found


def dedent(lines):
    indents = [len(l) - len(l.lstrip(" ")) for l in lines if l.strip()]
    cut = min(indents) if indents else 0
    return [l[cut:].rstrip() for l in lines]


def read_regions(path, problems):
    """Every region of a source file: name -> (first line number, lines)."""
    regions, open_at, body = {}, {}, {}
    with open(path, encoding="utf-8") as f:
        lines = f.read().split("\n")
    for number, line in enumerate(lines, 1):
        close = REGION_CLOSE.search(line)
        opening = REGION_OPEN.search(line)
        if close:  # marker lines belong to no region (nested regions leave them out too)
            name = close.group(1)
            if name not in open_at:
                problems.append(f"{path}:{number}: region '{name}' closed but never opened")
            else:
                regions[name] = (open_at.pop(name), dedent(body.pop(name)))
        elif opening:
            name = opening.group(1)
            if name in open_at or name in regions:
                problems.append(f"{path}:{number}: region '{name}' opened twice")
            else:
                open_at[name], body[name] = number, []
        else:
            for name in body:
                body[name].append(line)
    for name, number in open_at.items():
        problems.append(f"{path}:{number}: region '{name}' is never closed "
                        f"([/snippet:{name}] missing)")
    return regions


def check_readme(readme, root, problems, cache):
    """Checks one README; returns the number of snippets it checked."""
    with open(readme, encoding="utf-8") as f:
        lines = f.read().split("\n")
    rel = os.path.relpath(readme, root)
    checked, i = 0, 0
    while i < len(lines):
        fence = FENCE.match(lines[i])
        if not fence:
            i += 1
            continue
        # A fenced block: lines[i] opens it; find its close.
        indent, ticks, lang = fence.group(1), fence.group(2), fence.group(3).lower()
        end = i + 1
        while end < len(lines) and lines[end].strip() != ticks:
            end += 1
        if end == len(lines):
            problems.append(f"{rel}:{i + 1}: fenced block never closed")
            return checked
        block = dedent([l[len(indent):] if l.startswith(indent) else l for l in lines[i + 1:end]])
        before = lines[i - 1] if i > 0 else ""
        marker = MARKER.match(before)
        if marker:
            checked += compare(rel, i, marker.group(1), marker.group(2), block, root, problems,
                               cache)
        elif lang in CPP_LANGS and not ILLUSTRATIVE.match(before):
            problems.append(f"{rel}:{i + 1}: a ```{lang} block without a snippet marker: take it "
                            f"from compiled code (<!-- snippet: path#region --> on the line before) "
                            f"or say it is not compiled (<!-- illustrative: why -->)")
        i = end + 1
    # A marker must sit right before a fence.
    for number, line in enumerate(lines, 1):
        if MARKER.match(line) and (number >= len(lines) or not FENCE.match(lines[number])):
            problems.append(f"{rel}:{number}: snippet marker not followed by a fenced block")
    return checked


def compare(rel, i, path, name, block, root, problems, cache):
    source = os.path.join(root, path)
    where = f"{rel}:{i + 1}"
    if not os.path.isfile(source):
        problems.append(f"{where}: snippet from {path}, which does not exist")
        return 0
    if source not in cache:
        cache[source] = read_regions(source, problems)
    regions = cache[source]
    if name not in regions:
        problems.append(f"{where}: snippet {path}#{name}: no region '{name}' in {path} "
                        f"(regions: {', '.join(sorted(regions)) or 'none'})")
        return 0
    first, region = regions[name]
    if block != region:
        diff = difflib.unified_diff(region, block, f"{path}#{name} (line {first})",
                                    f"{rel} (line {i + 2})", lineterm="")
        problems.append(f"{where}: snippet {path}#{name} differs from its source region:\n" +
                        "\n".join(diff))
        return 0
    return 1


def main(argv):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--root", default=os.path.join(os.path.dirname(__file__), ".."))
    parser.add_argument("readmes", nargs="*")
    args = parser.parse_args(argv)
    root = os.path.abspath(args.root)
    readmes = [os.path.abspath(r) for r in args.readmes] or find_readmes(root)
    problems, cache, checked = [], {}, 0
    for readme in readmes:
        checked += check_readme(readme, root, problems, cache)
    for p in problems:
        print(f"check_snippets: {p}", file=sys.stderr)
    if problems:
        print(f"check_snippets: FAILED: {len(problems)} problem(s) in {len(readmes)} README(s)",
              file=sys.stderr)
        return 1
    print(f"check_snippets: {checked} snippet(s) in {len(readmes)} README(s) equal their sources")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
