"""Matrix-product backends for the lean runtime, and the table that picks one per row count.

On these CPUs the BLAS behind a product matters more than anything else in a forward
(docs/benchmarks.md, REFERENCES §9): torch's MKL, oneDNN with weights packed once into its blocked
layout and numpy's OpenBLAS (on the same memory: ``Tensor.numpy()`` and ``torch.from_numpy`` copy
nothing) each win at some row counts. So the runtime measures them at load, on the model's own
shapes (every layer's fused QKV, O, fused gate/up and down products plus the LM head, 30 distinct
weight sets, so nothing sits in cache), per row-count bucket, logs the table, and each forward
uses the fastest of one threading runtime for its row count. A GPU has one backend (torch).

Threads: torch's OpenMP workers spin after each op and starve OpenBLAS's threads (a forward ran
10x slower with both on 2 threads), and OpenBLAS's workers spin after a product and starve the
next OpenMP pass as badly. So while numpy multiplies, torch runs on one thread and OpenBLAS gets
torch's thread count (``ThreadRegime``), and a plan never mixes the two runtimes across its row
counts (``choose_backends``): one threading runtime owns the cores.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import platform
import time
from collections import Counter
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

log = logging.getLogger(__name__)

BUCKETS = (1, 2, 4, 8, 16, 64)  # row counts timed at load; a forward uses the smallest bucket >= its rows
MEASURE_BUDGET_S = 3.0  # sweeps past the second stop once the table has taken this long
STABLE_SPREAD = 1.25  # a table is kept on disk only if its last sweep's winners are within this of the best
BACKEND_ENV = "SPECDEC_LEAN_BACKEND"  # torch | mkldnn | numpy: use that one, measure nothing


class Backend:
    """``mm(x, handle)`` = ``x @ W.T`` for ``handle = prepare(W)``; ``W`` is [out, in], fp32."""

    name = "torch"
    owns_threads = False  # True: torch must run on one thread while this backend multiplies
    layout = "dense"  # how prepare() lays a weight out: part of a kept table's key (a new layout measures again)

    def prepare(self, weight: torch.Tensor):
        return weight

    def mm(self, x: torch.Tensor, handle) -> torch.Tensor:
        return F.linear(x, handle)

    def mm_numpy(self, x: np.ndarray, handle) -> np.ndarray:
        """``mm`` on numpy rows (fp32, C-contiguous): zero-copy tensors in and out."""
        return self.mm(torch.from_numpy(x), handle).numpy()


class MkldnnBackend(Backend):
    """oneDNN with the weight reordered once into its own layout. The input and output stay dense
    (the pointwise-linear op inductor uses), which saves two layout conversions per product
    (10-15 % of a 2-16-row product here) over ``mkldnn_linear`` on oneDNN tensors.

    oneDNN's multi-row fp32 kernel rounds its long sums worse than the other BLAS: on the embedded
    target's down projection (1 536 terms) its error against float64 was ~2x numpy's and MKL's, and
    the whole forward's logits 2.15e-4 from a float64 forward against transformers' 9.7e-5. Products
    over more than ``K_BLOCK`` inputs are therefore summed from blocks of at most that many (each
    block one oneDNN product), which brings the forward to 1.0e-4 at no measurable cost
    (docs/benchmarks.md)."""

    name = "mkldnn"
    K_BLOCK = 768
    # The weight goes into the blocked layout oneDNN picks for this many rows (inductor's packing):
    # products of 1-8 rows took 15-17 ms for the embedded target's weights against 19-24 ms in the
    # plain layout (docs/benchmarks.md).
    PACKED_FOR_ROWS = 4
    layout = f"packed for {PACKED_FOR_ROWS} rows, {K_BLOCK}-input blocks"

    def prepare(self, weight: torch.Tensor):
        inputs = weight.shape[1]
        blocks = -(-inputs // self.K_BLOCK)
        if blocks == 1:
            return self._pack(weight)
        bounds = [inputs * i // blocks for i in range(blocks + 1)]
        return [(start, stop, self._pack(weight[:, start:stop].contiguous()))
                for start, stop in zip(bounds, bounds[1:])]

    def _pack(self, weight: torch.Tensor):
        if _REORDER_LINEAR_WEIGHT is not None and _DENSE_IO_LINEAR is not None:
            return _REORDER_LINEAR_WEIGHT(weight, self.PACKED_FOR_ROWS)
        return weight.to_mkldnn()

    def mm(self, x: torch.Tensor, handle) -> torch.Tensor:
        if isinstance(handle, list):
            start, stop, block = handle[0]
            out = self._linear(x[:, start:stop], block)
            for start, stop, block in handle[1:]:
                out += self._linear(x[:, start:stop], block)
            return out
        return self._linear(x, handle)

    @staticmethod
    def _linear(x: torch.Tensor, packed) -> torch.Tensor:
        if _DENSE_IO_LINEAR is not None:
            return _DENSE_IO_LINEAR(x.contiguous(), packed, None, "none", [], "")
        return torch._C._nn.mkldnn_linear(x.contiguous().to_mkldnn(), packed, None).to_dense()


_DENSE_IO_LINEAR = getattr(getattr(torch.ops, "mkldnn", None), "_linear_pointwise", None)
_REORDER_LINEAR_WEIGHT = getattr(getattr(torch.ops, "mkldnn", None), "_reorder_linear_weight", None)


class NumpyBackend(Backend):
    """numpy's BLAS (OpenBLAS in numpy's wheels) on the tensors' own memory."""

    name = "numpy"
    owns_threads = True

    def prepare(self, weight: torch.Tensor):
        return weight.numpy().T  # [in, out] view of the same memory: the BLAS call transposes

    def mm(self, x: torch.Tensor, handle) -> torch.Tensor:
        return torch.from_numpy(np.matmul(x.contiguous().numpy(), handle))

    def mm_numpy(self, x: np.ndarray, handle) -> np.ndarray:
        return np.matmul(x, handle)


