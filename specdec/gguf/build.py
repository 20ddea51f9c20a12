"""Build llama.cpp's library for the ``gguf`` runtime, once per machine, into specdec's cache.

    python -m specdec.gguf.build          # what ``make setup`` runs; a no-op when already built

PyPI carries llama.cpp only as llama-cpp-python's source, so setup builds it: the sdist (pinned
by version and sha256, fetched with pip from the package index or named by ``$SPECDEC_LLAMA_CPP_SDIST``),
CMake on its ``vendor/llama.cpp``, the ``llama`` library target only (no tools, no ``common``),
and ``native/specdec_llama.c`` linked to it. Portable: no ``-march=native`` (which ties a build
to one host and crashed on the Intel hosts' AMX paths). Two ``ggml-cpu`` variants are built and
``binding.py`` loads the best one the CPU runs: ``avx2`` (AVX2/FMA/F16C, every x86-64 host this
project meets) and ``avx512`` (adds AVX-512 F/BW/DQ/VL/CD, VBMI and VNNI; no AMX).

Layout of ``<cache>/llama.cpp/<key>/``: ``lib/`` (``libggml-base``, ``libggml``, ``libllama``, the
``avx2`` ``libggml-cpu`` and ``libspecdec_llama``), ``lib/<variant>/libggml-cpu.so.0`` for the
others, and ``build.json`` (what was built, how, how long). ``<key>`` hashes the source, the flags,
the compiler and the shim, so any change builds afresh beside the old one.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from specdec.cache import cache_dir

SDIST_NAME = "llama-cpp-python"
SDIST_VERSION = "0.3.36"
SDIST_SHA256 = "832db0699007f1be95a7e41ef12e88926b02ba836461e36a36372db2760c1a2e"
SDIST_ENV = "SPECDEC_LLAMA_CPP_SDIST"  # a local sdist file (offline setups)
LIBRARY_ENV = "SPECDEC_LLAMA_CPP_DIR"  # a finished build directory to use instead of the cache's
SHIM = Path(__file__).resolve().parent / "native" / "specdec_llama.c"

COMMON_FLAGS = (
    "-DCMAKE_BUILD_TYPE=Release", "-DBUILD_SHARED_LIBS=ON", "-DGGML_NATIVE=OFF", "-DGGML_CCACHE=OFF",
    "-DLLAMA_BUILD_COMMON=OFF", "-DLLAMA_BUILD_TESTS=OFF", "-DLLAMA_BUILD_EXAMPLES=OFF",
    "-DLLAMA_BUILD_TOOLS=OFF", "-DLLAMA_BUILD_SERVER=OFF", "-DLLAMA_CURL=OFF", "-DLLAMA_OPENSSL=OFF",
    # llamafile's matmul kernels take float (f32/f16) products of 2+ rows and round them unlike the
    # one-row path: off, a position's logits do not depend on how passes are cut (runtime.py)
    "-DGGML_LLAMAFILE=OFF",
    # ggml's own threadpool, one per context (native/specdec_llama.c), instead of OpenMP's team per
    # calling thread: a context driven from another thread than the first ran at 1.3-1.7x the time
    "-DGGML_OPENMP=OFF",
    "-DCMAKE_SKIP_BUILD_RPATH=ON", "-DCMAKE_BUILD_WITH_INSTALL_RPATH=ON", "-DCMAKE_INSTALL_RPATH=$ORIGIN",
)
AVX2 = ("-DGGML_SSE42=ON", "-DGGML_AVX=ON", "-DGGML_AVX2=ON", "-DGGML_FMA=ON", "-DGGML_F16C=ON", "-DGGML_BMI2=ON")


@dataclass(frozen=True)
class CpuVariant:
    """One build of ``ggml-cpu``: its CMake flags and the /proc/cpuinfo flags a CPU needs to run it."""

    name: str
    cmake_flags: tuple[str, ...]
    cpu_flags: frozenset[str]


# Best first. The first is the base build (the whole library); the others add only ggml-cpu.
VARIANTS = (
    CpuVariant("avx512", AVX2 + ("-DGGML_AVX512=ON", "-DGGML_AVX512_VBMI=ON", "-DGGML_AVX512_VNNI=ON"),
               frozenset({"avx2", "fma", "f16c", "bmi2", "avx512f", "avx512bw", "avx512dq", "avx512vl", "avx512cd",
                          "avx512vbmi", "avx512_vnni"})),
    CpuVariant("avx2", AVX2, frozenset({"avx2", "fma", "f16c", "bmi2"})),
)
BASE_VARIANT = VARIANTS[-1]
LIBRARIES = ("libggml-base.so.0", "libggml-cpu.so.0", "libggml.so.0", "libllama.so.0")  # load order
SHIM_LIBRARY = "libspecdec_llama.so"


class BuildError(RuntimeError):
    """llama.cpp could not be fetched or built; the message says what to do."""


def cache_root() -> Path:
    return cache_dir() / "llama.cpp"


def compiler_version() -> str:
    try:
        return subprocess.run(["c++", "--version"], capture_output=True, text=True, check=True).stdout.splitlines()[0]
    except (OSError, subprocess.CalledProcessError, IndexError):
        return "unknown"


def build_key() -> str:
    digest = hashlib.sha256()
    for part in (SDIST_SHA256, repr(COMMON_FLAGS), repr([(v.name, v.cmake_flags) for v in VARIANTS]),
                 compiler_version(), SHIM.read_text()):
        digest.update(part.encode())
        digest.update(b"\0")
    return digest.hexdigest()[:16]


def built_dir() -> Path | None:
    """The finished build this checkout's code uses, or None if there is none yet."""
    override = os.environ.get(LIBRARY_ENV)
    candidate = Path(override) if override else cache_root() / build_key()
    return candidate if (candidate / "build.json").is_file() else None


