"""Size guards on the product code (issue 40 part 7): no new function over 60 lines, no new file over 600.

A function past 60 lines is usually several objects or steps without names; a file past 600
lines usually holds more than one concept. The lists below name the existing exceptions at
their size today: an entry may shrink (then lower or delete it here) but not grow, and nothing
new joins them without a line here saying why. Lines are counted from ``def`` to the last line of
the body (docstring included), by the standard library's ``ast``; generated protobuf code is
not product code.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("server/together_train_server", "together_train", "cookbook/together_train_cookbook")
MAX_FUNCTION_LINES = 60
MAX_FILE_LINES = 600

# "path::Class.method": its size when listed (not to be exceeded).
FUNCTIONS_OVER_LIMIT = {
    "server/together_train_server/wire/generator_servicer.py::ReplicaServicer.PushWeights": 103,
    "server/together_train_server/service/sessions/manager.py::SessionLifecycle.create_session": 80,
    "server/together_train_server/service/replicas/pool.py::ReplicaPool.publish": 85,
    "server/together_train_server/wire/http/openai/params.py::openai_params": 73,
    "server/together_train_server/service/resource.py::Resource.__init__": 72,
    "server/together_train_server/service/telemetry.py::dashboard_state": 69,
    "server/together_train_server/service/sampling/inference.py::InferenceService.stream": 66,
    "server/together_train_server/wire/http/openai/chat.py::chat_completions": 63,
    "server/together_train_server/wire/http/app.py::create_app": 63,
    "server/together_train_server/wire/http/tinker/sampling.py::asample": 62,
    "server/together_train_server/service/core/operations.py::SessionQueue.submit": 61,
}

# path: its size when listed (not to be exceeded).
FILES_OVER_LIMIT = {
    "server/together_train_server/service/replicas/pool.py": 643,
}


def _product_files() -> list[Path]:
    return [p for pkg in PACKAGES for p in sorted((ROOT / pkg).rglob("*.py")) if "_proto" not in p.parts]


def _functions(path: Path) -> list[tuple[str, int]]:
    """(qualified name, lines) of every function and method in ``path``, nested ones included."""
    out: list[tuple[str, int]] = []

    def walk(node: ast.AST, prefix: str) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                assert child.end_lineno is not None
                out.append((prefix + child.name, child.end_lineno - child.lineno + 1))
                walk(child, prefix + child.name + ".")
            elif isinstance(child, ast.ClassDef):
                walk(child, prefix + child.name + ".")

    walk(ast.parse(path.read_text(encoding="utf-8")), "")
    return out


def test_no_function_grows_past_its_limit():
    too_long = []
    for path in _product_files():
        rel = path.relative_to(ROOT).as_posix()
        for name, lines in _functions(path):
            key = f"{rel}::{name}"
            allowed = FUNCTIONS_OVER_LIMIT.get(key, MAX_FUNCTION_LINES)
            if lines > allowed:
                too_long.append(f"{key}: {lines} lines (limit {allowed})")
    assert not too_long, ("functions over their limit: give their parts names (or, for an existing "
                          "exception that must grow, say why next to its entry):\n  " + "\n  ".join(too_long))


def test_no_file_grows_past_its_limit():
    too_long = []
    for path in _product_files():
        rel = path.relative_to(ROOT).as_posix()
        lines = len(path.read_text(encoding="utf-8").splitlines())
        allowed = FILES_OVER_LIMIT.get(rel, MAX_FILE_LINES)
        if lines > allowed:
            too_long.append(f"{rel}: {lines} lines (limit {allowed})")
    assert not too_long, "files over their limit: split them by concept:\n  " + "\n  ".join(too_long)


def test_the_counter_sees_nested_and_class_functions(tmp_path):
    src = tmp_path / "m.py"
    src.write_text("class A:\n    def f(self):\n        def g():\n            pass\n        return g\n\n"
                   "async def h():\n    pass\n")
    assert _functions(src) == [("A.f", 4), ("A.f.g", 2), ("h", 2)]