def available_backends(device: torch.device) -> dict[str, Backend]:
    if device.type != "cpu":
        return {"torch": Backend()}
    backends: dict[str, Backend] = {"torch": Backend()}
    if torch.backends.mkldnn.is_available():
        backends["mkldnn"] = MkldnnBackend()
    backends["numpy"] = NumpyBackend()
    return backends


class Linear:
    """One weight matrix [out, in] and its prepared form for each backend in use."""

    __slots__ = ("weight", "handles")

    def __init__(self, weight: torch.Tensor) -> None:
        self.weight = weight
        self.handles: dict[str, object] = {}

    def prepare(self, backends) -> None:
        for backend in backends:
            if backend.name not in self.handles:
                self.handles[backend.name] = backend.prepare(self.weight)

    def drop(self, name: str) -> None:
        self.handles.pop(name, None)


class OpenBLASThreads:
    """numpy's OpenBLAS thread count, through threadpoolctl. Its controllers are found once (the scan
    of loaded libraries is the costly part) and kept: the thread regime sets the count on every pass."""

    def __init__(self) -> None:
        self._controllers: list | None = None  # None: not looked up yet
        self._count: int | None = None  # the count last set, so an unchanged one costs no library call

    def _libraries(self) -> list:
        if self._controllers is None:
            import numpy  # noqa: F401  (loads its BLAS, so that the scan finds it)
            from threadpoolctl import ThreadpoolController

            self._controllers = ThreadpoolController().select(internal_api="openblas").lib_controllers
        return self._controllers

    def __call__(self, count: int | None = None) -> int | None:
        """Set (``count``) and return the thread count; None where no OpenBLAS is loaded."""
        libraries = self._libraries()
        if not libraries:
            return None
        if count is None:
            return libraries[0].get_num_threads()
        if count != self._count:
            for library in libraries:
                library.set_num_threads(int(count))
            self._count = int(count)
        return self._count


openblas_threads = OpenBLASThreads()


class ThreadRegime:
    """While a thread-owning backend (numpy) runs a forward: torch on one thread, the BLAS on the
    threads torch had; restored afterwards."""

    @contextlib.contextmanager
    def __call__(self, backend: Backend):
        if not backend.owns_threads:
            openblas_threads(1)  # numpy's small products (attention) stay on this thread: torch's pool spins
            yield
            return
        threads = torch.get_num_threads()
        openblas_threads(threads)  # the BLAS gets torch's share of the cores (a --threads 1 drafter: one)
        if threads > 1:
            torch.set_num_threads(1)
        try:
            yield
        finally:
            if threads > 1:
                torch.set_num_threads(threads)


def _random_inputs(rows: int, linears: list[Linear]) -> dict[int, torch.Tensor]:
    """One random [rows, width] input per input width of ``linears`` (their dtype and device)."""
    inputs: dict[int, torch.Tensor] = {}
    for linear in linears:
        width = linear.weight.shape[1]
        if width not in inputs:
            inputs[width] = torch.randn(rows, width, dtype=linear.weight.dtype, device=linear.weight.device)
    return inputs


def smallest_bucket(n: int, buckets) -> int | None:
    """The smallest bucket holding ``n``, or None when ``n`` is past the largest."""
    return next((b for b in buckets if b >= n), None)


def bucket_of(rows: int, buckets=BUCKETS) -> int:
    """``smallest_bucket``, or the largest bucket past it (a table row stands for every larger count)."""
    return smallest_bucket(rows, buckets) or buckets[-1]