def fetch_sdist(downloads: Path) -> Path:
    """The pinned sdist, from ``$SPECDEC_LLAMA_CPP_SDIST``, the cache, or the package index through pip
    (its index, proxy and certificate settings apply); its sha256 checked."""
    local = os.environ.get(SDIST_ENV)
    path = Path(local) if local else downloads / f"{SDIST_NAME.replace('-', '_')}-{SDIST_VERSION}.tar.gz"
    if not path.is_file():
        downloads.mkdir(parents=True, exist_ok=True)
        command = [sys.executable, "-m", "pip", "download", "--quiet", "--disable-pip-version-check", "--no-deps",
                   "--no-binary", ":all:", f"{SDIST_NAME}=={SDIST_VERSION}", "-d", str(downloads)]
        result = subprocess.run(command, capture_output=True, text=True)
        if result.returncode != 0 or not path.is_file():
            tail = "\n".join((result.stderr or result.stdout).splitlines()[-10:])
            raise BuildError(f"cannot download {SDIST_NAME} {SDIST_VERSION} with pip; set {SDIST_ENV} to a "
                             f"downloaded copy:\n{tail}")
    digest = hashlib.sha256(path.read_bytes()).hexdigest()
    if digest != SDIST_SHA256:
        raise BuildError(f"{path}: sha256 {digest}, expected {SDIST_SHA256} ({SDIST_NAME} {SDIST_VERSION})")
    return path


def extract_source(sdist: Path, into: Path) -> Path:
    """``vendor/llama.cpp`` of the sdist, without the parts the library build never reads."""
    prefix = f"{SDIST_NAME.replace('-', '_')}-{SDIST_VERSION}/vendor/llama.cpp/"
    skipped = ("models/", "docs/", "media/", "tools/", "examples/", "benches/")
    with tarfile.open(sdist) as archive:
        members = [m for m in archive.getmembers() if m.name.startswith(prefix)
                   and not m.name[len(prefix):].startswith(skipped)]
        archive.extractall(into, members=members, filter="data")
    return into / prefix


def _run(command: list[str], log: Path, what: str) -> None:
    with open(log, "a") as out:
        out.write("$ " + " ".join(command) + "\n")
        out.flush()
        status = subprocess.run(command, stdout=out, stderr=subprocess.STDOUT).returncode
    if status != 0:
        tail = "\n".join(log.read_text().splitlines()[-25:])
        raise BuildError(f"{what} failed (exit {status}); the last lines of {log}:\n{tail}")


