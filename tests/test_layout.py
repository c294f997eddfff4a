"""The layout of easylm/: no import circles (a late import inside a function to dodge a
circle is still one: every import, at module level or inside a function, is an edge), no
function over 60 lines, and the model contract as narrow as docs/families.md says."""

import ast
import pathlib

import easylm

ROOT = pathlib.Path(easylm.__file__).parent


def modules(root=ROOT):
    """{'easylm.data.dataset': path, 'easylm.data': path of its __init__.py, ...}"""
    found = {}
    for path in sorted(root.rglob("*.py")):
        parts = path.relative_to(root.parent).with_suffix("").parts
        if parts[-1] == "__init__":
            parts = parts[:-1]
        found[".".join(parts)] = path
    return found


def imports(name, path, known):
    """The modules of `known` that module `name` imports anywhere in its file. `from pkg
    import x` is an edge to pkg.x when that is a module, else to pkg."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    edges = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            edges.update(alias.name for alias in node.names if alias.name in known)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:   # relative: . is the package, .. its parent
                parts = package.split(".")[:len(package.split(".")) - node.level + 1]
                base = ".".join(parts + ([base] if base else []))
            for alias in node.names:
                full = f"{base}.{alias.name}"
                if full in known:
                    edges.add(full)
                elif base in known:
                    edges.add(base)
    edges.discard(name)
    return edges


def find_cycle(graph):
    """One cycle of `graph` ({node: set of nodes}) as [a, b, ..., a], or None."""
    state = {}   # absent: unvisited; 1: on the current path; 2: done
    path = []

    def visit(node):
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                return path[path.index(nxt):] + [nxt]
            if nxt not in state:
                cycle = visit(nxt)
                if cycle:
                    return cycle
        state[node] = 2
        path.pop()
        return None

    for node in sorted(graph):
        if node not in state:
            cycle = visit(node)
            if cycle:
                return cycle
    return None


def import_graph(root=ROOT):
    known = modules(root)
    return {name: imports(name, path, known) for name, path in known.items()}


def test_find_cycle_finds_one_and_only_one():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b", "c"}, "b": {"c"}, "c": set()}) is None


def test_the_graph_sees_late_and_relative_imports(tmp_path):
    package = tmp_path / "pkg"
    (package / "sub").mkdir(parents=True)
    (package / "__init__.py").write_text("")
    (package / "sub" / "__init__.py").write_text("")
    (package / "a.py").write_text("def f():\n    from pkg.sub import b\n")
    (package / "sub" / "b.py").write_text("from .. import a\nfrom . import c\n")
    (package / "sub" / "c.py").write_text("from pkg.sub import thing\n")
    graph = import_graph(package)
    assert graph == {"pkg": set(), "pkg.a": {"pkg.sub.b"}, "pkg.sub": set(),
                     "pkg.sub.b": {"pkg.a", "pkg.sub.c"}, "pkg.sub.c": {"pkg.sub"}}
    assert find_cycle(graph) == ["pkg.a", "pkg.sub.b", "pkg.a"]


def test_easylm_has_no_import_cycle():
    graph = import_graph()
    assert len(graph) > 50 and "easylm.data.dataset" in graph["easylm.data"]
    cycle = find_cycle(graph)
    assert cycle is None, f"import cycle: {' -> '.join(cycle)}"


def package_graph(graph):
    """`graph` with each module replaced by its package (easylm.serving.engine ->
    easylm.serving; a top-level module, a command, stays itself)."""
    def package(name):
        parts = name.split(".")
        return ".".join(parts[:2])

    packages = {}
    for name, edges in graph.items():
        packages.setdefault(package(name), set()).update(package(edge) for edge in edges)
    for name, edges in packages.items():
        edges.discard(name)
    return packages


def test_no_import_loop_between_packages():
    # Building blocks grouped by what they serve, arrows pointing one way. A loop
    # through packages (serving -> variants -> objectives -> serving once) makes a serve
    # process import training code.
    packages = package_graph(import_graph())
    assert {"easylm.serving", "easylm.objectives", "easylm.models"} <= set(packages)
    cycle = find_cycle(packages)
    assert cycle is None, f"import loop between packages: {' -> '.join(cycle)}"
    # Negative twin: one edge back from models to the trainer closes a loop.
    packages["easylm.models"] = packages["easylm.models"] | {"easylm.training"}
    assert find_cycle(packages) is not None


def test_no_function_is_over_60_lines():
    # A function that does not fit on a screen wants named parts.
    long = []
    for path in sorted(ROOT.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                lines = node.end_lineno - node.lineno + 1
                if lines > 60:
                    long.append(f"{path.relative_to(ROOT.parent)}:{node.lineno} "
                                f"{node.name} ({lines} lines)")
    assert not long, "\n".join(long)


# ------------------------------------------------------------------ the model contract

def _public(cls) -> set[str]:
    return {name for klass in cls.__mro__[:-1] for name in vars(klass)
            if not name.startswith("_")}


def test_a_family_is_a_dozen_members_and_adds_none():
    from easylm.models import registry
    from easylm.models.config import ModelConfig
    from easylm.models.family import ModelFamily

    contract = _public(ModelFamily)
    assert len(contract) <= 15, sorted(contract)
    for name in registry.FAMILIES:
        family = registry.get(name)
        # What a family sets is what the contract declares; generic code reads nothing else.
        assert _public(type(family)) <= contract, (name, _public(type(family)) - contract)
        assert issubclass(family.config_class, ModelConfig), name
    # Negative twin: a family that grows a member of its own is caught.
    grown = type("Grown", (type(registry.get("llama")),), {"serve_module": "x"})
    assert not _public(grown) <= contract


def test_one_forward_written_once():
    """`def forward(` once in easylm/models and easylm/variants: variants change the
    parameters or the module's apply, not the forward."""
    count = lambda root: sum(path.read_text().count("def forward(")  # noqa: E731
                             for path in root.rglob("*.py"))
    assert count(ROOT / "models") + count(ROOT / "variants") == 1


def test_models_import_no_flag_code_and_eval_no_family():
    graph = import_graph()
    flag_code = {"easylm.flags", "easylm.model_flags", "easylm.runtime.run_flags",
                 "easylm.runtime.easylm_flags"}
    for name, edges in graph.items():
        if name.startswith("easylm.models"):
            assert not edges & flag_code, (name, edges & flag_code)
            text = modules()[name].read_text()
            assert "ml_collections" not in text and "absl" not in text, name
    from easylm.models import registry

    families = {f"easylm.{name}" for name in registry.FAMILIES}  # every family's package
    assert not {edge.rpartition(".")[0] for edge in graph["easylm.eval"]} & families
    assert "importlib" not in modules()["easylm.eval"].read_text()


def test_docs_families_walks_every_family_with_its_files_lengths():
    """docs/families.md's table: one row per registered family, each file's line count as
    the file has it now (as tests/test_readme.py holds the README to its numbers)."""
    import re

    from easylm.models import registry

    text = (ROOT.parent / "docs" / "families.md").read_text()
    rows = re.findall(r"^\| `easylm/(\w+)/` \|.*\| (\d+) \| (\d+) \| (\d+) \| (\d+) \|$", text,
                      re.MULTILINE)
    packages = dict.fromkeys(module.split(".")[1] for module in registry.FAMILIES.values())
    assert [name for name, *_ in rows] == list(packages)  # qwen3_5_vl is in qwen3_5's
    for name, *counts in rows:
        lengths = [len((ROOT / name / f"{part}.py").read_text().splitlines())
                   for part in ("config", "model", "hf", "family")]
        assert list(map(int, counts)) == lengths, name
