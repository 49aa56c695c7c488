#!/usr/bin/env bash
# Lists, for each file of crates/kernels/src, the crate files it imports
# (`use` trees and inline `crate::`, `super::`, `self::` and child-module
# paths, comments left out), and fails on any pair of files that import
# each other. With -v, prints every file's imports.
set -euo pipefail
cd "$(dirname "$0")/.."
exec python3 - "$@" <<'PY'
import os, re, sys

ROOT = "crates/kernels/src"
verbose = "-v" in sys.argv[1:]

def module_of(path):
    rel = os.path.relpath(path, ROOT)[:-3].split(os.sep)
    if rel == ["lib"]:
        return ()
    if rel[-1] == "mod":
        rel = rel[:-1]
    return tuple(rel)

files = {}
for d, _, names in os.walk(ROOT):
    for n in names:
        if n.endswith(".rs"):
            p = os.path.join(d, n)
            files[module_of(p)] = p

def strip_comments(src):
    src = re.sub(r"/\*.*?\*/", "", src, flags=re.S)
    return "\n".join(l.split("//")[0] for l in src.splitlines())

def expand(tree):
    """`a::{b, c::{d, e}}` into `a::b`, `a::c::d`, `a::c::e`."""
    tree = tree.strip()
    i = tree.find("{")
    if i < 0:
        return [tree.split(" as ")[0].strip()] if tree else []
    prefix, body, depth, parts, cur = tree[:i], tree[i + 1 : tree.rfind("}")], 0, [], ""
    for ch in body:
        if ch == "," and depth == 0:
            parts.append(cur)
            cur = ""
            continue
        depth += ch == "{"
        depth -= ch == "}"
        cur += ch
    parts.append(cur)
    return [prefix + q for p in parts for q in expand(p)]

def resolve(mod, path, children):
    segs = [s for s in path.split("::") if s]
    if not segs:
        return None
    if segs[0] == "crate":
        base, segs = (), segs[1:]
    elif segs[0] in ("super", "self"):
        base = mod
        while segs and segs[0] in ("super", "self"):
            if segs[0] == "super":
                base = base[:-1]
            segs = segs[1:]
    elif segs[0] in children:
        base = mod
    else:
        return None
    target = base
    for s in segs:
        if target + (s,) in files:
            target = target + (s,)
        else:
            break
    return target

def file_of(mod):
    while mod not in files:
        mod = mod[:-1]
    return mod

def regions(src, mod):
    """`(module, text)` for the file's own text and each inline `mod x { .. }`
    in it (tests, macro-made modules), whose `super` is the file's module."""
    out, rest, at = [], "", 0
    for m in re.finditer(r"\bmod\s+\$?(\w+)\s*\{", src):
        if m.start() < at:
            continue
        depth, i = 1, m.end()
        while depth and i < len(src):
            depth += {"{": 1, "}": -1}.get(src[i], 0)
            i += 1
        rest += src[at : m.start()]
        out += regions(src[m.end() : i - 1], mod + (m.group(1),))
        at = i
    return [(mod, rest + src[at:])] + out

imports = {}
for mod, path in files.items():
    found = set()
    for inner, src in regions(strip_comments(open(path).read()), mod):
        children = set(re.findall(r"^\s*(?:pub(?:\([^)]*\))?\s+)?mod\s+(\w+)\s*;", src, re.M))
        paths = []
        for tree in re.findall(r"\buse\s+([^;]+);", src):
            paths += expand(tree)
        src_wo_use = re.sub(r"\buse\s+[^;]+;", "", src)
        paths += re.findall(r"\b((?:crate|super|self)(?:::\w+)+)", src_wo_use)
        paths += [m for m in re.findall(r"\b(\w+(?:::\w+)+)", src_wo_use) if m.split("::")[0] in children]
        for p in paths:
            t = resolve(inner, p, children)
            if t is not None and file_of(t) != mod:
                found.add(file_of(t))
    imports[mod] = found

name = lambda m: os.path.relpath(files[m], ROOT)
if verbose:
    for m in sorted(imports, key=name):
        print(f"{name(m)}: {', '.join(sorted(name(t) for t in imports[m])) or '-'}")
pairs = sorted({tuple(sorted((name(a), name(b)))) for a in imports for b in imports[a] if a in imports[b]})
for a, b in pairs:
    print(f"cycle: {a} <-> {b}")
print(f"{len(files)} files, {sum(map(len, imports.values()))} imports, {len(pairs)} pairs importing each other")
sys.exit(1 if pairs else 0)
PY