def _cmake(source: Path, build: Path, flags: tuple[str, ...], target: str, jobs: int, log: Path) -> None:
    generator = ["-G", "Ninja"] if shutil.which("ninja") else []
    _run(["cmake", "-S", str(source), "-B", str(build), *generator, *COMMON_FLAGS, *flags], log, f"cmake ({build.name})")
    _run(["cmake", "--build", str(build), "--target", target, "-j", str(jobs)], log, f"building {target} ({build.name})")


def _compile_shim(source: Path, lib: Path, log: Path) -> None:
    _run(["cc", "-O2", "-shared", "-fPIC", "-Wall", str(SHIM), f"-I{source / 'include'}",
          f"-I{source / 'ggml' / 'include'}", f"-L{lib}", "-l:libllama.so.0", "-l:libggml-cpu.so.0",
          "-l:libggml-base.so.0", "-Wl,-rpath,$ORIGIN",
          "-o", str(lib / SHIM_LIBRARY)], log, "compiling the specdec_llama shim")


def build(jobs: int | None = None, quiet: bool = False) -> Path:
    """Build (or find) the library; returns its directory."""
    done = built_dir()
    if done is not None:
        return done
    for tool in ("cmake", "cc", "c++"):
        if shutil.which(tool) is None:
            raise BuildError(f"the gguf runtime's build needs {tool} (and a C++17 compiler) on PATH")
    jobs = jobs or os.cpu_count() or 2
    root = cache_root()
    target = root / build_key()
    root.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=".build-", dir=root))
    log = staging / "build.log"
    started = time.perf_counter()
    steps = [f"cmake {v.name}" for v in VARIANTS] + ["shim"]

    def say(step: int, text: str) -> None:
        if not quiet:
            print(f"[{step}/{len(steps) + 1}] {text} ({time.perf_counter() - started:.0f} s)", file=sys.stderr, flush=True)

    try:
        say(0, f"llama.cpp from {SDIST_NAME} {SDIST_VERSION}: fetching the source")
        source = extract_source(fetch_sdist(root / "downloads"), staging / "src")
        lib = staging / "out" / "lib"
        lib.mkdir(parents=True)
        timings = {}
        for step, variant in enumerate(reversed(VARIANTS), start=1):  # the base build first
            t0 = time.perf_counter()
            base = variant is BASE_VARIANT
            say(step, f"building {'the library' if base else 'ggml-cpu'} for {variant.name}")
            build_dir = staging / f"build-{variant.name}"
            _cmake(source, build_dir, variant.cmake_flags, "llama" if base else "ggml-cpu", jobs, log)
            into = lib if base else lib / variant.name
            into.mkdir(exist_ok=True)
            for name in LIBRARIES if base else ("libggml-cpu.so.0",):
                shutil.copy2(build_dir / "bin" / name, into / name)
            timings[variant.name] = round(time.perf_counter() - t0, 1)
        say(len(steps), "compiling the specdec_llama shim")
        _compile_shim(source, lib, log)
        shutil.copy2(log, staging / "out" / "build.log")
        (staging / "out" / "build.json").write_text(json.dumps({
            "source": f"{SDIST_NAME} {SDIST_VERSION} (sha256 {SDIST_SHA256})",
            "variants": {v.name: {"cmake_flags": list(v.cmake_flags), "cpu_flags": sorted(v.cpu_flags)} for v in VARIANTS},
            "common_flags": list(COMMON_FLAGS), "compiler": compiler_version(), "jobs": jobs,
            "seconds": {**timings, "total": round(time.perf_counter() - started, 1)},
        }, indent=1))
        try:
            (staging / "out").rename(target)  # atomic: a concurrent build either wins or finds it done
        except OSError:
            if not (target / "build.json").is_file():
                raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    say(len(steps) + 1, f"done: {target}")
    return target


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m specdec.gguf.build", description=__doc__.split("\n\n")[0])
    parser.add_argument("--jobs", type=int, default=None, help="parallel compile jobs (default: every core)")
    parser.add_argument("--print-dir", action="store_true", help="print the build's directory and exit 1 if none")
    args = parser.parse_args(argv)
    if args.print_dir:
        found = built_dir()
        print(found or "")
        return 0 if found else 1
    try:
        print(build(args.jobs))
    except BuildError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
