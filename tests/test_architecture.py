"""The structure docs/architecture.md describes, checked from the source: imports run down the
layers only; the LLaMA-Factory adapter keeps nothing about a run in a module; the step modes
are decided in one place (odb_factory/llamafactory/step_modes.py)."""

from __future__ import annotations

import ast
import re
from pathlib import Path
from typing import Iterator, List, Set, Tuple

import pytest

REPO = Path(__file__).resolve().parents[1]
PACKAGES = {"odb_factory": REPO / "odb_factory", "odb_factory_patches": REPO / "patches" / "odb_factory_patches"}

# Top to bottom: a module may import from its own part or from a part in a lower layer only.
LAYERS: Tuple[Tuple[str, ...], ...] = (
    ("odb_factory.plan", "odb_factory.orchestrate"),  # deprecated names, answering with their successors
    ("odb_factory", "odb_factory.dry_run", "odb_factory.options_table", "odb_factory.data",
     "odb_factory.stage_profiling", "odb_factory.install_hook", "odb_factory.recipes"),
    ("odb_factory.demo",),
    ("odb_factory_patches",),
    ("odb_factory.llamafactory",),
    ("odb_factory.loader", "odb_factory.encoder_stage"),
    ("odb_factory.simulation",),
    ("odb_factory.planning",),
    ("odb_factory.balance",),
    ("odb_factory.comm", "odb_factory.segment_attention", "odb_factory.synthetic", "odb_factory.token_lengths"),
    ("odb_factory.cost", "odb_factory.loss"),
    ("odb_factory.config", "odb_factory.versions"),
)
ADAPTER = REPO / "odb_factory" / "llamafactory"


