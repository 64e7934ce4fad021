#!/usr/bin/env python3
"""The layering check ("one crate, one layer"): for every workspace crate's library
(src/lib.rs and the modules under it), reads every `crate::` / `super::` path (in `use` items and
inline), outside comments and `#[cfg(test)]` modules, and reports

- an import that runs back up a floor: a module naming an item of one of its ancestors
  (`super::X`, or `crate::a::X` from inside `a`); a parent naming its children is fine;
- an import circle: source files whose modules reach each other through their imports;
- an import circle between folders: sibling modules (children of one module, a folder among
  them) that reach each other through the imports of anything inside them, e.g. a file of
  `handshake/` naming `crate::topology::node::X` and a file of `topology/` naming
  `crate::handshake::record::Y` (no two files form a circle there, the folders do);
- a source file (any .rs, and any CUDA .cu / .cuh, in the workspace, tests and benches included)
  over LIMIT lines;
- a CUDA function (the body of a `__global__` or `__device__` function in a .cu / .cuh, from its
  opening brace to its closing one, lambdas inside it included) over FN_LIMIT lines.

Usage: python3 .ci/layers.py [--limit N] [--fn-limit N]   (exit 1 on any finding, one line each)
       python3 .ci/layers.py --self-test   (the circle and function checks on small made-up inputs)
"""

import os
import re
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LIMIT = 800
FN_LIMIT = 200
# Files left over the size limit on purpose, with the reason (printed, not counted).
EXEMPT = {}
IDENT = r"[A-Za-z_][A-Za-z0-9_]*"


def strip_comments(text, keep_lines=False):
    """Drops // comments and /* */ blocks; string literals become `""` and char literals `' '`,
    so that nothing inside them is read as a path (a `//` inside a string does not start a
    comment). With `keep_lines` (for line counting) every newline stays where it was: those
    inside a block comment or a literal are kept after its stand-in."""
    out = []
    i, n = 0, len(text)

    def skipped(a, b):
        if keep_lines:
            out.append("\n" * text.count("\n", a, b))

    while i < n:
        c = text[i]
        if text.startswith("//", i):
            j = text.find("\n", i)
            i = n if j < 0 else j
        elif text.startswith("/*", i):
            j = text.find("*/", i + 2)
            j = n if j < 0 else j + 2
            skipped(i, j)
            i = j
        elif c == '"':
            j = i + 1
            while j < n and text[j] != '"':
                j += 2 if text[j] == "\\" else 1
            out.append('""')
            skipped(i, j)
            i = j + 1
        elif c == "'" and re.match(r"'(\\.|[^\\'])'", text[i : i + 4]):
            m = re.match(r"'(\\.|[^\\'])'", text[i : i + 4])
            out.append("' '")
            i += len(m.group(0))
        else:
            out.append(c)
            i += 1
    return "".join(out)


def blank_comments(text):
    """strip_comments for line counting: every newline stays where it was."""
    return strip_comments(text, keep_lines=True)


def cuda_functions(text):
    """[(name, first line, body lines)] of every `__global__` / `__device__` function defined in
    CUDA source `text`: the body runs from the `{` that follows the parameter list to its matching
    `}` (both lines counted). A declaration (`;` first) or a `__device__` variable (`=` first) is
    no definition. A function inside another's body (a lambda) counts as the outer one's lines.
    Raises ValueError where the braces do not match."""
    text = blank_comments(text)
    line_at = lambda k: text.count("\n", 0, k) + 1
    out, end = [], -1
    for m in re.finditer(r"\b__(?:global|device)__\b", text):
        if m.start() < end:
            continue  # inside the body found last
        j, depth, paren = m.end(), 0, None
        while j < len(text):
            c = text[j]
            if c == "(":
                if depth == 0:
                    paren = j
                depth += 1
            elif c == ")":
                depth -= 1
            elif depth == 0 and c in ";=":
                paren = None
                break
            elif depth == 0 and c == "{":
                break
            j += 1
        if paren is None or j >= len(text):
            continue
        name = re.search(r"(" + IDENT + r"(?:::" + IDENT + r")*)\s*(?:<[^<>()]*>)?\s*$", text[m.end() : paren])
        depth, k = 0, j
        while k < len(text):
            depth += {"{": 1, "}": -1}.get(text[k], 0)
            if depth == 0:
                break
            k += 1
        if depth:
            raise ValueError(f"unmatched '{{' at line {line_at(j)}")
        out.append((name.group(1) if name else "?", line_at(m.start()), line_at(k) - line_at(j) + 1))
        end = k
    return out