def choose_backends(table: dict[int, dict[str, float]], backends: dict[str, Backend]) -> dict[int, str]:
    """The backend per bucket: the fastest of one threading runtime for every bucket (OpenBLAS's own
    threads, or torch's OpenMP pool, which MKL and oneDNN share), the runtime whose buckets sum least.

    Never both: a pass right after one on the other runtime finds the other's worker threads still
    spinning on the cores. Alternating one-token passes on OpenBLAS with three-token passes on oneDNN,
    as a verifier does between plain and speculative rounds, took 61-115 ms per three-token pass
    against 20-21 ms with every pass on oneDNN (docs/benchmarks.md), while each alone looked fastest."""
    runtimes: dict[bool, list[str]] = {}
    for name, backend in backends.items():
        runtimes.setdefault(backend.owns_threads, []).append(name)
    plans = [{bucket: min(names, key=row.__getitem__) for bucket, row in table.items()} for names in runtimes.values()]
    return min(plans, key=lambda plan: sum(table[bucket][name] for bucket, name in plan.items()))


class MatmulPlan:
    """The backend per row-count bucket, measured at load (or forced by name / ``$SPECDEC_LEAN_BACKEND``)."""

    def __init__(self, linears: list[Linear], device: torch.device, backend: str | None = None,
                 buckets=BUCKETS, reps: int = 3, timed: list[Linear] | None = None,
                 table_dir: Path | None = None) -> None:
        """``linears``: every weight of a forward, in forward order; ``timed``: the ones the table
        times (default all; the loader passes enough layers to overflow the caches, plus the head,
        which keeps the measurement to a second or two). ``table_dir``: where measured tables are
        kept, one file per machine, library versions, thread count and weight shapes; a later load
        with the same key reads it instead of measuring (delete the file to measure again)."""
        self.linears = linears
        self.timed = timed or linears
        # A timed product stands for every weight of its shape (the head once, a projection once per layer).
        every = Counter(tuple(linear.weight.shape) for linear in linears)
        timed_count = Counter(tuple(linear.weight.shape) for linear in self.timed)
        self._weights = {shape: every[shape] / count for shape, count in timed_count.items()}
        self.backends = available_backends(device)
        self.buckets = tuple(buckets)
        self.regime = ThreadRegime()
        self.table: dict[int, dict[str, float]] = {}
        self.table_file: Path | None = None
        self.table_source: str | None = None  # measured at load, or read from table_file
        self.table_stable = False  # measured on what looked like a quiet machine (so worth keeping)
        forced = backend or os.environ.get(BACKEND_ENV) or None
        if forced and forced != "auto":
            if forced not in self.backends:
                raise ValueError(f"matmul backend {forced!r} is not available here ({', '.join(self.backends)})")
            self.backends = {forced: self.backends[forced]}
        for linear in linears:
            linear.prepare(self.backends.values())
        if len(self.backends) == 1:
            only = next(iter(self.backends))
            self.choice = {bucket: only for bucket in self.buckets}
        else:
            self.table_file = None if table_dir is None else Path(table_dir) / f"{self.table_key()}.json"
            self.table = self._load_table() or self.measure(reps)
            self._save_table()
            self.choice = choose_backends(self.table, self.backends)
            for name in set(self.backends) - set(self.choice.values()):  # unused: free its packed copies
                for linear in linears:
                    linear.drop(name)
                del self.backends[name]
        self._by_rows = {}
        log.info("lean matmul backends: %s", self.describe())

    def backend(self, rows: int) -> Backend:
        name = self._by_rows.get(rows)
        if name is None:
            name = self._by_rows[rows] = self.choice[bucket_of(rows, self.buckets)]
        return self.backends[name]

    def prepare(self, linear: Linear) -> None:
        linear.prepare(self.backends.values())

    @torch.inference_mode()
    def time_products(self, backend: Backend, rows: int, reps: int = 1, linears: list[Linear] | None = None,
                      warm: bool = True) -> float:
        """Seconds (min over ``reps``, after a warm-up run if ``warm``) for the products of ``linears``
        (default: every one of a forward) over ``rows`` rows."""
        linears = linears or self.linears
        inputs = _random_inputs(rows, linears)
        best = float("inf")
        with self.regime(backend):
            for rep in range(reps + int(warm)):
                start = time.perf_counter()
                for linear in linears:
                    backend.mm(inputs[linear.weight.shape[1]], linear.handles[backend.name])
                if linear.weight.device.type == "cuda":
                    torch.cuda.synchronize()
                if rep or not warm:
                    best = min(best, time.perf_counter() - start)
        return best

    @torch.inference_mode()
    def time_weighted(self, backend: Backend, rows: int) -> float:
        """Seconds for a whole forward's products over ``rows`` rows, from one pass over the timed
        subset (in forward order, so caches see what a forward shows them): each product's time
        counts for every weight of its shape (the head once, a layer's projection once per layer)."""
        inputs = _random_inputs(rows, self.timed)
        total = 0.0
        with self.regime(backend):
            for linear in self.timed:
                start = time.perf_counter()
                backend.mm(inputs[linear.weight.shape[1]], linear.handles[backend.name])
                if linear.weight.device.type == "cuda":
                    torch.cuda.synchronize()
                total += (time.perf_counter() - start) * self._weights[tuple(linear.weight.shape)]
        return total

    def measure(self, reps: int = 3) -> dict[int, dict[str, float]]:
        """Per bucket and backend, ms for a whole forward's products (``time_weighted``), min over
        ``reps`` sweeps after an uncounted warm-up one; each sweep times every cell once (a burst of
        load hits all alike), backend after backend."""
        table: dict[int, dict[str, float]] = {bucket: {} for bucket in self.buckets}
        began = time.perf_counter()
        sweep: dict[int, dict[str, float]] = {}
        sweeps = 0
        for bucket in self.buckets:  # warm-up, not counted: first calls pay for thread pools and primitives
            for backend in self.backends.values():
                self.time_weighted(backend, bucket)
        for rep in range(max(reps, 2)):
            if rep >= 2 and time.perf_counter() - began > MEASURE_BUDGET_S:  # a loaded machine: enough
                break
            sweep = {bucket: {} for bucket in self.buckets}
            # Backend by backend: the first products after a switch of threading runtime pay for the
            # other one's spinning threads, which says nothing about either.
            for name, backend in self.backends.items():
                self.time_weighted(backend, self.buckets[0])
                for bucket in self.buckets:
                    seconds = self.time_weighted(backend, bucket)
                    sweep[bucket][name] = seconds
                    table[bucket][name] = min(table[bucket].get(name, float("inf")), seconds)
            sweeps += 1
        # Kept for later loads only if it looks like a quiet machine's: more than one sweep fitted the
        # budget, and the last sweep alone picks the same backends at times near the table's.
        self.table_stable = sweeps >= 2 and all(
            min(sweep[b], key=sweep[b].get) == min(row, key=row.get) and sweep[b][min(row, key=row.get)]
            <= STABLE_SPREAD * min(row.values()) for b, row in table.items())
        return table

    def table_key(self) -> str:
        """What a measured table depends on: the CPU, the libraries, the threads, the shapes timed."""
        import numpy

        cpu = platform.processor()
        try:
            with open("/proc/cpuinfo") as info:
                cpu = next((line.split(":", 1)[1].strip() for line in info if line.startswith("model name")), cpu)
        except OSError:
            pass
        shapes = [(tuple(linear.weight.shape), str(linear.weight.dtype)) for linear in self.timed]
        parts = [cpu, os.cpu_count(), torch.__version__, numpy.__version__, torch.get_num_threads(),
                 sorted(self.backends), self.buckets, shapes, len(self.linears),
                 os.environ.get("OPENBLAS_CORETYPE", ""), [backend.layout for backend in self.backends.values()]]
        return hashlib.sha256(repr(parts).encode()).hexdigest()[:20]

    def _load_table(self) -> dict[int, dict[str, float]] | None:
        if self.table_file is None:
            return None
        try:
            stored = json.loads(self.table_file.read_text())
            table = {int(bucket): {name: float(ms) / 1e3 for name, ms in row.items()}
                     for bucket, row in stored["ms"].items()}
        except (OSError, ValueError, KeyError, TypeError, AttributeError):
            return None
        if set(table) != set(self.buckets) or any(set(row) != set(self.backends) for row in table.values()):
            return None
        self.table_source = f"read from {self.table_file}"
        return table

    def _save_table(self) -> None:
        if self.table_file is None or self.table_source:
            return
        self.table_source = "measured at load"
        if not self.table_stable:
            self.table_source += " (a busy machine, it seems: not kept, the next load measures again)"
            return
        stored = {"ms": {str(b): {n: s * 1e3 for n, s in row.items()} for b, row in self.table.items()},
                  "measured": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "threads": torch.get_num_threads()}
        try:
            self.table_file.parent.mkdir(parents=True, exist_ok=True)
            partial = self.table_file.with_suffix(f".{os.getpid()}.tmp")
            partial.write_text(json.dumps(stored, indent=1))
            partial.replace(self.table_file)  # atomic: concurrent loads never read half a file
            self.table_source += f", kept in {self.table_file}"
        except OSError as exc:
            log.warning("lean matmul table not kept (%s): the next load measures again", exc)

    def describe(self) -> str:
        if not self.table:
            return f"{next(iter(self.choice.values()))} (only one available or forced)"
        cells = []
        for bucket, row in self.table.items():
            times = " ".join(f"{name} {seconds * 1e3:.3g}" for name, seconds in row.items())
            cells.append(f"{bucket} rows: {times} ms -> {self.choice[bucket]}")
        return "; ".join(cells) + (f" ({self.table_source})" if self.table_source else "")
