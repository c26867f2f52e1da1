"""The package layout stays the data's path: layered imports, no loops, modules a reader can hold.

Read with ``ast`` (nothing is imported), so a violation fails here even when no test happens
to execute the offending import.
"""

import ast
import os
import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1] / "jaxrl"

# Lower layers never import higher ones; packages on the same layer are independent libraries.
LAYERS = {
    "jaxrl.errors": 0, "jaxrl.process_groups": 0,
    "jaxrl.config": 1, "jaxrl.distributed": 1, "jaxrl.sandbox": 1, "jaxrl.plotting": 1,
    "jaxrl.losses": 2, "jaxrl.models": 2, "jaxrl.data": 2, "jaxrl.reward": 2,
    "jaxrl.rollout": 3,
    "jaxrl.align": 4, "jaxrl.evaluation": 4, "jaxrl.env": 4,
    "jaxrl.trainer": 5,
    "jaxrl.demo": 6, "jaxrl.cli": 6, "jaxrl.compile": 6,
    "jaxrl.experiments": 7,  # drives the trainer on the demo's data and warm-up (jaxrl.demo)
}
MAX_LINES = 450
STAGE_MAX_LINES = 220  # a stage module is read whole by whoever follows the step


def _module_name(path: pathlib.Path) -> str:
    parts = path.relative_to(ROOT.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {_module_name(p): p for p in sorted(ROOT.rglob("*.py"))}


def _imports(name: str) -> set[str]:
    """The jaxrl modules ``name`` imports anywhere in its body (function-level imports included)."""
    path = MODULES[name]
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(package.split(".")[: len(package.split(".")) - node.level + 1]
                                + ([base] if base else []))
            # ``from pkg import mod`` imports the submodule when there is one.
            targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in MODULES else base for a in node.names]
        else:
            continue
        found.update(t for t in targets if t in MODULES)
    found.discard(name)
    # The top-level package holds __version__ and imports nothing (test_top_level_package_imports_nothing),
    # so any layer may read it.
    found.discard("jaxrl")
    return found


def _layer(name: str) -> tuple[str, int]:
    for package, layer in LAYERS.items():
        if name == package or name.startswith(package + "."):
            return package, layer
    raise AssertionError(f"{name} belongs to no layer of tests/test_layout.py LAYERS; add its package there")


GRAPH = {name: _imports(name) for name in MODULES if name != "jaxrl"}


def test_every_module_has_a_layer():
    for name in GRAPH:
        _layer(name)


@pytest.mark.parametrize("name", sorted(GRAPH))
def test_imports_point_down_the_layers(name):
    package, layer = _layer(name)
    for target in sorted(GRAPH[name]):
        target_package, target_layer = _layer(target)
        if target_package == package:
            continue
        assert target_layer < layer, (
            f"{name} (layer {layer}, {package}) imports {target} (layer {target_layer}, {target_package}): "
            f"a lower layer must not import a higher one, and packages on one layer are independent")


def test_top_level_package_imports_nothing():
    # import jaxrl.losses runs jaxrl/__init__.py first: an import there would reach every base install.
    tree = ast.parse(MODULES["jaxrl"].read_text())
    assert not [n for n in ast.walk(tree) if isinstance(n, (ast.Import, ast.ImportFrom))], (
        "jaxrl/__init__.py must import nothing")


def test_no_import_loop():
    state: dict[str, int] = {}  # 1: on the current path, 2: done

    def visit(name: str, path: list[str]) -> None:
        state[name] = 1
        for target in sorted(GRAPH.get(name, ())):
            if state.get(target) == 1:
                raise AssertionError("import loop: " + " -> ".join(path[path.index(target):] + [target]))
            if target not in state:
                visit(target, path + [target])
        state[name] = 2

    for name in sorted(GRAPH):
        if name not in state:
            visit(name, [name])


@pytest.mark.parametrize("name", sorted(MODULES))
def test_modules_stay_readable(name):
    lines = len(MODULES[name].read_text().splitlines())
    assert lines <= MAX_LINES, f"{MODULES[name]} has {lines} lines (> {MAX_LINES}): split it by theme"


STAGES = "jaxrl.trainer.stages"
# What every stage may read: the package's contract (base). The package itself assembles the
# stages; the trainer's own modules run them.
STAGE_CONTRACT = {f"{STAGES}.base"}
TRAINER_MODULES = {"jaxrl.trainer.rl", "jaxrl.trainer.lifecycle", "jaxrl.trainer.sft", "jaxrl.trainer.cli",
                   "jaxrl.trainer.evaluate", STAGES}


def _stage_room(name: str) -> str:
    """The stage a module of jaxrl/trainer/stages/ belongs to: its first component there."""
    return name.removeprefix(STAGES + ".").split(".")[0]


STAGE_MODULES = sorted(n for n in GRAPH if n.startswith(STAGES + ".") and n not in STAGE_CONTRACT)


def test_the_stages_exist():
    assert {_stage_room(n) for n in STAGE_MODULES} == {
        "rollout", "reward", "pack", "recompute", "advantage", "filter", "update", "push"}


@pytest.mark.parametrize("name", STAGE_MODULES)
def test_a_stage_imports_no_other_stage_and_not_the_trainer(name):
    for target in sorted(GRAPH[name]):
        assert target not in TRAINER_MODULES, f"{name} imports {target}: a stage never imports the trainer"
        if target.startswith(STAGES + ".") and target not in STAGE_CONTRACT:
            assert _stage_room(target) == _stage_room(name), (
                f"{name} imports {target}, a module of another stage: what a stage needs of another is handed "
                f"to it by build_stages (jaxrl/trainer/stages/__init__.py)")


@pytest.mark.parametrize("name", STAGE_MODULES)
def test_stage_modules_stay_small(name):
    lines = len(MODULES[name].read_text().splitlines())
    assert lines <= STAGE_MAX_LINES, f"{MODULES[name]} has {lines} lines (> {STAGE_MAX_LINES}): split the stage"


def test_a_command_imports_pyplot_and_torch_only_when_it_uses_them():
    """Importing the CLI and both trainers leaves out matplotlib's pyplot (drawn through jaxrl.plotting,
    ~0.2 s) and torch (~3 s: transformers' AutoTokenizer module and SGLang's weight pushes import it):
    start-up costs every ``jaxrl`` process, a run with ``logging.plots=false`` or the embedded sampler
    included."""
    root = pathlib.Path(__file__).resolve().parents[1]
    code = ("import sys, jaxrl.cli, jaxrl.trainer.rl, jaxrl.trainer.sft; "
            "print(sorted(m for m in ('matplotlib.pyplot', 'torch', 'transformers.models.auto') if m in sys.modules))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=root,
                          env={**os.environ, "PYTHONPATH": str(root)})
    assert done.stdout.splitlines()[-1] == "[]", done.stdout
