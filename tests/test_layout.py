"""The package's boundaries: what may import what, and the launchers start without jax.

jaxtrain/launch and jaxtrain/health sit on top of the rest: nothing else in jaxtrain imports them.
The launchers never import jax, so `scripts/run_distributed.py --help` answers at once and a
launcher never holds a GPU.

    pytest tests/test_layout.py      # a few seconds
"""

import ast
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
PACKAGE = REPO / "jaxtrain"
ON_TOP = ("jaxtrain.launch", "jaxtrain.health")
NO_JAX = ("jaxtrain.parser", "jaxtrain.launch.cli", "jaxtrain.launch.local", "jaxtrain.launch.supervise")


def _module_name(path: Path, root: Path = REPO) -> str:
    parts = path.relative_to(root).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imported_modules(path: Path, root: Path = REPO) -> set[str]:
    """Every module a file imports, at any depth (in functions too), relative imports resolved;
    `from a import b` counts as both a and a.b, since b may be a module."""
    name = _module_name(path, root)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*anchor, *([base] if base else [])])
            found.add(base)
            found.update(f"{base}.{alias.name}" for alias in node.names)
    return found


def _is_in(module: str, packages: tuple[str, ...]) -> bool:
    return any(module == p or module.startswith(p + ".") for p in packages)


def test_imported_modules_sees_every_form_of_import(tmp_path):
    pkg = tmp_path / "jaxtrain" / "sub"
    pkg.mkdir(parents=True)
    source = pkg / "mod.py"
    source.write_text(
        "import jaxtrain.launch.cli\n"
        "from jaxtrain import health\n"
        "def f():\n"
        "    from ..launch import slurm\n"
        "    from . import sibling\n"
    )
    found = imported_modules(source, root=tmp_path)
    for module in ("jaxtrain.launch.cli", "jaxtrain.health", "jaxtrain.launch.slurm", "jaxtrain.sub.sibling"):
        assert module in found, (module, found)


@pytest.mark.parametrize(
    "path",
    [p for p in sorted(PACKAGE.rglob("*.py")) if not _is_in(_module_name(p), ON_TOP)],
    ids=lambda p: str(p.relative_to(REPO)),
)
def test_the_core_never_imports_the_launchers_or_the_health_check(path):
    wrong = sorted(m for m in imported_modules(path) if _is_in(m, ON_TOP))
    assert not wrong, f"{path.relative_to(REPO)} imports {wrong}: they import it, not the other way round"


def _jax_modules(names: list[str]) -> list[str]:
    return sorted(n for n in names if n.split(".")[0] in ("jax", "jaxlib"))


