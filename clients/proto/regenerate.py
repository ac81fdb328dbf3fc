"""Regenerate shuttle_pb2.py, shuttle_pb2.pyi and shuttle_pb2_grpc.py from shuttle.proto.

    .venv/bin/python -m clients.proto.regenerate

Runs grpc_tools.protoc (the grpcio-tools dev dependency) with the repository root as the include
path, so the generated gRPC module imports its messages as `from clients.proto import shuttle_pb2`.
"""
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]  # the repository root
PROTO = "clients/proto/shuttle.proto"  # relative to ROOT: also the file's name in the descriptor pool


def protoc_args(out_dir: Path) -> list[str]:
    """protoc's command line that writes the modules under out_dir/clients/proto/."""
    return ["grpc_tools.protoc", f"-I{ROOT}", f"--python_out={out_dir}", f"--pyi_out={out_dir}",
            f"--grpc_python_out={out_dir}", str(ROOT / PROTO)]


def run_protoc(args: list[str]) -> int:
    """grpc_tools.protoc (the grpcio-tools dev dependency) with `args`, in a child process; its exit code."""
    return subprocess.run([sys.executable, "-m", "grpc_tools.protoc", *args], cwd=ROOT).returncode


def regenerate(out_dir: Path = ROOT) -> None:
    """Write the generated modules under out_dir/clients/proto/ (default: beside the .proto).
    Raises RuntimeError with protoc's exit code if it fails (it prints why on stderr).
    protoc runs in its own process: its bundled C++ protobuf and NIXL's native libraries crash
    (SIGSEGV/abort) when both are loaded into one process, as in a test session."""
    rc = run_protoc(protoc_args(Path(out_dir))[1:])
    if rc != 0:
        raise RuntimeError(f"protoc failed on {PROTO} with exit code {rc}")


if __name__ == "__main__":
    regenerate(Path(sys.argv[1]) if len(sys.argv) > 1 else ROOT)
