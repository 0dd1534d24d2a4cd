"""The data layer's modules import each other in one direction: each concern can be read, tested and
imported on its own (imports inside functions count too: they tie modules together just the same)."""
import ast
from pathlib import Path

DATA = Path(__file__).resolve().parents[1] / "pipeline" / "data"


def imported_data_modules(path: Path) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
        elif isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
    return {name.split(".")[2] for name in names if name.startswith("pipeline.data.")} - {path.stem}


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


def test_no_two_data_modules_import_each_other_even_indirectly():
    edges = {path.stem: imported_data_modules(path) for path in DATA.glob("*.py")}
    assert "integrity" in edges["staging"]  # the imports are read (staging raises integrity's errors)
    assert first_cycle(edges) is None, " -> ".join(first_cycle(edges))
