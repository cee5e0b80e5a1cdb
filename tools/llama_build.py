"""Build llama.cpp's `llama-server` from the llama-cpp-python sdist on PyPI, once, into a cache.

Why an sdist: llama-cpp-python vendors the llama.cpp tree it was released with, PyPI keeps it,
and pip can fetch it where only package registries are reachable. Only the `llama-server`
target is built (CPU, native instructions, no network features), about 5 minutes on two
cores; the binary is reused from the cache afterwards.

    python tools/llama_build.py                 # build (or report the cached binary)
    python tools/llama_build.py --print-path    # the binary's path, building first if needed
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tarfile
import time
from pathlib import Path

VERSION = "0.3.36"
CACHE = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "llm-stages"
CMAKE_OPTIONS = (
    "-DCMAKE_BUILD_TYPE=Release",
    "-DGGML_NATIVE=ON",  # the CPU it runs on, as a laptop build would
    "-DLLAMA_BUILD_TESTS=OFF",
    "-DLLAMA_BUILD_EXAMPLES=OFF",
    "-DLLAMA_BUILD_TOOLS=ON",
    "-DLLAMA_BUILD_SERVER=ON",
    "-DLLAMA_BUILD_APP=OFF",
    "-DLLAMA_USE_PREBUILT_UI=OFF",  # no download during the build
    "-DLLAMA_OPENSSL=OFF",
    "-DLLAMA_CURL=OFF",
)


def build_dir(version: str = VERSION) -> Path:
    return CACHE / f"llama-server-{version}"


def binary_path(version: str = VERSION) -> Path:
    return build_dir(version) / "build" / "bin" / "llama-server"


def _log(message: str) -> None:
    print(f"[llama_build] {message}", file=sys.stderr, flush=True)


def _run(cmd: list[str], cwd: Path, log_file: Path) -> None:
    """Run one build step, its output to a log, a dot a minute so a long build shows life."""
    _log("$ " + " ".join(cmd))
    with log_file.open("ab") as log:
        process = subprocess.Popen(cmd, cwd=cwd, stdout=log, stderr=subprocess.STDOUT)
        start = time.monotonic()
        while process.poll() is None:
            try:
                process.wait(timeout=60)
            except subprocess.TimeoutExpired:
                _log(f"  ... {(time.monotonic() - start) / 60:.0f} min (log: {log_file})")
    if process.returncode != 0:
        raise SystemExit(f"build step failed ({process.returncode}); see {log_file}")


def build(version: str = VERSION, jobs: int | None = None) -> Path:
    """The llama-server binary for this version, built into the cache when absent."""
    binary = binary_path(version)
    if binary.exists():
        _log(f"cached: {binary}")
        return binary
    for tool in ("cmake", "c++"):
        if shutil.which(tool) is None:
            raise SystemExit(f"{tool} is needed to build llama-server (apt install cmake g++)")
    root = build_dir(version)
    root.mkdir(parents=True, exist_ok=True)
    sdist = root / f"llama_cpp_python-{version}.tar.gz"
    if not sdist.exists():
        _log(f"downloading the llama-cpp-python {version} sdist from PyPI")
        subprocess.run(
            [
                sys.executable,
                "-m",
                "pip",
                "download",
                f"llama-cpp-python=={version}",
                "--no-deps",
                "--no-binary",
                ":all:",
                "-d",
                str(root),
            ],
            check=True,
        )
    source = root / "llama.cpp"
    if not source.exists():
        _log("unpacking its vendored llama.cpp")
        prefix = f"llama_cpp_python-{version}/vendor/llama.cpp/"
        with tarfile.open(sdist) as archive:
            members = [m for m in archive.getmembers() if m.name.startswith(prefix)]
            for member in members:
                member.name = member.name[len(prefix) :]
            archive.extractall(source, members=[m for m in members if m.name], filter="data")
    log_file = root / "build.log"
    jobs = jobs or os.cpu_count() or 2
    _run(["cmake", "-S", str(source), "-B", str(root / "build"), *CMAKE_OPTIONS], root, log_file)
    _log(f"compiling llama-server with {jobs} jobs (about 5 minutes on two cores)")
    _run(
        ["cmake", "--build", str(root / "build"), "--target", "llama-server", "-j", str(jobs)],
        root,
        log_file,
    )
    if not binary.exists():
        raise SystemExit(f"the build ended without {binary}; see {log_file}")
    _log(f"built: {binary}")
    return binary


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--version", default=VERSION, help="llama-cpp-python release")
    parser.add_argument("--jobs", type=int, default=None, help="compile jobs (default: all CPUs)")
    parser.add_argument("--print-path", action="store_true", help="print the binary's path")
    args = parser.parse_args(argv)
    binary = build(args.version, args.jobs)
    if args.print_path:
        print(binary)


if __name__ == "__main__":
    main()
