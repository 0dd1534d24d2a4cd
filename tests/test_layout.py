"""vitsweep's layout: ``pipeline/`` grouped by role, every folder importing only the layers below it, no
import circle anywhere (imports inside functions count too: they tie modules together just the same), and
modules and functions short enough to read as one concern (``../shared/design/LAYOUT.md``)."""
import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("pipeline", "models")
# pipeline/'s layers, top to bottom: a module imports from its own layer or one below. A folder is one
# layer; a module at pipeline/'s top is one of its own.
LAYERS = [
    {"pipeline.__main__", "pipeline.cli", "pipeline.serving"},  # pipeline.serving: old models' pyfunc loader
    {"pipeline.sweeps"},
    {"pipeline.training"},
    {"pipeline.trained"},
    {"pipeline.tracking"},
    {"pipeline.components"},
    {"pipeline.ray_connection"},
    {"pipeline.data"},
    {"pipeline.config"},
    {"pipeline.console", "pipeline.interrupts"},
    {"pipeline.uris"},
    {"pipeline.atomic", "pipeline.errors", "pipeline.report_keys", "pipeline"},
    {"models"},
]
# Imports that go up a layer, each with its reason.
UPWARD = {
    # The schema refuses a RandAugment spec on load, parsed as the loaders will parse it, rather than in
    # a loader thread mid-epoch; imported inside the validator, so the config never imports torch for it.
    ("pipeline.config.schema", "pipeline.data.rand_augment"),
}


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def modules() -> dict[str, Path]:
    return {module_name(path): path for package in PACKAGES for path in (ROOT / package).rglob("*.py")}


def imported_modules(path: Path, known: set[str], top_level_only: bool = False) -> set[str]:
    """The modules of ``known`` that ``path`` imports, anywhere in it unless ``top_level_only``
    (``from pipeline import uris`` names the module ``pipeline.uris``; ``from pipeline.uris import
    redact``, ``pipeline.uris``; ``from .layers import qkv`` inside ``models``, ``models.layers.qkv``)."""
    package = module_name(path) if path.name == "__init__.py" else module_name(path).rpartition(".")[0]
    tree = ast.parse(path.read_text())
    names = set()
    for node in tree.body if top_level_only else ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")
                base = ".".join([*parts[:len(parts) - node.level + 1], *filter(None, [base])])
            names.update(f"{base}.{alias.name}" if f"{base}.{alias.name}" in known else base for alias in node.names)
        elif isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
    found = set()
    for name in names:
        while name and name not in known:
            name = name.rpartition(".")[0]
        if name:
            found.add(name)
    return found - {module_name(path)}


def import_graph() -> dict[str, set[str]]:
    known = modules()
    return {name: imported_modules(path, set(known)) for name, path in known.items()}


def first_cycle(edges: dict[str, set[str]]) -> list[str] | None:
    done: set[str] = set()

    def visit(module: str, path: list[str]) -> list[str] | None:
        if module in path:
            return path[path.index(module):] + [module]
        if module in done:
            return None
        for target in sorted(edges.get(module, ())):
            if cycle := visit(target, path + [module]):
                return cycle
        done.add(module)
        return None

    return next((cycle for module in sorted(edges) if (cycle := visit(module, []))), None)


def layer(module: str) -> int:
    """The index in LAYERS of the layer ``module`` belongs to (its longest listed prefix)."""
    owners = [(len(prefix), index) for index, members in enumerate(LAYERS) for prefix in members
              if module == prefix or module.startswith(prefix + ".")]
    assert owners, f"{module} is in no layer of LAYERS: place it"
    return max(owners)[1]


def test_the_import_graph_reads_every_kind_of_import():
    edges = import_graph()
    assert "pipeline.data.integrity" in edges["pipeline.data.staging"]  # from pipeline.data.integrity import ...
    assert "pipeline.uris" in edges["pipeline.trained.model_source"]  # from pipeline import uris
    assert "pipeline.tracking.system_metrics" in edges["pipeline.training.worker"]  # inside a method
    assert "models.layers.qkv" in edges["models.xcit"]  # within models/


def test_no_module_of_pipeline_or_models_imports_itself_even_indirectly():
    cycle = first_cycle(import_graph())
    assert cycle is None, " -> ".join(cycle)


def test_a_circle_is_found_however_long():
    assert first_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": set()}) == ["a", "b", "c", "a"]
    assert first_cycle({"a": {"b"}, "b": {"c"}, "c": set()}) is None


def test_every_module_of_pipeline_imports_only_its_own_layer_or_those_below():
    upward = sorted((module, target) for module, targets in import_graph().items() if module.startswith("pipeline")
                    for target in targets if layer(target) < layer(module) and (module, target) not in UPWARD)
    assert not upward, "\n".join(f"{module} imports {target}, a layer above it" for module, target in upward)


def test_the_upward_imports_allowed_are_still_there_and_inside_a_function():
    edges = import_graph()
    for module, target in UPWARD:
        assert target in edges[module], f"{module} no longer imports {target}: drop it from UPWARD"
        top_level = imported_modules(modules()[module], set(modules()), top_level_only=True)
        assert target not in top_level, f"{module} imports {target} at its top: the cost reaches every importer"


def _lines(path: Path) -> int:
    return len(path.read_text().splitlines())


def test_no_module_of_pipeline_is_over_600_lines():
    """A longer module holds more than one concern: split it by concern (a module that is one concern
    could stay longer, with the reason in its docstring; none is today)."""
    long = {name: _lines(path) for name, path in modules().items() if name.startswith("pipeline") and _lines(path) > 600}
    assert not long, long


def test_no_function_of_pipeline_is_over_70_lines():
    """A longer function does several things: the recipe should name them (torchtitan's train loop)."""
    long = {}
    for name, path in modules().items():
        if not name.startswith("pipeline"):
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.end_lineno - node.lineno + 1 > 70:
                long[f"{name}.{node.name}"] = node.end_lineno - node.lineno + 1
    assert not long, long
