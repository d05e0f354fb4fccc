"""Regenerate asyncps/pb from proto/ (or, with --check, fail if the checked-in code is stale)."""

from __future__ import annotations

import argparse
import filecmp
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PROTO_DIR = ROOT / "proto"
OUT_PKG = ROOT / "asyncps" / "pb"


def generate(out_root: Path) -> list[Path]:
    """Run protoc (grpcio-tools + mypy-protobuf) into out_root; return the generated files."""
    protos = sorted(PROTO_DIR.rglob("*.proto"))
    bindir = Path(sys.executable).parent  # mypy-protobuf's plugins live beside the interpreter
    cmd = [
        sys.executable, "-m", "grpc_tools.protoc", f"-I{PROTO_DIR}",
        f"--python_out={out_root}", f"--grpc_python_out={out_root}",
        f"--plugin=protoc-gen-mypy={bindir / 'protoc-gen-mypy'}",
        f"--plugin=protoc-gen-mypy_grpc={bindir / 'protoc-gen-mypy_grpc'}",
        f"--mypy_out={out_root}", f"--mypy_grpc_out={out_root}",
        *[str(p) for p in protos],
    ]
    # mypy-protobuf says "Writing mypy to ..." for every stub: shown only when protoc fails
    result = subprocess.run(cmd, capture_output=True, text=True)
    if result.returncode != 0:
        sys.stderr.write(result.stdout + result.stderr)
        raise SystemExit(f"protoc failed with exit status {result.returncode}")
    return sorted((out_root / "asyncps" / "pb").glob("*_pb2*"))


def main() -> int:
    """Generate, or compare against the checked-in files."""
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--check", action="store_true", help="fail if generated code differs")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        files = generate(Path(tmp))
        if args.check:
            stale = [f.name for f in files if not (OUT_PKG / f.name).exists()
                     or not filecmp.cmp(f, OUT_PKG / f.name, shallow=False)]
            extra = {p.name for p in OUT_PKG.glob("*_pb2*")} - {f.name for f in files}
            if stale or extra:
                print(f"generated protobuf code is stale: {sorted(stale) + sorted(extra)}; "
                      "run: python scripts/gen_proto.py", file=sys.stderr)
                return 1
            print("generated protobuf code is current")
            return 0
        for old in OUT_PKG.glob("*_pb2*"):
            old.unlink()
        for f in files:
            shutil.copy(f, OUT_PKG / f.name)
        print(f"wrote {len(files)} files to {OUT_PKG.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