def long_cuda_functions(path, rel, fn_limit):
    """One finding per function of CUDA file `path` whose body is over fn_limit lines."""
    try:
        fns = cuda_functions(open(path, encoding="utf-8").read())
    except ValueError as e:
        return [f"{rel}: cannot find its functions ({e})"]
    return [f"{rel}:{line}: function {name} is {n} lines (over {fn_limit})" for name, line, n in fns if n > fn_limit]


def strip_test_modules(text):
    """Removes `#[cfg(test)] mod NAME { ... }` (a file's own tests import its items: not a floor)."""
    while True:
        m = re.search(r"#\[cfg\((?:test|all\(test\b[^\]]*)\)\]\s*(?:#\[[^\]]*\]\s*)*mod\s+" + IDENT + r"\s*\{", text)
        if not m:
            return text
        depth, j = 1, m.end()
        while j < len(text) and depth:
            depth += {"{": 1, "}": -1}.get(text[j], 0)
            j += 1
        text = text[: m.start()] + text[j:]


def expand_use_tree(tree):
    """`a::{b, c::{d, self}}` -> ['a::b', 'a::c::d', 'a::c']."""
    tree = re.sub(r"\s+", "", tree)
    tree = re.sub(r"\bas" + IDENT, "", tree)
    m = re.match(r"^(.*?)\{(.*)\}$", tree)
    if not m:
        return [tree]
    prefix, inner = m.group(1), m.group(2)
    parts, depth, cur = [], 0, ""
    for ch in inner:
        if ch == "," and depth == 0:
            parts.append(cur)
            cur = ""
            continue
        depth += {"{": 1, "}": -1}.get(ch, 0)
        cur += ch
    parts.append(cur)
    out = []
    for p in filter(None, parts):
        if p == "self":
            out.append(prefix.rstrip(":"))
        else:
            out.extend(expand_use_tree(prefix + p))
    return out


def modules_of(src):
    """{module path tuple: file} for the library rooted at src/lib.rs."""
    mods = {}

    def walk(path, file):
        mods[path] = file
        text = strip_test_modules(strip_comments(open(file, encoding="utf-8").read()))
        base = os.path.dirname(file)
        if not (file.endswith("lib.rs") or file.endswith("mod.rs")):
            base = os.path.join(base, os.path.basename(file)[:-3])
        for m in re.finditer(r"(?m)^(\s*#\[cfg\(test\)\]\s*)?\s*(?:pub(?:\([a-z]+\))?\s+)?mod\s+(" + IDENT + r")\s*;", text):
            if m.group(1):
                continue  # a file's tests (`#[cfg(test)] mod tests;`) import what they test
            name = m.group(2)
            for cand in (os.path.join(base, name + ".rs"), os.path.join(base, name, "mod.rs")):
                if os.path.exists(cand):
                    walk(path + (name,), cand)
                    break

    if os.path.exists(os.path.join(src, "lib.rs")):
        walk((), os.path.join(src, "lib.rs"))
    return mods


def references(path, file):
    """Every module path the file names, resolved from the crate root."""
    text = strip_test_modules(strip_comments(open(file, encoding="utf-8").read()))
    refs = []
    for m in re.finditer(r"\buse\s+([^;]+);", text):
        for p in expand_use_tree(m.group(1)):
            refs.append(p)
    body = re.sub(r"\buse\s+[^;]+;", "", text)
    for m in re.finditer(r"\b((?:crate|super|self)(?:::" + IDENT + r")+)", body):
        refs.append(m.group(1))
    out = []
    for r in refs:
        segs = r.split("::")
        if segs[0] == "crate":
            out.append(("crate", tuple(segs[1:])))
        elif segs[0] == "super":
            up = list(path)
            while segs and segs[0] == "super":
                up = up[:-1]
                segs = segs[1:]
            out.append(("super", tuple(up) + tuple(segs)))
        elif segs[0] == "self":
            out.append(("self", tuple(path) + tuple(segs[1:])))
    return out


def resolve(mods, full):
    """The deepest module that `full` (a path from the root) goes through."""
    for k in range(len(full), -1, -1):
        if full[:k] in mods:
            return full[:k]
    return ()


