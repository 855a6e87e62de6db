#!/usr/bin/env python3
"""Lists module cycles inside each crate of the workspace.

A module depends on another when its code names an item of it through a path (`use
crate::a::b`, `super::x::Y`, `self::m::Z` ...). A child module naming its own descendants is
not counted (that is how a module is built from its parts), nor are test modules. Exits 1 when
a cycle exists, printing each one.
"""
import os
import re
import sys

USE_RE = re.compile(r'\b(crate|super|self)((?:::[A-Za-z_][A-Za-z0-9_]*)+|::\{)')


def modules(src):
    mods = {}
    for root, _, files in os.walk(src):
        for f in files:
            if not f.endswith('.rs'):
                continue
            p = os.path.join(root, f)
            rel = os.path.relpath(p, src)[:-3].split(os.sep)
            if rel[-1] in ('mod', 'lib', 'main'):
                rel = rel[:-1]
            mods[tuple(rel)] = p
    return mods


def strip(text):
    text = re.sub(r'//[^\n]*', '', text)
    # drop #[cfg(test)] modules at the end of files
    m = re.search(r'#\[cfg\(test\)\]\s*mod \w+ \{', text)
    if m:
        text = text[:m.start()]
    return text


def expand_braces(path_text):
    # "a::{b, c::d}" -> ["a::b", "a::c::d"] (one level is enough for module resolution)
    m = re.match(r'(.*?)::\{(.*)\}', path_text, re.S)
    if not m:
        return [path_text]
    head, inner = m.group(1), m.group(2)
    parts, depth, cur = [], 0, ''
    for ch in inner:
        if ch == '{':
            depth += 1
        elif ch == '}':
            depth -= 1
        if ch == ',' and depth == 0:
            parts.append(cur.strip())
            cur = ''
        else:
            cur += ch
    if cur.strip():
        parts.append(cur.strip())
    out = []
    for p in parts:
        for e in expand_braces(p):
            out.append(head + '::' + e if e not in ('self',) else head)
    return out


def deps(mod, text, mods):
    out = set()
    paths = []
    for m in re.finditer(r'\buse\s+([^;]+);', text):
        paths += [x.strip() for x in expand_braces(re.sub(r'\s+', ' ', m.group(1)))]
    for m in USE_RE.finditer(text):
        paths.append(m.group(1) + m.group(2))
    for p in paths:
        segs = [s for s in p.split('::') if s]
        if not segs or segs[0] not in ('crate', 'super', 'self'):
            continue
        base = list(mod)
        i = 0
        if segs[0] == 'crate':
            base, i = [], 1
        else:
            while i < len(segs) and segs[i] in ('super', 'self'):
                if segs[i] == 'super':
                    base = base[:-1]
                i += 1
        cur = tuple(base)
        best = cur
        for s in segs[i:]:
            cur = cur + (s.split(' ')[0],)
            if cur in mods:
                best = cur
            else:
                break
        if best == mod or best[:len(mod)] == mod:
            continue  # itself or its own descendants
        out.add(best)
    return out


def cycles(graph):
    index, low, stack, on, res, n = {}, {}, [], set(), [], [0]

    def visit(v):
        index[v] = low[v] = n[0]
        n[0] += 1
        stack.append(v)
        on.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                res.append(comp)

    sys.setrecursionlimit(10000)
    for v in list(graph):
        if v not in index:
            visit(v)
    return res


def main():
    root = sys.argv[1] if len(sys.argv) > 1 else 'crates'
    bad = 0
    for crate in sorted(os.listdir(root)):
        src = os.path.join(root, crate, 'src')
        if not os.path.isdir(src):
            continue
        mods = modules(src)
        graph = {m: deps(m, strip(open(p).read()), mods) for m, p in mods.items()}
        for comp in cycles(graph):
            bad += 1
            names = sorted('::'.join(c) or '(root)' for c in comp)
            print(f'{crate}: cycle between ' + ', '.join(names))
            for c in comp:
                for d in sorted(graph[c]):
                    if d in comp:
                        print(f'    {"::".join(c) or "(root)"} -> {"::".join(d) or "(root)"}')
    if not bad:
        print('no module cycles')
    return 1 if bad else 0


if __name__ == '__main__':
    sys.exit(main())
