"""Which ``mindspore.*`` names do MindSpore's scripts use, and does ``autopar`` have each of them?

Reads every ``.py`` file and every ```` ```python ```` block of every ``.md`` file under a directory, statically
(nothing of the scripts runs), and lists the MindSpore names each one uses:

* module paths and their attributes, through the script's own aliases (``import mindspore as ms`` ... ``ms.nn.Dense``,
  ``from mindspore.common.initializer import Normal``, ``from mindspore.ops import operations as P`` ...);
* methods and attributes of MindSpore objects the script made (``ops.ReLU().recompute()``,
  ``net.layer1.set_comm_fusion(0)`` where ``net`` is a user ``nn.Cell`` whose ``layer1`` is an ``nn.Dense``), written
  ``mindspore.nn.Dense.set_comm_fusion``;
* keyword arguments given to MindSpore callables (``mindspore.set_auto_parallel_context(comm_fusion=)``,
  ``mindspore.Model.train(dataset_sink_mode=)``).

Each name is then looked up in ``autopar`` (``mindspore`` -> ``autopar``: import the module path, getattr the rest;
a keyword must be a parameter of the autopar callable, or pass the context setters' own check). A name autopar
defines only to refuse it (``autopar.errors.unsupported``: one line at first use) is counted as *refused*, not as
covered. Identical files (the same sample on several branches) are read once.

    python tools/ms_names.py --extract DOCS_GIT_DIR OUT_DIR   # the docs' distributed samples + parallel tutorials
    python tools/ms_names.py OUT_DIR --markdown tools/ms_names_report.md --json report.json

``--extract`` takes a clone (or the fetched snapshot) of the MindSpore docs repository and writes the ``.py`` files
of its distributed-training sample folders (``OUT_DIR/sample_code/<branch>/<folder>/``) and the parallel tutorials'
pages (``OUT_DIR/tutorials/<branch>/...``) of branches r1.5 .. master. Those files are public code: keep them out of
this repository; what is committed is this tool and its report.
"""
from __future__ import annotations

import argparse
import ast
import hashlib
import json
import re
import sys
from collections import defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from ms_names_markdown import markdown  # noqa: E402
from ms_names_resolve import resolve  # noqa: E402
from ms_samples import CORE, extract  # noqa: E402

# methods whose result is the receiver's kind (a dataset's chain, a Cell's set_train ...)
FLUENT = {"map", "batch", "shuffle", "repeat", "project", "shard", "set_train", "to_float", "set_grad", "take",
          "skip", "rename", "filter", "add_flags", "add_flags_recursive", "recompute"}


# ------------------------------------------------------------------------------------------------- collection
def code_blocks(path: Path) -> list[str]:
    text = path.read_text(errors="replace")
    if path.suffix == ".py":
        return [text]
    return [b for b in re.findall(r"```python[^\n]*\n(.*?)```", text, re.S)]


