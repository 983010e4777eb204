"""Timing on the device: CUDA events, warm-up, L2 flush, median of N reps, peak pool memory.

Every timed rep is: overwrite a buffer larger than L2 (so the op starts with a cold cache, as in
a model where the previous layer evicted its inputs) -> event -> op -> event. All events are read
after one synchronize at the end, so the host never stalls the queue between reps.
"""
from __future__ import annotations

import dataclasses
import statistics
import time


class NoDevice(RuntimeError):
    """No usable CUDA device; the CLI prints the message as one line and exits non-zero."""


def require_device() -> None:
    """Raise NoDevice with a one-line reason when CuPy cannot reach a CUDA device."""
    try:
        from cupyattn import gpu_unavailable_reason
    except ImportError as e:
        raise NoDevice(f"CuPy is not importable ({e})") from None
    reason = gpu_unavailable_reason()
    if reason:
        raise NoDevice(f"{reason}; the benchmarks need a CUDA GPU (without one, tinylm --backend "
                       "numpy and python -m cupyattn check still work)")


@dataclasses.dataclass
class Timing:
    median_ms: float
    min_ms: float
    max_ms: float
    reps: int


def summarize(times_ms: list[float]) -> Timing:
    """Median, min and max of a list of rep times (pure; unit-tested)."""
    if not times_ms:
        raise ValueError("no timed reps")
    return Timing(statistics.median(times_ms), min(times_ms), max(times_ms), len(times_ms))


def plan_reps(estimate_ms: float, reps: int, budget_ms: float, min_reps: int = 5) -> int:
    """How many timed reps fit in ``budget_ms`` given one run's estimate; at least ``min_reps``."""
    if estimate_ms <= 0:
        return reps
    return max(min(reps, min_reps), min(reps, int(budget_ms / estimate_ms)))


class L2Flusher:
    """Writes a buffer of twice the L2 size; the write evicts whatever the last rep left there."""

    def __init__(self):
        import cupy

        dev = cupy.cuda.Device()
        l2 = int(dev.attributes.get("L2CacheSize", 0)) or 64 * 2**20
        self.nbytes = 2 * l2
        self._buf = cupy.empty(self.nbytes // 4, dtype=cupy.int32)
        self._i = 0

    def __call__(self):
        # A different value each time, so no layer can skip the write as redundant.
        self._i = (self._i + 1) & 0x7FFFFFFF
        self._buf.fill(self._i)


def time_fn(fn, warmup: int = 3, reps: int = 30, budget_ms: float = 2000.0, flusher=None,
            sync=None) -> Timing:
    """Median/min/max milliseconds of ``fn()`` over timed reps, measured with CUDA events.

    ``warmup`` untimed calls first (compilation, handle creation, allocator growth; 0: none, the
    one untimed estimate below aside); the number of timed reps is cut so they fit roughly in
    ``budget_ms``. ``sync`` (optional) is called before
    events are read, for peers whose work runs on another library's queue.
    """
    import cupy

    stream = cupy.cuda.get_current_stream()
    for _ in range(warmup):
        fn()
    # One timed estimate (queue drained first) decides how many reps fit in the budget.
    if sync:
        sync()
    stream.synchronize()
    t0 = time.perf_counter()
    fn()
    if sync:
        sync()
    stream.synchronize()
    est = (time.perf_counter() - t0) * 1e3
    n = plan_reps(est, reps, budget_ms)
    pairs = []
    for _ in range(n):
        if flusher is not None:
            flusher()
        start, end = cupy.cuda.Event(), cupy.cuda.Event()
        start.record(stream)
        fn()
        end.record(stream)
        pairs.append((start, end))
    if sync:
        sync()
    pairs[-1][1].synchronize()
    return summarize([cupy.cuda.get_elapsed_time(s, e) for s, e in pairs])


class PeakPool:
    """High-water mark of CuPy memory-pool bytes in use while the context is open.

    Wraps the current allocator: after each allocation the pool's ``used_bytes()`` is read, so
    the peak includes the inputs already held plus everything the op allocated, freed or not.
    """

    def __init__(self):
        import cupy

        self._cupy = cupy
        self.pool = cupy.get_default_memory_pool()
        self.peak = 0

    def _malloc(self, nbytes):
        mem = self.pool.malloc(nbytes)
        self.peak = max(self.peak, self.pool.used_bytes())
        return mem

    def __enter__(self):
        self._old = self._cupy.cuda.get_allocator()
        self.peak = self.pool.used_bytes()
        self._cupy.cuda.set_allocator(self._malloc)
        return self

    def __exit__(self, *exc):
        self._cupy.cuda.set_allocator(self._old)
        return False


def measure_ceilings(copy_mib: int = 1024, gemm_n: int = 8192, reps: int = 20) -> dict:
    """The two ceilings of this device, measured now: D2D copy GB/s and cuBLAS fp16 TFLOP/s.

    Copy bandwidth counts bytes read plus bytes written. The GEMM is cupy.matmul (cuBLAS) on
    random fp16 operands (never zeros: that runs faster than real data).
    """
    import cupy

    n = copy_mib * 2**20 // 4
    src = cupy.random.standard_normal(n, dtype=cupy.float32)
    dst = cupy.empty_like(src)
    t_copy = time_fn(lambda: dst.data.copy_from_device_async(src.data, src.nbytes), warmup=3,
                     reps=reps, budget_ms=3000)
    a = cupy.random.standard_normal((gemm_n, gemm_n), dtype=cupy.float32).astype(cupy.float16)
    b = cupy.random.standard_normal((gemm_n, gemm_n), dtype=cupy.float32).astype(cupy.float16)
    c = cupy.empty_like(a)
    t_gemm = time_fn(lambda: cupy.matmul(a, b, out=c), warmup=3, reps=reps, budget_ms=3000)
    del src, dst, a, b, c
    cupy.get_default_memory_pool().free_all_blocks()
    return {
        "copy_gbps": 2 * n * 4 / (t_copy.median_ms * 1e-3) / 1e9,
        "gemm_tflops": 2 * gemm_n**3 / (t_gemm.median_ms * 1e-3) / 1e12,
        "copy_bytes": 2 * n * 4,
        "gemm_shape": f"M{gemm_n} N{gemm_n} K{gemm_n} float16 cupy.matmul",
    }
