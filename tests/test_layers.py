"""The package's layering, read from the source with `ast` (every import: at module top, in functions, under
TYPE_CHECKING), so a wrong import fails here before it causes an import cycle or drags torch into the SDK.

    trainyard.errors     the errors a user sees: imports nothing of trainyard
    trainyard.parallel   the torch-free vocabulary (layouts, shapes): imports trainyard.errors only
    trainyard.job        the job description: imports neither the SDK, the container nor the engine
    trainyard.container  what runs on a host: does not import the SDK
    trainyard.engine     the training engine: imports nothing of the SDK, the container or the job
    trainyard.kernels    imported by the engine only

In the SDK: no backend (sdk/backends/{local,ec2,sagemaker,kubernetes,terraform}) imports another backend or
the Estimator's face (the SDK's root modules but the store, packaging and the image); sdk/jobs imports no
backend. Pieces several backends share live in sdk/backends/aws/ (or the SDK's root).

Besides: no import cycle among trainyard's modules (imports at module top, which run at import time), and
function-local imports of trainyard's own modules only where ALLOWED_LOCAL says why.
"""
from __future__ import annotations

import ast
import json
import os
import subprocess
import sys
from dataclasses import dataclass

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PACKAGE = os.path.join(REPO, "trainyard")

# (importing module, imported module) -> why that import sits in a function
ALLOWED_LOCAL = {
    ("trainyard.engine", "trainyard.engine.api"): "lazy exports: `import trainyard.engine` stays torch-free",
    ("trainyard.engine", "trainyard.engine.equivalence"): "lazy exports: `import trainyard.engine` stays torch-free",
    ("trainyard.engine", "trainyard.parallel.parallelism"): "lazy exports (the SDK imports the package)",
    ("trainyard.engine", "trainyard.engine.models.llama.model"): "lazy exports: `import trainyard.engine` stays torch-free",
    ("trainyard.engine", "trainyard.engine.models.llama.moe"): "lazy exports: `import trainyard.engine` stays torch-free",
    ("trainyard.engine.components.export", "trainyard.engine.components.checkpoint"):
        "imports torch: export stays importable without it (the CLI imports it)",
    ("trainyard.engine.components.export", "trainyard.engine.components.checkpoint.io"):
        "imports torch: export stays importable without it (the CLI imports it)",
    ("trainyard.engine.models.fused", "trainyard.kernels"):
        "registering the ops imports torch._inductor and torch._dynamo: imported at the first swap, not with the engine",
    ("trainyard.engine.models.fused", "trainyard.kernels.auto"):
        "imports the ops (as trainyard.kernels): imported where kernels are asked for",
    ("trainyard.engine.components.heartbeat", "trainyard.engine.distributed.watch"):
        "imports torch: the driver reads the heartbeat's names without it",
}
# the SDK's import path must not load these
HEAVY = ("torch", "boto3", "botocore", "moto", "transformers", "s3fs")


@dataclass(frozen=True)
class Import:
    source: str  # the importing module
    target: str  # the trainyard module imported (the submodule when `from package import submodule`)
    path: str
    line: int
    local: bool  # inside a function
    type_checking: bool  # under `if TYPE_CHECKING:` (not run)

    @property
    def where(self) -> str:
        return f"{os.path.relpath(self.path, REPO)}:{self.line}"


def _modules() -> dict[str, str]:
    """{module name: file} of every module under trainyard/."""
    out = {}
    for root, dirs, files in os.walk(PACKAGE):
        dirs[:] = sorted(d for d in dirs if not d.startswith((".", "__")))
        for name in sorted(files):
            if name.endswith(".py"):
                path = os.path.join(root, name)
                parts = os.path.relpath(path, REPO)[:-3].split(os.sep)
                out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return out


MODULES = _modules()


def _resolve(name: str) -> str:
    """The longest trainyard module that `name` (a dotted import name) is or is in."""
    while name not in MODULES and "." in name:
        name = name.rsplit(".", 1)[0]
    return name


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or \
        (isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _imports_of(module: str, path: str, source: str | None = None) -> list[Import]:
    if source is None:
        with open(path) as fh:
            source = fh.read()
    tree = ast.parse(source, path)
    package = module if path.endswith("__init__.py") else module.rsplit(".", 1)[0]
    found: list[Import] = []

    def add(name: str, node: ast.stmt, local: bool, tc: bool) -> None:
        if name == "trainyard" or name.startswith("trainyard."):
            found.append(Import(module, _resolve(name), path, node.lineno, local, tc))

    def visit(node: ast.AST, local: bool, tc: bool) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.Import):
                for alias in child.names:
                    add(alias.name, child, local, tc)
            elif isinstance(child, ast.ImportFrom):
                base = child.module or ""
                if child.level:
                    anchor = package.split(".")[: len(package.split(".")) - (child.level - 1)]
                    base = ".".join(anchor + ([base] if base else []))
                for alias in child.names:  # `from package import submodule` imports the submodule
                    sub = f"{base}.{alias.name}"
                    add(sub if sub in MODULES else base, child, local, tc)
            elif isinstance(child, ast.If) and _is_type_checking(child.test):
                for stmt in child.body:
                    visit(ast.Module(body=[stmt], type_ignores=[]), local, True)
                for stmt in child.orelse:
                    visit(ast.Module(body=[stmt], type_ignores=[]), local, tc)
            else:
                visit(child, local or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)), tc)

    visit(tree, False, False)
    return found