class Collector(ast.NodeVisitor):
    """Names of one file. ``alias``: script name -> mindspore path; ``kind``: variable -> the MindSpore class (or
    ``user:Class``) it holds; ``classes``: user class -> (bases, attribute kinds, method names)."""

    def __init__(self) -> None:
        self.alias: dict[str, str] = {}
        self.kind: dict[str, str] = {}
        self.classes: dict[str, dict] = {}
        self.names: set[str] = set()
        self._class: str | None = None
        self._in_function = 0

    # -- paths and kinds of expressions --------------------------------------------------------------------
    def path(self, node: ast.AST) -> str | None:
        """The mindspore dotted path of a Name/Attribute chain rooted in an alias."""
        if isinstance(node, ast.Name):
            return self.alias.get(node.id)
        if isinstance(node, ast.Attribute):
            base = self.path(node.value)
            return f"{base}.{node.attr}" if base else None
        return None

    def mindspore_base(self, kind: str | None) -> str | None:
        seen = 0
        while kind and kind.startswith("user:") and seen < 10:
            bases = self.classes.get(kind[5:], {}).get("bases", [])
            kind = next((b for b in bases if b and not b.startswith("user:")), None) or (bases[0] if bases else None)
            seen += 1
        return kind if kind and not kind.startswith("user:") else None

    def member_kind(self, kind: str, attr: str) -> tuple[str | None, bool]:
        """(kind of ``obj.attr``, whether ``attr`` is the script's own) for an object of ``kind``."""
        cls = kind
        seen = 0
        while cls and cls.startswith("user:") and seen < 10:
            info = self.classes.get(cls[5:])
            if info is None:
                return None, True
            if attr in info["attrs"]:
                return info["attrs"][attr], True
            if attr in info["methods"]:
                return None, True
            cls = next(iter(info["bases"]), None)
            seen += 1
        return None, False

    def kind_of(self, node: ast.AST) -> str | None:
        if isinstance(node, ast.Name):
            return self.kind.get(node.id)
        if isinstance(node, ast.Attribute):
            base = self.kind_of(node.value)
            if base:
                sub, own = self.member_kind(base, node.attr)
                if own:
                    return sub
            return None
        if isinstance(node, ast.Call):
            func = node.func
            p = self.path(func)
            if p and p.rsplit(".", 1)[-1][:1].isupper():
                return p
            if isinstance(func, ast.Name) and func.id in self.classes:
                return f"user:{func.id}"
            if isinstance(func, ast.Attribute) and func.attr in FLUENT:
                return self.kind_of(func.value)
        return None

    # -- recording ----------------------------------------------------------------------------------------
    def add(self, name: str) -> None:
        if name.startswith("mindspore"):
            self.names.add(name)

    def visit_Import(self, node: ast.Import) -> None:
        for a in node.names:
            if a.name == "mindspore" or a.name.startswith("mindspore."):
                self.add(a.name)
                if a.asname:
                    self.alias[a.asname] = a.name
                else:
                    self.alias["mindspore"] = "mindspore"

    def visit_ImportFrom(self, node: ast.ImportFrom) -> None:
        mod = node.module or ""
        if node.level or not (mod == "mindspore" or mod.startswith("mindspore.")):
            return
        for a in node.names:
            if a.name == "*":
                continue
            full = f"{mod}.{a.name}"
            self.add(full)
            self.alias[a.asname or a.name] = full

    def visit_ClassDef(self, node: ast.ClassDef) -> None:
        bases = []
        for b in node.bases:
            p = self.path(b)
            bases.append(p if p else (f"user:{b.id}" if isinstance(b, ast.Name) and b.id in self.classes else None))
            self.visit(b)
        methods = {n.name for n in node.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))}
        self.classes[node.name] = {"bases": [b for b in bases if b], "attrs": {}, "methods": methods}
        outer, self._class = self._class, node.name
        depth, self._in_function = self._in_function, 0
        for stmt in node.body:
            self.visit(stmt)
        self._class, self._in_function = outer, depth

    def visit_FunctionDef(self, node: ast.FunctionDef) -> None:
        for d in node.decorator_list:
            self.visit(d)
        if self._class and node.args.args:
            self.kind[node.args.args[0].arg] = f"user:{self._class}"
        self._in_function += 1
        for stmt in node.body:
            self.visit(stmt)
        self._in_function -= 1

    visit_AsyncFunctionDef = visit_FunctionDef

    def visit_Assign(self, node: ast.Assign) -> None:
        self.visit(node.value)
        kind = self.kind_of(node.value)
        for target in node.targets:
            self.visit(target)
            if isinstance(target, ast.Name) and self._class and not self._in_function:
                self.classes[self._class]["attrs"][target.id] = kind  # a class attribute (expansion = 4)
            elif isinstance(target, ast.Name):
                if kind:
                    self.kind[target.id] = kind
                else:
                    self.kind.pop(target.id, None)
            elif (isinstance(target, ast.Attribute) and isinstance(target.value, ast.Name) and self._class
                  and self.kind.get(target.value.id) == f"user:{self._class}"):
                self.classes[self._class]["attrs"][target.attr] = kind

    def visit_With(self, node: ast.With) -> None:
        for item in node.items:
            self.visit(item.context_expr)
        for stmt in node.body:
            self.visit(stmt)

    def visit_Attribute(self, node: ast.Attribute) -> None:
        p = self.path(node)
        if p:
            self.add(p)
            return
        base = self.kind_of(node.value)
        if base and isinstance(node.ctx, ast.Load):
            _, own = self.member_kind(base, node.attr)
            ms_cls = self.mindspore_base(base)
            if not own and ms_cls:
                self.add(f"{ms_cls}.{node.attr}")
        self.visit(node.value)

    def visit_Name(self, node: ast.Name) -> None:
        p = self.alias.get(node.id)
        if p:
            self.add(p)

    def visit_Call(self, node: ast.Call) -> None:
        self.generic_visit(node)
        target = self.path(node.func)
        if target is None and isinstance(node.func, ast.Attribute):
            base = self.kind_of(node.func.value)
            _, own = self.member_kind(base, node.func.attr) if base else (None, True)
            ms_cls = self.mindspore_base(base) if base else None
            target = f"{ms_cls}.{node.func.attr}" if (ms_cls and not own) else None
        if target:
            for kw in node.keywords:
                if kw.arg:
                    self.add(f"{target}({kw.arg}=)")


