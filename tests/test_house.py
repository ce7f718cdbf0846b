"""The house rules a reader can check by machine (DESIGN.md, "One home per idea"): a backend is asked what it can do
(runtime/backends/kinds.py), never picked out by comparing its name."""

import ast

from specrt.runtime.backends import BACKENDS
from tests.test_layers import modules

REGISTRY = "specrt.runtime.backends.kinds"


def _names(node: ast.AST) -> set[str]:
    """The backend names a comparison operand spells out: a string, or the strings of a tuple, list or set."""
    items = node.elts if isinstance(node, (ast.Tuple, ast.List, ast.Set)) else [node]
    return {i.value for i in items if isinstance(i, ast.Constant) and i.value in BACKENDS}


def backend_name_comparisons(source: str) -> list[str]:
    """Each comparison of something named like a backend (or an engine set's kind) against a backend's name."""
    out = []
    for node in ast.walk(ast.parse(source)):
        if not isinstance(node, ast.Compare):
            continue
        operands = [node.left, *node.comparators]
        named = any(_names(o) for o in operands)
        about = any("backend" in ast.unparse(o) or "kind" in ast.unparse(o) for o in operands if not _names(o))
        if named and about:
            out.append(f"line {node.lineno}: {ast.unparse(node)}")
    return out


def test_the_check_sees_a_comparison_of_a_backend_name():
    assert backend_name_comparisons('if cfg.backend == "trt": pass') == ["line 1: cfg.backend == 'trt'"]
    assert backend_name_comparisons('x = e.kind in ("static", "ort")') == ["line 1: e.kind in ('static', 'ort')"]
    assert backend_name_comparisons('x = kwargs.get("cache_implementation") != "static"') == []


def test_no_module_outside_the_registry_compares_a_backend_name():
    found = {module: hits for module, path in modules().items() if module != REGISTRY
             for hits in [backend_name_comparisons(path.read_text())] if hits}
    assert not found, found


THIRD_PARTY = {"_schema"}  # torch's OpOverload._schema (bench/kernels.py), the one way to an operator's schema


def _private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def foreign_private_uses(source: str) -> list[str]:
    """Each use of a private name that this module neither defines nor binds: another module's private member,
    reached through an object (`pipe._scheduler`) or imported (`from m import _helper`). Third-party internals
    (`torch._C`) are the libraries' own business."""
    tree = ast.parse(source)
    own = {n.name for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))}
    own |= {n.attr for n in ast.walk(tree) if isinstance(n, ast.Attribute) and isinstance(n.ctx, ast.Store)}
    own |= {t.id for n in ast.walk(tree) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Store) for t in [n]}
    out = []
    for n in ast.walk(tree):
        if isinstance(n, ast.ImportFrom) and (n.module or "").startswith("specrt"):
            out += [f"line {n.lineno}: from {n.module} import {a.name}" for a in n.names if _private(a.name)]
        elif isinstance(n, ast.Attribute) and _private(n.attr) and n.attr not in own | THIRD_PARTY:
            root = n.value
            while isinstance(root, (ast.Attribute, ast.Call, ast.Subscript)):
                root = root.func if isinstance(root, ast.Call) else root.value
            if not (isinstance(root, ast.Name) and root.id in ("torch", "np", "self", "cls", "super")):
                out.append(f"line {n.lineno}: {ast.unparse(n)}")
    return out


def test_the_check_sees_another_modules_private_member():
    assert foreign_private_uses("def f(pipe):\n    return pipe._result(1)") == ["line 2: pipe._result"]
    assert foreign_private_uses("from specrt.x import _helper") == ["line 1: from specrt.x import _helper"]
    assert foreign_private_uses("class A:\n    def f(self, b):\n        self._x = b._x") == []  # its own class's
    assert foreign_private_uses("import torch\ntorch._C._cuda_clearCublasWorkspaces()") == []


def test_no_module_reaches_into_another_modules_private_members():
    found = {module: hits for module, path in modules().items()
             for hits in [foreign_private_uses(path.read_text())] if hits}
    assert not found, found
