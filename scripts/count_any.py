"""Count parameters and returns annotated ``Any`` (also ``Any | None``) in the server package.

Usage: python scripts/count_any.py [-v] [GLOB ...]   (globs under server/together_train_server; default: the
seams issue 29 names, ``wire/**/*.py service/**/*.py engines/interfaces.py``). ``-v`` lists each one.
A container of Any (``dict[str, Any]``, JSON values) is not counted: only a bare ``Any`` where a type goes.
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1] / "server" / "together_train_server"
SEAMS = ("wire/**/*.py", "service/**/*.py", "engines/interfaces.py")


def _is_any(node: ast.expr | None) -> bool:
    if node is None:
        return False
    parts = [p.strip() for p in ast.unparse(node).replace("typing.", "").split("|")]
    return "Any" in parts or parts == ["Optional[Any]"]


def hits(path: Path) -> list[tuple[int, str, str]]:
    """(line, function, parameter name or "return") of each Any annotation in `path`."""
    out = []
    for n in ast.walk(ast.parse(path.read_text())):
        if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)):
            a = n.args
            for arg in [*a.posonlyargs, *a.args, *a.kwonlyargs, *filter(None, [a.vararg, a.kwarg])]:
                if _is_any(arg.annotation):
                    out.append((n.lineno, n.name, arg.arg))
            if _is_any(n.returns):
                out.append((n.lineno, n.name, "return"))
    return out


def main(argv: list[str]) -> None:
    verbose = "-v" in argv
    globs = [a for a in argv if a != "-v"] or list(SEAMS)
    files = sorted({p for g in globs for p in ROOT.glob(g)})
    total = 0
    for p in files:
        for line, fn, what in hits(p):
            total += 1
            if verbose:
                print(f"{p.relative_to(ROOT)}:{line} {fn}({what})")
    print(f"any_annotations={total} files={len(files)}")


if __name__ == "__main__":
    main(sys.argv[1:])