IMPORTS = [i for module, path in MODULES.items() for i in _imports_of(module, path)]


def _in(module: str, layer: str) -> bool:
    return module == layer or module.startswith(layer + ".")


def _listing(imports) -> str:
    rows = dict.fromkeys(f"  {i.where}: {i.source} imports {i.target}" + (" (in a function)" if i.local else "")
                         for i in imports)
    return "\n".join(rows)


def test_the_parser_sees_imports_of_every_kind():
    """The reader resolves what the tests below rely on (a test that saw no import would pass vacuously)."""
    assert len(MODULES) > 50 and "trainyard.engine" in MODULES and "trainyard.job.spec" in MODULES
    spec = {(i.target, i.local) for i in IMPORTS if i.source == "trainyard.job.spec"}
    assert ("trainyard.job.catalog", False) in spec  # `from trainyard.job import catalog`: the submodule
    assert ("trainyard.errors", False) in spec
    lazy = {i.target for i in IMPORTS if i.source == "trainyard.engine" and i.local}
    assert {"trainyard.engine.api", "trainyard.parallel.parallelism"} <= lazy
    source = "from . import a\nfrom ..job import spec\nif TYPE_CHECKING:\n    from trainyard.sdk.jobs import job\n" \
             "def f():\n    import trainyard.job.uris\n"
    probe = os.path.join(PACKAGE, "container", "probe_layers.py")  # read from `source`, never written
    got = {(i.target, i.local, i.type_checking) for i in _imports_of("trainyard.container.probe_layers", probe, source)}
    assert got == {("trainyard.container", False, False), ("trainyard.job.spec", False, False),
                   ("trainyard.sdk.jobs.job", False, True), ("trainyard.job.uris", True, False)}


def test_layers():
    rules = [
        ("trainyard.errors", ("trainyard",)),
        ("trainyard.job", ("trainyard.sdk", "trainyard.container", "trainyard.engine")),
        ("trainyard.container", ("trainyard.sdk",)),
        ("trainyard.engine", ("trainyard.sdk", "trainyard.container", "trainyard.job")),
        ("trainyard.engine.distributed", ("trainyard.engine.models",)),  # the model protocol: engine/protocols.py
    ]
    bad = [i for layer, banned in rules for i in IMPORTS
           if _in(i.source, layer) and any(_in(i.target, b) for b in banned)]
    bad += [i for i in IMPORTS if _in(i.source, "trainyard.parallel")
            and not (_in(i.target, "trainyard.parallel") or i.target == "trainyard.errors")]
    bad += [i for i in IMPORTS if _in(i.target, "trainyard.kernels")
            and not (_in(i.source, "trainyard.engine") or _in(i.source, "trainyard.kernels"))]
    assert not bad, "imports across the layers (errors: nothing; parallel: errors only; job: no SDK, container or " \
                    "engine; container: no SDK; engine: none of sdk, container, job; engine.distributed: no " \
                    "engine.models; kernels: the engine's only):\n" + _listing(bad)


BACKENDS = ("local", "ec2", "sagemaker", "kubernetes", "terraform")
# the SDK's root modules a backend may use: infrastructure, not the SageMaker face
SDK_INFRA = ("trainyard.sdk.store", "trainyard.sdk.store_auth", "trainyard.sdk.store_server", "trainyard.sdk.packaging",
             "trainyard.sdk.image", "trainyard.sdk.image_base", "trainyard.sdk.gitsource")


def _backend(module: str) -> str | None:
    parts = module.split(".")
    return parts[3] if len(parts) > 3 and parts[:3] == ["trainyard", "sdk", "backends"] and parts[3] in BACKENDS \
        else None


def test_the_sdk_wings():
    assert {_backend(m) for m in MODULES} >= set(BACKENDS), "a backend's folder is missing"
    face = [m for m in MODULES if m.count(".") == 2 and m.startswith("trainyard.sdk.") and m not in SDK_INFRA]
    assert "trainyard.sdk.estimator" in face
    bad = [i for i in IMPORTS if _backend(i.source) and (
        (_backend(i.target) and _backend(i.target) != _backend(i.source)) or i.target in face)]
    # sdk/jobs: nothing of the backends' folder, their registry (sdk/backends/__init__) and shared AWS plumbing
    # included; that plumbing (sdk/backends/aws) no backend and not the Estimator's face
    bad += [i for i in IMPORTS if _in(i.source, "trainyard.sdk.jobs") and _in(i.target, "trainyard.sdk.backends")]
    bad += [i for i in IMPORTS if _in(i.source, "trainyard.sdk.backends.aws") and (_backend(i.target)
                                                                                  or i.target in face)]
    assert not bad, "a backend (or the AWS plumbing) imports another backend or the Estimator's face, or sdk/jobs " \
                    "imports the backends:\n" + _listing(bad)