def test_the_launchers_import_no_jax():
    probe = "import sys\n" + "".join(f"import {m}\n" for m in NO_JAX) + "print('\\n'.join(sys.modules))"
    done = subprocess.run([sys.executable, "-c", probe], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert _jax_modules(done.stdout.split()) == []


def test_run_distributed_help_imports_no_jax():
    done = subprocess.run(
        [sys.executable, "-X", "importtime", "scripts/run_distributed.py", "--help"],
        cwd=REPO, capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert done.returncode == 0 and "--mode" in done.stdout, done.stderr[-3000:]
    # stderr: "import time: <self us> | <cumulative us> | <indented module name>" per import
    lines = [x for x in done.stderr.splitlines() if x.startswith("import time:")]
    imported = [x.rpartition("|")[2].strip() for x in lines]
    assert "jaxtrain.launch.cli" in imported, done.stderr[-3000:]
    assert _jax_modules(imported) == []


# What asks jax where this process sits: only the job (and the mesh, which lays devices out) may.
TOPOLOGY_CALLS = {
    "devices", "local_devices", "device_count", "local_device_count", "process_index", "process_count",
    "default_backend",
}  # fmt: skip
TOPOLOGY_OWNERS = ("jaxtrain.run.job", "jaxtrain.parallel.mesh")
CORE = [
    p for p in sorted(PACKAGE.rglob("*.py")) if not _is_in(_module_name(p), (*ON_TOP, "jaxtrain.cluster"))
]


def _topology_calls(path: Path) -> list[str]:
    """`jax.<topology query>(...)` calls in a file, as 'line: name'."""
    return [
        f"{node.lineno}: jax.{node.func.attr}()"
        for node in ast.walk(ast.parse(path.read_text(), str(path)))
        if isinstance(node, ast.Call)
        and isinstance(node.func, ast.Attribute)
        and node.func.attr in TOPOLOGY_CALLS
        and isinstance(node.func.value, ast.Name)
        and node.func.value.id == "jax"
    ]


@pytest.mark.parametrize("path", CORE, ids=lambda p: str(p.relative_to(REPO)))
def test_only_the_job_and_the_mesh_ask_jax_for_the_topology(path):
    if _is_in(_module_name(path), TOPOLOGY_OWNERS):
        return
    calls = _topology_calls(path)
    assert not calls, (
        f"{path.relative_to(REPO)} asks jax where it runs ({calls}); ask the Job (jaxtrain/run/job.py)"
    )


def test_the_topology_rule_finds_a_query(tmp_path):
    source = tmp_path / "m.py"
    source.write_text("import jax\n\ndef f():\n    return jax.process_index() + len(jax.devices())\n")
    assert _topology_calls(source) == ["4: jax.process_index()", "4: jax.devices()"]


# Preparing data (scripts/prepare_data.py) needs no accelerator stack and nothing of training; nor
# do the text formats it shares with training (jaxtrain/text/).
PREPARE_MAY_IMPORT = (
    "jaxtrain.prepare",
    "jaxtrain.text",
    "jaxtrain.tokenizer",
    "jaxtrain.disk.files",
    "jaxtrain.disk.bucket",  # inputs and outputs in buckets (fsspec, imported only when one is named)
    "jaxtrain.disk.remote",  # a tokenizer in a bucket
    "jaxtrain.errors",
    "jaxtrain.parser",  # prepare/cli.py: a bad flag is one line, as in every script
    "jaxtrain.cluster.lifeline",  # tokenizing workers die with their parent
)


@pytest.mark.parametrize(
    "path",
    sorted([*(PACKAGE / "prepare").glob("*.py"), *(PACKAGE / "text").glob("*.py")]),
    ids=lambda p: f"{p.parent.name}/{p.name}",
)
def test_prepare_imports_nothing_of_training(path):
    ours = {m for m in imported_modules(path) if m.split(".")[0] == "jaxtrain"}
    wrong = sorted(
        m
        for m in ours
        if not _is_in(m, PREPARE_MAY_IMPORT) and m not in ("jaxtrain", "jaxtrain.data", "jaxtrain.disk")
    )
    heavy = sorted(
        m for m in imported_modules(path) if m.split(".")[0] in ("jax", "jaxlib", "flax", "optax", "orbax")
    )
    assert not wrong and not heavy, f"{path.name} imports {wrong + heavy}"


@pytest.mark.parametrize(
    "script", sorted(p.name for p in (REPO / "scripts").iterdir() if p.suffix in (".py", ".sh"))
)
def test_every_script_answers_help(script):
    cmd = [sys.executable if script.endswith(".py") else "bash", f"scripts/{script}", "--help"]
    done = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and len(done.stdout.splitlines()) > 3, done.stdout + done.stderr[-2000:]
    # A usage line continued with a backslash shows as written, not joined to the next one
    doc = (REPO / "scripts" / script).read_text().split('"""')[1] if script.endswith(".py") else ""
    if doc and doc.splitlines()[0] in done.stdout:
        shown = {line.strip() for line in done.stdout.splitlines()}
        continued = [line.strip() for line in doc.splitlines() if line.endswith(" \\")]
        assert all(line in shown for line in continued), [c for c in continued if c not in shown]


def _import_graph(root: Path = REPO) -> dict[str, set[str]]:
    """Module -> the package's modules it imports, at any depth (TYPE_CHECKING and in-function too).
    `from a import b` counts as an import of a.b when b is a module, else of a."""
    files = sorted((root / "jaxtrain").rglob("*.py"))
    modules = {_module_name(p, root) for p in files}
    graph = {}
    for p in files:
        name = _module_name(p, root)
        found = set()
        for m in imported_modules(p, root):
            if m in modules:
                found.add(m)
            elif m.rpartition(".")[0] in modules:  # `from pkg.mod import name`: the module
                found.add(m.rpartition(".")[0])
        graph[name] = found - {name}
    return graph


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Import cycles, one per strongly connected component (Tarjan), each as a path that closes."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_no_import_cycles_inside_the_package():
    """A package's __init__ counts as importing nothing but what it names, so `jaxtrain.x.y` importing
    `jaxtrain.x` (its docstring-only parent) is no cycle; any other loop is, whether its imports sit at
    the top or inside functions (a deferred import only hides a cycle, it does not break it)."""
    cycles = _cycles(_import_graph())
    assert not cycles, f"import cycles: {cycles}"


def test_the_cycle_rule_finds_a_cycle_hidden_in_a_function(tmp_path):
    pkg = tmp_path / "jaxtrain"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "a.py").write_text("from jaxtrain import b\n")
    (pkg / "b.py").write_text("def f():\n    from jaxtrain.c import g\n")
    (pkg / "c.py").write_text("from jaxtrain.a import x\n")
    (pkg / "d.py").write_text("import jaxtrain.a\n")
    assert _cycles(_import_graph(tmp_path)) == [["jaxtrain.a", "jaxtrain.b", "jaxtrain.c"]]


# The rooms, bottom first: a module imports only from its own room or from rooms before it, so the
# package reads upwards from errors to the scripts' entry points and no change can close a loop.
ROOMS = (
    "errors", "versions", "parser", "faults", "tokenizer", "text", "config", "cluster", "model", "disk",
    "prepare", "data", "hf", "observe", "xla_env", "parallel", "run", "plan", "health", "launch",
)  # fmt: skip


def _room(module: str) -> str:
    return module.split(".")[1] if "." in module else ""


def _upward_imports(graph: dict[str, set[str]]) -> list[str]:
    order = {room: i for i, room in enumerate(ROOMS)}
    return sorted(
        f"{m} -> {d}"
        for m, deps in graph.items()
        for d in deps
        if _room(d) and _room(m) and order[_room(d)] > order[_room(m)]
    )


def test_every_room_is_placed():
    rooms = {_room(m) for m in _import_graph()} - {""}
    assert rooms == set(ROOMS), (
        f"place {sorted(rooms - set(ROOMS))} in ROOMS; drop {sorted(set(ROOMS) - rooms)}"
    )


def test_rooms_import_downwards_only():
    wrong = _upward_imports(_import_graph())
    assert not wrong, f"imports of a room above the importer's (see ROOMS): {wrong}"


def test_the_room_rule_finds_an_upward_import():
    assert _upward_imports({"jaxtrain.data.loader": {"jaxtrain.run.job"}}) == [
        "jaxtrain.data.loader -> jaxtrain.run.job"
    ]


def test_the_command_lines_import_no_jax_before_they_set_it_up():
    """scripts/train.py sets XLA_FLAGS and plan.py puts the CUDA plugin on the path before jax
    starts: both read their flags and config with no jax imported (an import of jax under hf/
    once left plan.py without its plugin: "topology not implemented for cuda")."""
    code = (
        "import sys\nimport jaxtrain.plan.cli, jaxtrain.run.cli\nfrom jaxtrain.config import load_config\n"
        "from jaxtrain.hf.config import with_hf_model\n"
        "load_config(['--config', 'configs/deepseek_tiny.yaml'], '', fill=with_hf_model)\n"
        "print(sorted(m for m in sys.modules if m.split('.')[0] in ('jax', 'flax', 'optax')))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        cwd=Path(__file__).parents[1],
        check=True,
    )
    assert out.stdout.strip() == "[]", out.stdout


# The model apart from how it is split (model/placement.py): what splits it lives in parallel/.
COLLECTIVES = {
    "psum", "pmean", "pmax", "psum_scatter", "all_gather", "all_to_all", "ragged_all_to_all", "ppermute",
    "axis_index", "axis_size", "shard_map", "get_abstract_mesh", "logical_to_mesh_axes", "set_mesh",
}  # fmt: skip
# Mesh axis names the model must not say (`expert` is also the logical axis of experts' params).
MESH_ONLY_AXES = {"pipeline", "data", "fsdp", "context", "tensor"}


def _mesh_knowledge(path: Path, root: Path = REPO) -> list[str]:
    """What in a file splits a model over a mesh, as 'line: what': a collective or shard_map, a read
    of the mesh, a mesh axis named, or an import of parallel/."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Attribute) and node.attr in COLLECTIVES:
            found.append(f"{node.lineno}: .{node.attr}")
        elif isinstance(node, ast.Constant) and node.value in MESH_ONLY_AXES:
            found.append(f"{node.lineno}: {node.value!r}")
    imported = sorted(imported_modules(path, root))
    return found + [f"imports {m}" for m in imported if _is_in(m, ("jaxtrain.parallel",))]


@pytest.mark.parametrize("path", sorted((PACKAGE / "model").glob("*.py")), ids=lambda p: p.name)
def test_the_model_knows_no_mesh(path):
    found = _mesh_knowledge(path)
    assert not found, f"{path.relative_to(REPO)}: {found}; splitting a model belongs in jaxtrain/parallel/"


def test_the_mesh_rule_finds_a_collective_a_mesh_axis_and_parallel(tmp_path):
    source = tmp_path / "jaxtrain" / "m.py"
    source.parent.mkdir()
    source.write_text(
        "import jax\nfrom jaxtrain.parallel import mesh\n\ndef f(x):\n    return jax.lax.psum(x, 'tensor')\n"
    )
    assert _mesh_knowledge(source, root=tmp_path) == [
        "5: .psum",
        "5: 'tensor'",
        "imports jaxtrain.parallel",
        "imports jaxtrain.parallel.mesh",
    ]


def _layout_bullets() -> list[str]:
    """docs/layout.md's bullets, one string each (its continuation lines joined)."""
    text = (REPO / "docs" / "layout.md").read_text()
    return [" ".join(b.split()) for b in text.split("\n- ")[1:]]


@pytest.mark.parametrize(
    "path",
    [p for p in sorted(PACKAGE.rglob("*.py")) if p.name != "__init__.py"],
    ids=lambda p: str(p.relative_to(PACKAGE)),
)
def test_docs_layout_names_every_module_in_its_room(path):
    room = path.parent.name
    where = "Flat:" if path.parent == PACKAGE else f"`{room}/`"
    bullet = next((b for b in _layout_bullets() if where in b), "")
    assert f"`{path.stem}`" in bullet, f"docs/layout.md: name `{path.stem}` in the bullet of {where}"