def module_files() -> Iterator[Tuple[str, Path]]:
    for root, base in PACKAGES.items():
        for path in sorted(base.rglob("*.py")):
            parts = list(path.relative_to(base).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts = parts[:-1]
            yield ".".join([root, *parts]), path


def imported_modules(name: str, path: Path, modules: Set[str]) -> Set[str]:
    """Every module of ours `path` imports, at any depth of its code (lazy imports count).
    `from package import sub` counts as importing `sub` (the parents' __init__ runs on any
    import of a submodule, so it is no arrow of its own)."""
    package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[:len(package.split(".")) - node.level + 1]
                module = ".".join(base + ([node.module] if node.module else []))
            else:
                module = node.module or ""
            submodules = {f"{module}.{alias.name}" for alias in node.names} & modules
            found.update(submodules or {module})
    return found & modules


def part_of(module: str) -> str:
    """The layered part a module belongs to (the longest listed prefix)."""
    listed = [p for layer in LAYERS for p in layer if module == p or module.startswith(p + ".")]
    if not listed:
        raise AssertionError(f"{module} is in no layer of tests/test_architecture.py (and docs/architecture.md)")
    return max(listed, key=len)


def layer_of(part: str) -> int:
    return next(i for i, layer in enumerate(LAYERS) if part in layer)


def upward_imports() -> List[str]:
    modules = dict(module_files())
    problems = []
    for name, path in modules.items():
        source = part_of(name)
        for target in sorted(imported_modules(name, path, set(modules))):
            part = part_of(target)
            if part != source and layer_of(part) <= layer_of(source):
                problems.append(f"{name} imports {target} ({source} is in layer {layer_of(source)}, "
                                f"{part} in layer {layer_of(part)})")
    return problems


def test_imports_run_down_the_layers_only():
    assert upward_imports() == []


def test_the_layer_check_sees_an_upward_import(tmp_path, monkeypatch):
    """The walk notices an arrow that runs backwards (the adapter importing the patches)."""
    fake = tmp_path / "odb_factory"
    (fake / "llamafactory").mkdir(parents=True)
    (fake / "__init__.py").write_text("")
    (fake / "llamafactory" / "__init__.py").write_text("")
    (fake / "llamafactory" / "trainer.py").write_text("def f():\n    from odb_factory_patches import x\n")
    patches = tmp_path / "odb_factory_patches"
    patches.mkdir()
    (patches / "__init__.py").write_text("")
    (patches / "x.py").write_text("from odb_factory.llamafactory import trainer\n")
    monkeypatch.setitem(globals(), "PACKAGES", {"odb_factory": fake, "odb_factory_patches": patches})
    assert upward_imports() == ["odb_factory.llamafactory.trainer imports odb_factory_patches.x "
                                "(odb_factory.llamafactory is in layer 4, odb_factory_patches in layer 3)"]


# ------------------------------------------------------------------ no run state in a module
# module-level values that are not containers or objects a run could write into
CONSTANT_CALLS = {"frozenset", "tuple", "MappingProxyType", "getLogger", "compile", "TypeVar"}


def is_constant(node: ast.AST) -> bool:
    if isinstance(node, (ast.Constant, ast.JoinedStr)):
        return True
    if isinstance(node, ast.Tuple):
        return all(is_constant(e) for e in node.elts)
    if isinstance(node, ast.Name):  # another constant, a class or a function
        return True
    if isinstance(node, ast.Attribute):
        return True
    if isinstance(node, ast.UnaryOp):
        return is_constant(node.operand)
    if isinstance(node, ast.BinOp):
        return is_constant(node.left) and is_constant(node.right)
    if isinstance(node, (ast.GeneratorExp,)):
        return False
    if isinstance(node, ast.Call):
        func = node.func
        name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", "")
        return name in CONSTANT_CALLS
    return False


def module_state(path: Path) -> List[str]:
    """Module-level mutable values and `global` rebinding in one file."""
    tree = ast.parse(path.read_text())
    problems = [f"{path.name}:{node.lineno}: global {', '.join(node.names)}"
                for node in ast.walk(tree) if isinstance(node, ast.Global)]
    for node in tree.body:
        if isinstance(node, (ast.Assign, ast.AnnAssign)) and node.value is not None:
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            names = [t.id for t in targets if isinstance(t, ast.Name)]
            if names == ["__all__"] or is_constant(node.value):
                continue
            problems.append(f"{path.name}:{node.lineno}: {', '.join(names)} = {ast.unparse(node.value)[:60]}")
    return problems


def adapter_attribute_writes(path: Path) -> List[str]:
    """`module.name = value` on an adapter module, from anywhere."""
    tree = ast.parse(path.read_text())
    aliases = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and (node.module or "").endswith("llamafactory") and (
                "odb_factory" in (node.module or "") or node.level):
            aliases.update(a.asname or a.name for a in node.names)
        elif isinstance(node, ast.Import):
            aliases.update(a.asname for a in node.names if a.name.startswith("odb_factory.llamafactory.") and a.asname)
    writes = []
    for node in ast.walk(tree):
        targets = node.targets if isinstance(node, ast.Assign) else [node.target] if isinstance(
            node, (ast.AugAssign, ast.AnnAssign)) else []
        for target in targets:
            if isinstance(target, ast.Attribute) and isinstance(target.value, ast.Name) and target.value.id in aliases:
                writes.append(f"{path}:{node.lineno}: {ast.unparse(target)} =")
    return writes


def test_the_adapter_keeps_no_run_state_in_a_module():
    problems = [p for path in sorted(ADAPTER.glob("*.py")) for p in module_state(path)]
    assert problems == []
    writers = [w for _, path in module_files() for w in adapter_attribute_writes(path)]
    writers += [w for path in sorted((REPO / "tests").rglob("*.py")) for w in adapter_attribute_writes(path)]
    assert writers == []


def test_the_state_scan_sees_a_module_global(tmp_path):
    (tmp_path / "state.py").write_text("current = None\nprogress = {}\nNAMES = ('a',)\n"
                                       "def set_it(x):\n    global current\n    current = x\n")
    assert module_state(tmp_path / "state.py") == ["state.py:5: global current", "state.py:2: progress = {}"]
    (tmp_path / "user.py").write_text("from odb_factory.llamafactory import state\nstate.current = 1\n")
    assert adapter_attribute_writes(tmp_path / "user.py") == [f"{tmp_path / 'user.py'}:2: state.current ="]


# ------------------------------------------------------------------ step modes in one place
STEP_MODE_BRANCH = re.compile(r"step_mode\s*(==|!=|\bin\b|\bnot\b)|samples_mode|"
                              r"[=!]=\s*[\"'](samples|groups)[\"']|[\"'](samples|groups)[\"']\s*[=!]=|"
                              r"isinstance\([^)]*OptimizerStepBatch")


def step_mode_branches(paths) -> List[str]:
    return [f"{path.relative_to(REPO)}:{number}: {line.strip()}"
            for path in paths for number, line in enumerate(path.read_text().splitlines(), 1)
            if STEP_MODE_BRANCH.search(line)]


@pytest.mark.parametrize("where", ["odb_factory/llamafactory", "patches/odb_factory_patches"])
def test_no_step_mode_branch_outside_the_strategies(where):
    paths = [p for p in sorted((REPO / where).glob("*.py")) if p.name != "step_modes.py"]
    assert step_mode_branches(paths) == []


@pytest.mark.parametrize("line", ['if cfg.step_mode == "samples":', "if not self._odb_samples_mode:",
                                  "if isinstance(inputs, OptimizerStepBatch):", "handed = 'groups' != mode"])
def test_the_step_mode_pattern_sees_a_branch(line):
    assert STEP_MODE_BRANCH.search(line)