def _cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """One cycle (a path that ends where it starts) per strongly connected component that has one (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components: list[list[str]] = []

    def connect(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(edges.get(v, ())):
            if w not in index:
                connect(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1 or v in edges.get(v, ()):
                components.append(sorted(component))

    limit = sys.getrecursionlimit()
    sys.setrecursionlimit(max(limit, 10 * len(MODULES) + 100))
    try:
        for v in sorted(edges):
            if v not in index:
                connect(v)
    finally:
        sys.setrecursionlimit(limit)
    cycles = []
    for component in components:  # a shortest way back to the first module, inside the component
        members, start = set(component), component[0]
        previous, frontier = {start: None}, [start]
        while frontier and start not in [w for v in frontier for w in edges.get(v, ())]:
            nxt = []
            for v in frontier:
                for w in sorted(edges.get(v, ()) & members):
                    if w not in previous:
                        previous[w] = v
                        nxt.append(w)
            frontier = nxt
        last = next(v for v in frontier if start in edges.get(v, ()))
        path = [start]
        while last is not None and last != start:
            path.insert(1, last)
            last = previous[last]
        cycles.append(path + [start])
    return cycles


def test_the_cycle_finder():
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a", "d"}, "d": set()}) == [["a", "b", "c", "a"]]
    assert _cycles({"a": {"b"}, "b": set(), "c": {"c"}}) == [["c", "c"]]
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": set()}) == []


def test_no_import_cycle():
    edges: dict[str, set[str]] = {}
    lines: dict[tuple[str, str], str] = {}
    for i in IMPORTS:
        if not i.local and not i.type_checking and i.target != i.source:
            edges.setdefault(i.source, set()).add(i.target)
            lines.setdefault((i.source, i.target), i.where)
    cycles = _cycles(edges)
    assert not cycles, "import cycles among module-top imports:\n" + "\n".join(
        "  " + " -> ".join(c) + "\n" + "".join(f"      {lines[(a, b)]}: {a} imports {b}\n" for a, b in zip(c, c[1:]))
        for c in cycles)


def test_function_local_imports_of_trainyard_only_where_allowed():
    local = [i for i in IMPORTS if i.local and (i.source, i.target) not in ALLOWED_LOCAL]
    assert not local, "function-local imports of trainyard modules (move them to the module's top, or add them " \
                      "to ALLOWED_LOCAL with the reason):\n" + _listing(local)
    unused = set(ALLOWED_LOCAL) - {(i.source, i.target) for i in IMPORTS if i.local}
    assert not unused, f"ALLOWED_LOCAL entries no import needs any more: {sorted(unused)}"


def _who_imported(importtime: str, name: str) -> list[str]:
    """The import chain that loaded `name`, from `python -X importtime`'s output (children print before
    their parent, one more level of indentation each)."""
    rows = []
    for line in importtime.splitlines():
        if line.startswith("import time:") and "|" in line:
            field = line.split("|")[-1]
            stripped = field.lstrip()
            if stripped and stripped != "imported package":
                rows.append(((len(field) - len(stripped)) // 2, stripped.strip()))
    at = next((k for k, (_, mod) in enumerate(rows) if mod == name), None)
    if at is None:
        return [name]
    chain, depth = [rows[at][1]], rows[at][0]
    for level, mod in rows[at + 1:]:
        if level < depth:
            chain.insert(0, mod)
            depth = level
    return chain


def test_the_sdk_imports_without_torch_or_boto3():
    """Importing the SDK, and an Estimator of the built-in trainer (whose hyperparameters it checks with the
    trainer's own config), load none of the heavy modules: `Estimator(...)` took 2.3 s when that check imported
    torch."""
    code = ("import json, sys; import trainyard.sdk.estimator as e; "
            "e.Estimator(entry_point='trainyard.engine.train', instance_type='local', "
            "hyperparameters={'model': 'tiny', 'steps': 2, 'checkpoint_uri': 's3://b/c'}); "
            f"print(json.dumps([m for m in {list(HEAVY)!r} if m in sys.modules]))")
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    r = subprocess.run([sys.executable, "-X", "importtime", "-c", code], cwd=REPO, env=env, capture_output=True,
                       text=True, timeout=120)
    errors = "\n".join(line for line in r.stderr.splitlines() if not line.startswith("import time:"))
    assert r.returncode == 0, f"import trainyard.sdk.estimator failed:\n{errors}"
    loaded = json.loads(r.stdout.strip().splitlines()[-1])
    assert not loaded, "import trainyard.sdk.estimator loads " + "; ".join(
        " <- ".join(reversed(_who_imported(r.stderr, m))) for m in loaded)
