"""Dependencies point one way (DESIGN.md, "Layers"), and no module imports itself back through others.

    cli -> bench -> calibration -> runtime -> {model, bundle, graphs} -> {contract, errors, config, plotting}; bench -> serving
    export -> {model, bundle, graphs, checkpoints}; engines (builders) -> {runtime, graphs, model, bundle};
    serving -> {runtime, bundle}

Every import statement counts, at module level or inside a function: a lazy import is still a dependency.
"""

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
# source folder -> package (pyproject.toml's package-dir)
FOLDERS = {"specrt": "specrt", "model": "specrt.model", "bundle": "specrt.bundle", "graphs": "specrt.graphs",
           "export": "specrt.export", "runtime": "specrt.runtime", "engines": "specrt.engines",
           "calibration": "specrt.calibration", "bench": "specrt.bench", "serving": "specrt.serving"}
# package prefix -> layer (the longest matching prefix wins)
LAYER_OF = {"specrt.contract": "base", "specrt.errors": "base", "specrt.config": "base", "specrt.plotting": "base",
            "specrt.version": "base", "specrt.files": "base", "specrt.chat": "base", "specrt.held_out": "base",
            "specrt.checkpoints": "checkpoints", "specrt.model": "model", "specrt.bundle": "bundle",
            "specrt.graphs": "graphs", "specrt.export": "export", "specrt.runtime": "runtime", "specrt.engines": "engines",
            "specrt.calibration": "calibration", "specrt.bench": "bench", "specrt.serving": "serving", "specrt.cli": "cli",
            "specrt.__main__": "cli", "specrt": "root"}
BELOW = {
    "base": set(),
    "checkpoints": {"base"},
    "model": {"base"},
    "bundle": {"base"},
    "graphs": {"base"},
    "export": {"base", "model", "bundle", "graphs", "checkpoints"},
    "runtime": {"base", "model", "bundle", "graphs"},  # graphs: the ONNX passes a backend applies as it loads
    "engines": {"base", "model", "bundle", "graphs", "runtime", "checkpoints"},  # builders: check what they build by
    # running it; quantization calibrates on the held-out corpus
    "calibration": {"base", "model", "bundle", "runtime", "checkpoints"},
    "bench": {"base", "model", "bundle", "runtime", "calibration", "checkpoints", "export", "engines", "serving"},
    "serving": {"base", "bundle", "runtime"},  # deployment: a model repository whose decode loop is the runtime's
    "cli": {"base", "model", "bundle", "runtime", "calibration", "checkpoints", "export", "bench", "graphs", "engines",
            "serving"},
    "root": {"base", "runtime"},  # `from specrt import Pipeline`, lazily
}


def modules() -> dict[str, Path]:
    out = {}
    for folder, package in FOLDERS.items():
        for path in sorted((ROOT / folder).rglob("*.py")):
            rel = path.relative_to(ROOT / folder).with_suffix("")
            parts = [p for p in rel.parts if p != "__init__"]
            out[".".join([package, *parts])] = path
    return out


def layer(module: str) -> str:
    for prefix in sorted(LAYER_OF, key=len, reverse=True):
        if module == prefix or module.startswith(prefix + "."):
            return LAYER_OF[prefix]
    raise KeyError(f"{module} belongs to no layer: add it to LAYER_OF")


def imports(path: Path, known: dict) -> set[str]:
    """specrt modules imported anywhere in the file (resolved to the longest known module name)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        names = []
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            # `from a.b import c`: module a.b.c if it is one, else (c is a name in it) a.b
            names = [f"{node.module}.{a.name}" if f"{node.module}.{a.name}" in known else node.module for a in node.names]
        for name in names:
            if name.split(".")[0] != "specrt":
                continue
            while name not in known and "." in name:
                name = name.rsplit(".", 1)[0]
            found.add(name)
    return found


GRAPH = {m: imports(p, modules()) for m, p in modules().items()}


def test_every_module_has_a_layer():
    for m in GRAPH:
        layer(m)


@pytest.mark.parametrize("module", sorted(GRAPH))
def test_imports_point_down(module):
    mine = layer(module)
    bad = [dep for dep in GRAPH[module] if layer(dep) != mine and layer(dep) not in BELOW[mine]]
    assert not bad, f"{module} ({mine}) imports {bad} ({[layer(b) for b in bad]}): dependencies must point down"


def test_no_import_cycles():
    """Within a layer too: no module reaches itself through its imports (package __init__s excluded, since
    importing a submodule runs its package's __init__ by design)."""
    packages = {m for m, p in modules().items() if p.name == "__init__.py"}
    graph = {m: {d for d in deps if d not in packages and d != m} for m, deps in GRAPH.items() if m not in packages}
    state: dict[str, int] = {}

    def visit(m, path):
        state[m] = 1
        for d in graph.get(m, ()):
            if state.get(d) == 1:
                raise AssertionError("import cycle: " + " -> ".join(path[path.index(d):] + [d]))
            if d not in state:
                visit(d, path + [d])
        state[m] = 2

    for m in graph:
        if m not in state:
            visit(m, [m])


def test_the_checker_catches_an_upward_import(tmp_path):
    path = tmp_path / "bad.py"
    path.write_text("def f():\n    from specrt.bench.e2e import run_e2e\n")
    deps = imports(path, modules())
    assert deps == {"specrt.bench.e2e"} and layer("specrt.bench.e2e") not in BELOW["runtime"]
