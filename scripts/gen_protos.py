"""Regenerate the committed gRPC code under together_train/_proto/ from protos/.

Usage: python scripts/gen_protos.py [--out DIR]

protoc names modules after the proto package (together_train.v1); we move the
generated files flat into together_train/_proto/ and rewrite their imports, so
the wire code ships inside the SDK package. tests/unit/test_protos_fresh.py runs
this into a temporary folder and fails when the committed files differ.
"""

from __future__ import annotations

import argparse
import pathlib
import re
import shutil
import sys
import tempfile

ROOT = pathlib.Path(__file__).resolve().parents[1]
PROTO_ROOT = ROOT / "protos"
DEFAULT_OUT = ROOT / "together_train" / "_proto"


def generate(out_dir: pathlib.Path) -> list[pathlib.Path]:
    """Run protoc on every proto file and write rewritten modules to out_dir."""
    import grpc_tools
    from grpc_tools import protoc

    protos = sorted(PROTO_ROOT.rglob("*.proto"))
    include = pathlib.Path(grpc_tools.__file__).parent / "_proto"
    out_dir.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        args = [
            "protoc",
            f"-I{PROTO_ROOT}",
            f"-I{include}",
            f"--python_out={tmp}",
            f"--pyi_out={tmp}",
            f"--grpc_python_out={tmp}",
            *[str(p.relative_to(PROTO_ROOT)) for p in protos],
        ]
        if protoc.main(args) != 0:
            raise SystemExit("protoc failed")
        written = []
        for src in sorted(pathlib.Path(tmp).rglob("*.py*")):
            text = src.read_text()
            text = re.sub(r"from together_train\.v1 import", "from together_train._proto import", text)
            text = re.sub(r"import together_train\.v1\.(\w+)", r"from together_train._proto import \1", text)
            dst = out_dir / src.name
            dst.write_text(text)
            written.append(dst)
    init = out_dir / "__init__.py"
    init.write_text('"""Generated gRPC code (scripts/gen_protos.py). Do not edit."""\n')
    written.append(init)
    return written


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", type=pathlib.Path, default=DEFAULT_OUT)
    args = parser.parse_args()
    if args.out == DEFAULT_OUT and DEFAULT_OUT.exists():
        shutil.rmtree(DEFAULT_OUT)
    for path in generate(args.out):
        print(path.relative_to(ROOT) if path.is_relative_to(ROOT) else path, file=sys.stderr)


if __name__ == "__main__":
    main()
