"""Only the trainer runtime calls the trainer engine (service/core/runtime.py; docs/internals.md "Service").

An AST contract over service/: a call of a trainer-engine method (`TrainerEngine`, `CycleTrainer`,
`PageableTrainer`) on anything named after an engine is allowed in the runtime's module only, and no
other service module holds an engine at all (a name or attribute ``engine`` / ``_engine``), so an
engine handed in under another name is seen too. Two exceptions, each named with its reason:
resource.py (the composition root) hands the engine it is given to the runtime, and
training/rank_guard.py is an engine hook (engines/wrapped.py) that reads the DeepSpeed engine's
rank health, inside the wrapper. Import-linter cannot say this: the engine is injected, not imported.
"""

from __future__ import annotations

import ast
import inspect
from pathlib import Path

SERVICE = Path(__file__).resolve().parents[2] / "server" / "together_train_server" / "service"
RUNTIME = {"core/runtime.py"}
# Where the name "engine" may appear, and why (module docstring).
HOLDERS = {"core/runtime.py": "the runtime: the engine's one owner",
           "resource.py": "the composition root: hands the engine to TrainerRuntime",
           "training/rank_guard.py": "an engine hook inside the wrapper (DeepSpeed rank health)"}


def _engine_methods() -> set[str]:
    from together_train_server.engines.interfaces import CycleTrainer, PageableTrainer, TrainerEngine

    return {name for proto in (TrainerEngine, CycleTrainer, PageableTrainer)
            for name, member in vars(proto).items() if inspect.isfunction(member) and not name.startswith("_")}


def _modules() -> list[tuple[str, ast.Module]]:
    return [(p.relative_to(SERVICE).as_posix(), ast.parse(p.read_text(), str(p))) for p in sorted(SERVICE.rglob("*.py"))]


def _engine_calls(tree: ast.AST, methods: set[str]) -> list[str]:
    """``"line: call"`` of each of ``methods`` called on an expression naming an engine."""
    return [f"{node.lineno}: {ast.unparse(node.func)}" for node in ast.walk(tree)
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in methods
            and "engine" in ast.unparse(node.func.value).lower()]


def engine_callers() -> dict[str, list[str]]:
    """service module -> its trainer-engine calls (`_engine_calls`), for the modules with any."""
    methods = _engine_methods()
    return {rel: calls for rel, tree in _modules() if (calls := _engine_calls(tree, methods))}


def engine_holders() -> dict[str, list[str]]:
    """service module -> ``"line: name"`` of each name, attribute or argument called ``engine`` / ``_engine``."""
    out: dict[str, list[str]] = {}
    for rel, tree in _modules():
        for node in ast.walk(tree):
            name = (node.id if isinstance(node, ast.Name) else node.attr if isinstance(node, ast.Attribute)
                    else node.arg if isinstance(node, ast.arg) else None)
            if name in ("engine", "_engine"):
                out.setdefault(rel, []).append(f"{node.lineno}: {name}")
    return out


def test_the_engine_methods_are_known():
    """The contract checks real names (a renamed interface would make it vacuous)."""
    assert {"create_adapter", "drop_adapter", "forward", "optim_step", "save_state", "forward_many",
            "save_session", "load_session"} <= _engine_methods()


def test_only_the_runtime_calls_the_trainer_engine():
    outside = {rel: calls for rel, calls in engine_callers().items() if rel not in RUNTIME}
    assert not outside, ("trainer-engine calls outside service/core/runtime.py (add a TrainerRuntime method "
                         f"and call that): {outside}")
    assert set(engine_callers()) == RUNTIME, engine_callers()   # the runtime does call it (not vacuous)


def test_no_other_service_module_holds_the_engine():
    outside = {rel: names for rel, names in engine_holders().items() if rel not in HOLDERS}
    assert not outside, ("service modules holding a trainer engine besides the runtime (take the runtime "
                         f"instead): {outside}")


def test_the_contract_catches_a_call():
    """The scan flags an injected engine's call (on a module written for it), not the runtime's."""
    src = ("class P:\n    def __init__(self, engine, runtime):\n        self.engine, self.runtime = engine, runtime\n"
           "    def run(self):\n        self.runtime.optim_step('s', None)\n        return self.engine.optim_step('s', None)\n")
    assert _engine_calls(ast.parse(src), _engine_methods()) == ["6: self.engine.optim_step"]