def sccs(nodes, edges):
    index, low, stack, on, out, counter = {}, {}, [], set(), [], [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in edges.get(v, ()):
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
            out.append(comp)

    sys.setrecursionlimit(10000)
    for v in nodes:
        if v not in index:
            visit(v)
    return [c for c in out if len(c) > 1]


def name(crate, path):
    return crate + "::" + "::".join(path) if path else crate


def sibling_circles(crate, mods, edges, root):
    """Circles between the children of one module where a folder is among them: every module is
    counted as the child of P it lies under, and A -> B when anything under A names anything
    under B. (Circles of plain files are the file-level check's; they are not reported twice.)
    Each finding names one import for every step of the circle."""
    out = []
    for parent in sorted(mods):
        depth = len(parent) + 1
        kids = [m for m in mods if len(m) == depth and m[: len(parent)] == parent]
        if len(kids) < 2:
            continue
        folders = {k for k in kids if any(len(m) > depth and m[:depth] == k for m in mods)}
        if not folders:
            continue
        graph, witness = {}, {}
        for src in sorted(edges):
            if len(src) < depth or src[: len(parent)] != parent:
                continue
            for dst in sorted(edges[src]):
                if len(dst) < depth or dst[: len(parent)] != parent:
                    continue
                a, b = src[:depth], dst[:depth]
                if a != b:
                    graph.setdefault(a, set()).add(b)
                    witness.setdefault((a, b), (src, dst))
        for comp in sccs(kids, graph):
            if not folders & set(comp):
                continue
            members = sorted(comp)
            shown = []
            for a in members:
                for b in members:
                    if (a, b) in witness:
                        src, dst = witness[(a, b)]
                        shown.append(f"{os.path.relpath(mods[src], root)} names {name(crate, dst)}")
            where = ", ".join(
                os.path.relpath(os.path.dirname(mods[m]) if m in folders else mods[m], root) + ("/" if m in folders else "")
                for m in members
            )
            out.append(f"{crate}: import circle between folders {where} (" + "; ".join(shown) + ")")
    return out


def check_crate(root, crate):
    """The layering findings of one crate's library (imports only; sizes are checked apart)."""
    findings = []
    mods = modules_of(os.path.join(root, crate, "src"))
    edges = {}
    for path, file in mods.items():
        rel = os.path.relpath(file, root)
        for kind, full in references(path, file):
            target = resolve(mods, full)
            if target == path or target[: len(path)] == path:
                if target != path:
                    edges.setdefault(path, set()).add(target)
                continue
            if path[: len(target)] == target:
                findings.append(f"{rel}: back up a floor: names {name(crate, full)} (an item of its ancestor {name(crate, target)})")
                continue
            edges.setdefault(path, set()).add(target)
    for comp in sccs(list(mods), edges):
        findings.append(f"{crate}: import circle between " + ", ".join(sorted(os.path.relpath(mods[p], root) for p in comp)))
    findings.extend(sibling_circles(crate, mods, edges, root))
    return findings


def self_test():
    """The circle checks on made-up crates: a folder circle with no file circle is found (and
    named by its imports), a file circle is reported once, a clean layout has no finding."""
    import tempfile

    def crate(files):
        root = tempfile.mkdtemp()
        for rel, text in files.items():
            p = os.path.join(root, "c", "src", rel)
            os.makedirs(os.path.dirname(p), exist_ok=True)
            open(p, "w", encoding="utf-8").write(text)
        return check_crate(root, "c")

    lib = "mod error;\nmod handshake;\nmod topology;\n"
    hs = "mod record;\nmod wire;\npub use record::Record;\n"
    tp = "pub mod node;\nmod plan;\n"
    folders = crate({
        "lib.rs": lib, "error.rs": "pub struct E;\n",
        "handshake/mod.rs": hs, "handshake/record.rs": "pub struct Record;\n",
        "handshake/wire.rs": "use crate::topology::node::NodeId;\n",
        "topology/mod.rs": tp, "topology/node.rs": "pub struct NodeId;\n",
        "topology/plan.rs": "use crate::handshake::record::Record;\nuse crate::error::E;\n",
    })
    assert len(folders) == 1 and "import circle between folders" in folders[0], folders
    assert "c/src/handshake/, c/src/topology/" in folders[0], folders
    assert "handshake/wire.rs names c::topology::node" in folders[0], folders
    assert "topology/plan.rs names c::handshake::record" in folders[0], folders
    # One level down: two sibling folders of `net/` reaching each other.
    nested = crate({
        "lib.rs": "mod net;\n", "net/mod.rs": "mod a;\nmod b;\n",
        "net/a/mod.rs": "mod x;\n", "net/a/x.rs": "use crate::net::b::y::Y;\npub struct X;\n",
        "net/b/mod.rs": "pub mod y;\nmod z;\n", "net/b/y.rs": "pub struct Y;\n",
        "net/b/z.rs": "fn f() { let _ = crate::net::a::x::X; }\n",
    })
    assert len(nested) == 1 and "c/src/net/a/, c/src/net/b/" in nested[0], nested
    files = crate({
        "lib.rs": "mod a;\nmod b;\nmod d;\n", "a.rs": "use crate::b::B;\npub struct A;\n",
        "b.rs": "use crate::a::A;\npub struct B;\n", "d/mod.rs": "mod e;\n", "d/e.rs": "use crate::a::A;\n",
    })
    assert files == ["c: import circle between c/src/a.rs, c/src/b.rs"], files
    clean = crate({
        "lib.rs": lib, "error.rs": "pub struct E;\n",
        "handshake/mod.rs": hs, "handshake/record.rs": "use crate::error::E;\npub struct Record;\n",
        "handshake/wire.rs": "use crate::topology::node::NodeId;\n",
        "topology/mod.rs": tp, "topology/node.rs": "pub struct NodeId;\n",
        "topology/plan.rs": "use crate::error::E;\n",
    })
    assert clean == [], clean
    # CUDA functions: a definition's body is counted from its brace to its brace; declarations,
    # `__device__` variables, lambdas inside a body and braces in comments or strings are not
    # functions of their own.
    src = (
        "__global__ void __launch_bounds__(512, 1) ns::k(KParams p);\n"
        "__device__ const int TABLE[2] = {1, 2};\n"
        "template <int S>\n__device__ __forceinline__ void two(int a) {\n"
        "    auto f = [&](int i) __device__ { return i; };  // }\n"
        "    /* { */ const char* s = \"{\";\n}\n"
        "__global__ void __launch_bounds__(512, 1) ns::k(KParams p) {\n" + "    x();\n" * 5 + "}\n"
    )
    assert cuda_functions(src) == [("two", 4, 4), ("ns::k", 8, 7)], cuda_functions(src)
    import tempfile
    f = tempfile.NamedTemporaryFile("w", suffix=".cu", delete=False)
    f.write(src)
    f.close()
    assert long_cuda_functions(f.name, "a.cu", 6) == ["a.cu:8: function ns::k is 7 lines (over 6)"]
    assert long_cuda_functions(f.name, "a.cu", 7) == []
    os.unlink(f.name)
    print("layers: self-test passed")
    return 0


def main():
    if "--self-test" in sys.argv:
        return self_test()
    limit, fn_limit = LIMIT, FN_LIMIT
    if "--limit" in sys.argv:
        limit = int(sys.argv[sys.argv.index("--limit") + 1])
    if "--fn-limit" in sys.argv:
        fn_limit = int(sys.argv[sys.argv.index("--fn-limit") + 1])
    members = re.search(r"members\s*=\s*\[([^\]]*)\]", open(os.path.join(ROOT, "Cargo.toml")).read())
    crates = re.findall(r'"([^"]+)"', members.group(1))
    findings = []
    for crate in crates:
        findings.extend(check_crate(ROOT, crate))
    for crate in crates:
        for d, _, files in os.walk(os.path.join(ROOT, crate)):
            for f in files:
                if f.endswith((".rs", ".cu", ".cuh")):
                    p = os.path.join(d, f)
                    n = sum(1 for _ in open(p, encoding="utf-8"))
                    rel = os.path.relpath(p, ROOT)
                    if n > limit and rel in EXEMPT:
                        print(f"exempt: {rel}: {n} lines ({EXEMPT[rel]})")
                    elif n > limit:
                        findings.append(f"{rel}: {n} lines (over {limit})")
                    if f.endswith((".cu", ".cuh")):
                        findings.extend(long_cuda_functions(p, rel, fn_limit))
    for f in dict.fromkeys(findings):
        print(f)
    print(f"layers: {len(dict.fromkeys(findings))} findings in {len(crates)} crates")
    return 1 if findings else 0


if __name__ == "__main__":
    sys.exit(main())
