"""The committed generated gRPC code must match what scripts/gen_protos.py makes from protos/."""

import importlib.util
import pathlib
import sys

ROOT = pathlib.Path(__file__).resolve().parents[2]


def test_generated_code_is_fresh(tmp_path):
    spec = importlib.util.spec_from_file_location("gen_protos", ROOT / "scripts" / "gen_protos.py")
    gen = importlib.util.module_from_spec(spec)
    sys.modules["gen_protos"] = gen
    spec.loader.exec_module(gen)
    gen.generate(tmp_path)
    committed = ROOT / "together_train" / "_proto"
    fresh = sorted(p.name for p in tmp_path.iterdir() if p.is_file())
    assert fresh == sorted(p.name for p in committed.iterdir() if p.is_file() and p.suffix in (".py", ".pyi"))
    stale = [name for name in fresh if (tmp_path / name).read_text() != (committed / name).read_text()]
    assert not stale, f"generated code is stale, run: python scripts/gen_protos.py  ({stale})"
