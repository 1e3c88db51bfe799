"""How much host memory this process may still take (what a CPU's kernels may spend on a
second copy of the weights, whether the KV pool fits), and zeroed host memory that costs
nothing until it is used.

On a CPU nothing sizes the model against the host the way memory_budget.py does against
a GPU, and the fastest linear layers may hold more than the checkpoint's bytes (a layer
split by row count keeps two kernels' copies, one of them widened to fp32: three times
a bf16 weight's bytes). The Linux kernel's own estimate (`MemAvailable`) and, in a
container, the cgroup's limit less its working set (as the kubelet counts it: usage less
reclaimable file pages) bound what may be taken before the OOM killer acts.
"""
from __future__ import annotations

import mmap
from pathlib import Path

import torch

GIB = 1 << 30
# Left free beyond the KV pool: one chunk's activations, adapters in the CPU tier, the
# tokenizer and Python's own heap.
HOST_HEADROOM = GIB
_UNLIMITED = 1 << 60  # cgroup v1 reports "no limit" as a page-rounded 2**63 - 1


def host_memory_available(meminfo: Path = Path("/proc/meminfo"), cgroup: Path = Path("/sys/fs/cgroup"),
                          own_cgroup: Path = Path("/proc/self/cgroup")) -> int | None:
    """Bytes this process may still allocate: the least of MemAvailable and, for its
    cgroup and each one above it (v2, or v1's memory controller), the limit less the
    working set; None where none can be read (not Linux)."""
    v2_path, v1_path = _own_cgroups(own_cgroup)
    found = [_meminfo_available(meminfo)]
    found += [_cgroup_available(d, "memory.max", "memory.current", "inactive_file") for d in _up(cgroup, v2_path)]
    found += [_cgroup_available(d, "memory.limit_in_bytes", "memory.usage_in_bytes", "total_inactive_file")
              for d in _up(cgroup / "memory", v1_path)]
    found = [n for n in found if n is not None]
    return max(0, min(found)) if found else None


def _own_cgroups(own_cgroup: Path) -> tuple[str, str]:
    """This process's (v2, v1 memory controller) cgroup paths; "/" where not listed (in a
    container with its own cgroup namespace the path is "/": the root is its cgroup)."""
    v2 = v1 = "/"
    for line in (_read(own_cgroup) or "").splitlines():
        number, controllers, path = (line.split(":", 2) + ["", ""])[:3]
        if number == "0" and not controllers:
            v2 = path
        elif "memory" in controllers.split(","):
            v1 = path
    return v2, v1


def _up(root: Path, path: str) -> list[Path]:
    """The folder of cgroup `path` under `root` and each one above it, up to `root`."""
    parts = [p for p in path.strip().split("/") if p]
    return [root.joinpath(*parts[:i]) for i in range(len(parts), -1, -1)]


def _read(path: Path) -> str | None:
    try:
        return path.read_text()
    except OSError:
        return None


def _meminfo_available(path: Path) -> int | None:
    for line in (_read(path) or "").splitlines():
        name, _, value = line.partition(":")
        if name == "MemAvailable":
            return int(value.split()[0]) * 1024  # kB
    return None


def _stat(text: str | None, key: str) -> int:
    for line in (text or "").splitlines():
        name, _, value = line.partition(" ")
        if name == key:
            return int(value)
    return 0


def _cgroup_available(folder: Path, limit_file: str, usage_file: str, reclaimable: str) -> int | None:
    """A cgroup's limit less its working set (usage less reclaimable file pages, as the
    kubelet counts it); None without a limit ("max" in v2, ~2**63 in v1) or its files."""
    limit, usage = _read(folder / limit_file), _read(folder / usage_file)
    if limit is None or usage is None or limit.strip() == "max" or int(limit) >= _UNLIMITED:
        return None
    working_set = int(usage) - _stat(_read(folder / "memory.stat"), reclaimable)
    return int(limit) - max(working_set, 0)


def spare_for_weights(reserved: int, available: int | None = None) -> int | None:
    """Host bytes extra weight copies may take once `reserved` bytes (the KV pool, yet to
    be allocated) and HOST_HEADROOM are set aside; None where the host's memory is unknown."""
    available = host_memory_available() if available is None else available
    return None if available is None else max(0, available - reserved - HOST_HEADROOM)


def lazy_zeros(numel: int, dtype: torch.dtype) -> torch.Tensor:
    """A zeroed 1-D CPU tensor whose pages are taken only when first written: a private
    anonymous mapping, which the kernel zero-fills page by page. `torch.zeros` writes all
    of it at once: a 1 GiB KV pool took 0.5-1.2 s at every engine start, most of it for
    blocks a small deployment never fills. Transparent huge pages are declined: the first
    K or V block written would zero a whole 2 MiB page per layer and head (0.73 s for a
    first 512-token prompt on SmolLM2's layout where 4 KiB pages took 5 ms; filling the
    pool took 1.29 s against 0.35 s, and writing it warm the same 0.055 s)."""
    nbytes = numel * dtype.itemsize
    flags = getattr(mmap, "MAP_PRIVATE", 0) | getattr(mmap, "MAP_ANONYMOUS", 0)
    if nbytes == 0 or not hasattr(mmap, "MAP_ANONYMOUS"):
        return torch.zeros(numel, dtype=dtype)
    region = mmap.mmap(-1, nbytes, flags=flags)
    if hasattr(mmap, "MADV_NOHUGEPAGE"):
        region.madvise(mmap.MADV_NOHUGEPAGE)
    return torch.frombuffer(region, dtype=dtype)  # the tensor holds the mapping
