"""The idle-GPU guard: a timing is a measurement only if nothing else ran on the GPU meanwhile.

Before the first timed call and after the last, the benchmark asks NVML (``pynvml``, from the
PyPI package ``nvidia-ml-py``: ``pip install 'cupyattn[bench]'``; imported only here, only when a
run starts) which compute processes hold the GPU, how busy it was, and its SM and memory clocks
(with NVML's reasons when they are held down). The run is *shared* when

- a compute process other than this one holds the GPU at either moment, or
- the GPU was busy (utilization at least :data:`BUSY_PCT`) before this process timed anything.

A shared run is refused before timing (exit status 3); one found shared only after timing keeps
its outputs, marked, but is not recorded. ``--allow-shared`` (or ``CUPYATTN_BENCH_ALLOW_SHARED=1``,
which the test tiers set: pytest-xdist's workers share the GPU by design) runs and records it with
``meta.gpu_guard.shared`` true; ``compare`` flags every record of such a run and the README table
never uses it. Under the CPU emulator the guard does not apply (nothing there is a GPU timing).

NVML in a container may report processes under another PID namespace (this process's own PID
is then absent; a process we cannot name as ours is counted as ours only when it is the single
one) or none at all (then only the utilization rule can tell: recorded as ``processes_visible``
false). The 2026-11-27 H100 run is why this exists: its second call began while the previous
call's benchmark process still held the GPU, and unchanged kernels took 2 to 15 times as long.
"""
from __future__ import annotations

import datetime
import os

BUSY_PCT = 10           # GPU utilization (NVML's sample period, up to a second) that means "busy"
ALLOW_ENV = "CUPYATTN_BENCH_ALLOW_SHARED"
# NVML's clock-event (throttle) reason bits (nvml.h, nvmlClocksEventReason*)
CLOCK_REASONS = {0x1: "gpu_idle", 0x2: "applications_clocks_setting", 0x4: "sw_power_cap", 0x8: "hw_slowdown",
                 0x10: "sync_boost", 0x20: "sw_thermal_slowdown", 0x40: "hw_thermal_slowdown",
                 0x80: "hw_power_brake_slowdown", 0x100: "display_clock_setting"}


class GuardUnavailable(RuntimeError):
    """NVML cannot be asked (no nvidia-ml-py, or no driver)."""


def _nvml():
    try:
        import pynvml
    except ImportError:
        raise GuardUnavailable("the idle-GPU guard needs NVML's Python binding: pip install nvidia-ml-py "
                               "(or 'cupyattn[bench]')") from None
    try:
        pynvml.nvmlInit()
    except Exception as e:  # pynvml.NVMLError and its subclasses
        raise GuardUnavailable(f"NVML did not start ({e})") from None
    return pynvml


def _try(fn, *args):
    """An NVML query's value, or None where this GPU or driver does not support it."""
    try:
        return fn(*args)
    except Exception:
        return None


def _text(v):
    return v.decode() if isinstance(v, bytes) else v