def collect(root: Path) -> dict[str, dict]:
    """file (relative) -> {"names": [...], "same_as": [...]} for every unique file under ``root``."""
    files: dict[str, dict] = {}
    by_hash: dict[str, str] = {}
    for path in sorted(root.rglob("*")):
        if path.suffix not in (".py", ".md") or not path.is_file():
            continue
        rel = str(path.relative_to(root))
        digest = hashlib.sha1(path.read_bytes()).hexdigest()
        if digest in by_hash:
            files[by_hash[digest]]["same_as"].append(rel)
            continue
        col = Collector()
        skipped = 0
        for block in code_blocks(path):
            try:
                tree = ast.parse(block)
            except SyntaxError:
                skipped += 1
                continue
            col.visit(tree)
        if not col.names:
            continue
        by_hash[digest] = rel
        files[rel] = {"names": sorted(col.names), "same_as": [], "unparsed_blocks": skipped}
    return files


# ------------------------------------------------------------------------------------------------- report
def _figure(names: set[str], status: dict[str, tuple[str, str]]) -> str:
    ok = sum(status[n][0] == "ok" for n in names)
    return f"{ok}/{len(names)} ({100.0 * ok / max(len(names), 1):.1f} %)"


def report(root: Path) -> dict:
    files = collect(root)
    status = {n: resolve(n) for n in sorted({n for f in files.values() for n in f["names"]})}
    core_rows = []
    core_names: set[str] = set()
    for label, paths in CORE.items():
        rels = [f"sample_code/{p}" for p in paths]
        found = [r for r in rels if r in files or any(r in f["same_as"] for f in files.values())]
        names = set()
        for r in found:
            key = r if r in files else next(k for k, f in files.items() if r in f["same_as"])
            names |= set(files[key]["names"])
        core_names |= names
        core_rows.append({"sample": label, "files": paths, "present": len(found) == len(rels),
                          "names": len(names), "covered": _figure(names, status), "used": sorted(names),
                          "not_covered": sorted(n for n in names if status[n][0] != "ok")})
    groups = {"the 15 distributed samples": core_names,
              "all distributed sample_code files": {n for k, f in files.items() if k.startswith("sample_code/")
                                                    for n in f["names"]},
              "parallel tutorials' code blocks": {n for k, f in files.items() if k.startswith("tutorials/")
                                                  for n in f["names"]},
              "everything read": set(status)}
    users = defaultdict(int)
    for f in files.values():
        for n in f["names"]:
            users[n] += 1
    return {"root": str(root), "coverage": {g: _figure(ns, status) for g, ns in groups.items()},
            "core": core_rows,
            "names": {n: {"status": s, "detail": d, "files": users[n], "core": n in core_names}
                      for n, (s, d) in status.items()},
            "files": {k: {"covered": _figure(set(f["names"]), status),
                          "not_covered": [n for n in f["names"] if status[n][0] != "ok"],
                          "names": {n: status[n][0] for n in f["names"]},
                          "same_as": f["same_as"], "unparsed_blocks": f["unparsed_blocks"]}
                      for k, f in files.items()}}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("root", nargs="?", help="directory of scripts (.py, .md) to read")
    ap.add_argument("--extract", nargs=2, metavar=("DOCS_GIT_DIR", "OUT_DIR"),
                    help="write the docs' distributed samples and parallel tutorials of r1.5..master to OUT_DIR")
    ap.add_argument("--json", help="write the full report as JSON here")
    ap.add_argument("--markdown", help="write the report as Markdown here")
    ap.add_argument("--before", help="a JSON report of an earlier run, shown beside this one")
    args = ap.parse_args(argv)
    if args.extract:
        print(f"{extract(Path(args.extract[0]), Path(args.extract[1]))} files written to {args.extract[1]}")
        if not args.root:
            return 0
    if not args.root:
        ap.error("give a directory of scripts (or --extract)")
    rep = report(Path(args.root))
    before = json.loads(Path(args.before).read_text()) if args.before else None
    if args.json:
        Path(args.json).write_text(json.dumps(rep, indent=1, sort_keys=False) + "\n")
    if args.markdown:
        Path(args.markdown).write_text(markdown(rep, before))
    for group, fig in rep["coverage"].items():
        print(f"{group}: {fig}")
    for row in rep["core"]:
        print(f"  {row['sample']}: {row['covered']}" + (f"  missing {row['not_covered']}" if row["not_covered"] else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
