"""The shape of the code, read from the source with `ast` (nothing is imported): no package imports one
that imports it back, directly or through others (an arrow back up), and no file is two ideas' worth of
lines. The packages are the directories of april_ray/, actors/, driver/, jobs/ and sim/; a module of
april_ray/ itself (types.py, config.py, ...) stands alone, so `config.py` may ask the task registry while the
task package needs only `types.py`. An import under `if TYPE_CHECKING:` never runs and draws no arrow."""
import ast
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
ROOMS = ("april_ray", "actors", "driver", "jobs", "sim")
MAX_LINES = 450
LONGER_ALLOWED = {"april_ray/config.py"}  # one schema: a dataclass per component, each field's rule beside it


def sources(root: Path = ROOT):
    for room in ROOMS:
        yield from sorted((root / room).rglob("*.py"))


def module_of(file: Path, root: Path) -> str:
    parts = file.relative_to(root).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def package_of(module: str, root: Path) -> str:
    """A package's own name, or the package a module file is in (a module of april_ray/ itself: its own)."""
    if (root / module.replace(".", "/")).is_dir() or module.count(".") == 1 and module.startswith("april_ray."):
        return module
    return module.rpartition(".")[0] or module


def _type_checking_only(tree: ast.AST) -> set[int]:
    """The ids of the nodes under `if TYPE_CHECKING:` (or `typing.TYPE_CHECKING`)."""
    skipped = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            skipped |= {id(inner) for stmt in node.body for inner in ast.walk(stmt)}
    return skipped


def existing(name: str, root: Path) -> str | None:
    """The longest prefix of a dotted name that is a module or package of ours (None: not ours)."""
    parts = name.split(".")
    if parts[0] not in ROOMS:
        return None
    while parts:
        path = root.joinpath(*parts)
        if path.is_dir() or path.with_suffix(".py").is_file():
            return ".".join(parts)
        parts.pop()
    return None


def imports(file: Path, root: Path) -> set[str]:
    """Every module or package of ours `file` imports, at the top or inside a function."""
    module = module_of(file, root)
    here = module.split(".") if file.name == "__init__.py" else module.split(".")[:-1]
    found, tree = set(), ast.parse(file.read_text(), str(file))
    skipped = _type_checking_only(tree)
    for node in ast.walk(tree):
        if id(node) in skipped:
            continue
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(here[:len(here) - node.level + 1] + ([base] if base else []))
            names = [f"{base}.{alias.name}" for alias in node.names]
        else:
            continue
        found |= {target for name in names if (target := existing(name, root)) is not None}
    return found


def package_graph(root: Path = ROOT) -> dict[str, dict[str, list[str]]]:
    """{package: {package it imports: [files that import it]}}."""
    graph: dict[str, dict[str, list[str]]] = defaultdict(lambda: defaultdict(list))
    for file in sources(root):
        source = package_of(module_of(file, root), root)
        for target in imports(file, root):
            if (package := package_of(target, root)) != source:
                graph[source][package].append(str(file.relative_to(root)))
    return graph


def path_back(graph, start: str, goal: str) -> list[str] | None:
    """The packages from `start` to `goal` along import arrows (None: `goal` is not reached)."""
    came_from, todo = {start: None}, [start]
    while todo:
        package = todo.pop(0)
        if package == goal:
            path = []
            while package is not None:
                path.append(package)
                package = came_from[package]
            return path[::-1]
        for nxt in sorted(graph.get(package, {})):
            if nxt not in came_from:
                came_from[nxt] = package
                todo.append(nxt)
    return None


def arrows_back(root: Path = ROOT) -> list[str]:
    """Each import from a package into one that imports it back, with the files on the way."""
    graph = package_graph(root)
    found = []
    for source in sorted(graph):
        for target, files in sorted(graph[source].items()):
            back = path_back(graph, target, source)
            if back is not None:
                steps = [f"{a} -> {b} ({_few(graph[a][b])})" for a, b in zip(back, back[1:])]
                found.append(f"{source} -> {target} ({_few(files)}), and back: {'; '.join(steps)}")
    return found


def _few(files: list[str], most: int = 3) -> str:
    names = sorted(set(files))
    return ", ".join(names[:most]) + (f" and {len(names) - most} more" if len(names) > most else "")


def too_long(root: Path = ROOT) -> list[str]:
    lengths = {str(f.relative_to(root)): len(f.read_text().splitlines()) for f in sources(root)}
    return [f"{name}: {n} lines" for name, n in sorted(lengths.items()) if n > MAX_LINES and name not in LONGER_ALLOWED]


def test_no_package_imports_one_that_imports_it_back():
    assert not arrows_back(), "\n".join(arrows_back())


def test_no_file_is_over_450_lines_but_the_config_schema():
    assert not too_long(), "\n".join(too_long())


def test_the_checks_catch_an_arrow_back_up_and_a_long_file(tmp_path):
    """On a tree of our own: `april_ray.engine` and `april_ray.weights` importing each other (one of the
    imports relative, inside a function), and a long file; an arrow down alone, or one back under
    TYPE_CHECKING, is no finding; a module of april_ray/ importing a package that imports it back is one."""
    files = {"april_ray/__init__.py": "", "april_ray/types.py": "",
             "april_ray/engine/__init__.py": "from april_ray import types\n",
             "april_ray/engine/client.py": "def f():\n    from ..weights.tensor import send\n",
             "april_ray/weights/__init__.py": "",
             "april_ray/weights/tensor.py": "from april_ray.engine.client import f\nimport april_ray.types\n",
             "driver/checkpoint.py": "import april_ray.engine.client\n" + "x = 1\n" * MAX_LINES,
             "april_ray/config.py": "x = 1\n" * (MAX_LINES + 1)}
    for name, text in files.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    found = arrows_back(tmp_path)
    assert len(found) == 2 and found[0].startswith("april_ray.engine -> april_ray.weights "
                                                   "(april_ray/engine/client.py), and back"), found
    assert "april_ray.weights -> april_ray.engine (april_ray/weights/tensor.py)" in found[0]
    assert too_long(tmp_path) == [f"driver/checkpoint.py: {MAX_LINES + 1} lines"]
    (tmp_path / "april_ray/engine/client.py").write_text("")
    assert arrows_back(tmp_path) == []
    (tmp_path / "april_ray/config.py").write_text("def check():\n    from april_ray.engine import client\n")
    (tmp_path / "april_ray/engine/__init__.py").write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from april_ray import config\n")
    assert arrows_back(tmp_path) == []
    (tmp_path / "april_ray/engine/__init__.py").write_text("from april_ray.config import check\n")
    assert [f.split(",")[0] for f in arrows_back(tmp_path)] == ["april_ray.config -> april_ray.engine (april_ray/config.py)",
                                                                "april_ray.engine -> april_ray.config (april_ray/engine/__init__.py)"]