def snapshot(nv, handle) -> dict:
    """What NVML says of the GPU now: compute processes (pid, name, MiB), utilization, memory used,
    SM and memory clocks (current and maximum) and the reasons the clocks are held down."""
    procs = []
    for p in _try(nv.nvmlDeviceGetComputeRunningProcesses, handle) or []:
        used = getattr(p, "usedGpuMemory", None)
        procs.append({"pid": int(p.pid), "name": _text(_try(nv.nvmlSystemGetProcessName, p.pid)),
                      "used_mib": None if used is None else int(used) // 2**20})
    util = _try(nv.nvmlDeviceGetUtilizationRates, handle)
    mem = _try(nv.nvmlDeviceGetMemoryInfo, handle)
    sm, memclk = nv.NVML_CLOCK_SM, nv.NVML_CLOCK_MEM
    get_reasons = getattr(nv, "nvmlDeviceGetCurrentClocksEventReasons", None) or getattr(
        nv, "nvmlDeviceGetCurrentClocksThrottleReasons", None)
    bits = _try(get_reasons, handle) if get_reasons else None
    return {"time_utc": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
            "processes": procs,
            "utilization_pct": None if util is None else int(util.gpu),
            "memory_used_mib": None if mem is None else int(mem.used) // 2**20,
            "sm_clock_mhz": _try(nv.nvmlDeviceGetClockInfo, handle, sm),
            "sm_clock_max_mhz": _try(nv.nvmlDeviceGetMaxClockInfo, handle, sm),
            "mem_clock_mhz": _try(nv.nvmlDeviceGetClockInfo, handle, memclk),
            "mem_clock_max_mhz": _try(nv.nvmlDeviceGetMaxClockInfo, handle, memclk),
            "clock_reasons": None if bits is None else [n for b, n in CLOCK_REASONS.items() if bits & b]}


def others(snap: dict, own_pid: int) -> tuple[int, list[dict], bool]:
    """(processes besides this one, those we can name, whether processes are visible at all).

    This process holds a context when a snapshot is taken, so it is one of the listed processes:
    by its PID, or (another PID namespace) as one of those not named ours.
    """
    procs = snap["processes"]
    if not procs:
        return 0, [], False
    mine = [p for p in procs if p["pid"] == own_pid]
    rest = [p for p in procs if p["pid"] != own_pid]
    return (len(rest), rest, True) if mine else (len(procs) - 1, rest, True)


def verdict(before: dict, after: dict | None, own_pid: int) -> dict:
    """``shared`` (True / False) with the reasons, from the two snapshots."""
    reasons, visible = [], True
    for when, snap in (("before timing", before), ("after timing", after)):
        if snap is None:
            continue
        n, named, vis = others(snap, own_pid)
        visible &= vis
        if n:
            who = ", ".join(f"pid {p['pid']} {p['name'] or '?'} ({p['used_mib']} MiB)" for p in named[:3])
            reasons.append(f"{n} other process(es) on the GPU {when}" + (f": {who}" if who else ""))
    u = before.get("utilization_pct")
    if u is not None and u >= BUSY_PCT:
        reasons.append(f"utilization {u}% before timing")
    return {"shared": bool(reasons), "reasons": reasons, "processes_visible": visible}


class Guard:
    """One run's guard: :meth:`start` before timing, :meth:`finish` after; :attr:`meta` is what
    the results JSON records (``meta.gpu_guard``)."""

    def __init__(self, allow_shared: bool, pci_bus_id: str | None = None, device_index: int = 0):
        self.allow = bool(allow_shared) or os.environ.get(ALLOW_ENV, "") not in ("", "0")
        self.pci, self.index = pci_bus_id, device_index
        self.meta = {"checked": False, "shared": None, "allowed_shared": self.allow}
        self._nv = self._handle = None
        self._before = None

    def start(self) -> str | None:
        """Ask NVML; return the one-line refusal when the run must not start, else None."""
        if os.environ.get("CUPYATTN_EMULATE", "") not in ("", "0"):
            self.meta["reason"] = "CPU emulator: not a GPU timing"
            return None
        try:
            self._nv = _nvml()
            h = _try(self._nv.nvmlDeviceGetHandleByPciBusId, self.pci) if self.pci else None
            self._handle = h if h is not None else self._nv.nvmlDeviceGetHandleByIndex(self.index)
        except Exception as e:  # GuardUnavailable, or NVML knows no such device
            self.meta["reason"] = f"not checked: {e}"
            return None if self.allow else f"{e}; or pass --allow-shared to run unchecked (marked in the results)"
        self._before = snapshot(self._nv, self._handle)
        v = verdict(self._before, None, os.getpid())
        self.meta.update(checked=True, before=self._before, **v)
        if v["shared"] and not self.allow:
            return ("refused: the GPU is not idle (" + "; ".join(v["reasons"]) + "); rerun when it is, or pass "
                    "--allow-shared (the run is then marked shared and kept out of the README table)")
        return None

    def finish(self) -> bool:
        """Ask NVML again; True when the run was shared (before or after)."""
        if self._nv is None:
            return False
        after = snapshot(self._nv, self._handle)
        self.meta.update(after=after, **verdict(self._before, after, os.getpid()))
        _try(self._nv.nvmlShutdown)
        return bool(self.meta["shared"])
