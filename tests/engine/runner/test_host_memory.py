"""What a CPU's kernels may spend on extra weight copies: the host's available memory,
bounded by a container's cgroup limit, read from the files Linux writes."""
from __future__ import annotations

from pathlib import Path

from loraplex.engine.runner.host_memory import HOST_HEADROOM, host_memory_available, spare_for_weights

GIB = 1 << 30
MEMINFO = "MemTotal:       24000000 kB\nMemFree:         1000000 kB\nMemAvailable:   20000000 kB\n"


def _files(tmp_path: Path, files: dict[str, str]) -> tuple[Path, Path, Path]:
    files.setdefault("self-cgroup", "0::/\n")
    for name, text in files.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    return tmp_path / "meminfo", tmp_path / "cgroup", tmp_path / "self-cgroup"


def test_the_kernels_estimate_where_no_cgroup_limits_the_process(tmp_path):
    files = _files(tmp_path, {"meminfo": MEMINFO, "cgroup/memory.max": "max\n", "cgroup/memory.current": "123\n"})
    assert host_memory_available(*files) == 20000000 * 1024


def test_a_cgroup_v2_limit_less_its_working_set_bounds_it(tmp_path):
    # 8 GiB limit, 5 GiB charged of which 2 GiB are reclaimable file pages (the
    # checkpoint just read): 5 GiB left, though the host has ~19 GiB.
    files = _files(tmp_path, {"meminfo": MEMINFO, "cgroup/memory.max": f"{8 * GIB}\n",
                              "cgroup/memory.current": f"{5 * GIB}\n",
                              "cgroup/memory.stat": f"anon {3 * GIB}\ninactive_file {2 * GIB}\n"})
    assert host_memory_available(*files) == 5 * GIB


def test_the_process_cgroup_and_every_one_above_it_bound_it(tmp_path):
    # A service in a slice: its own cgroup has no limit, the slice above it has 6 GiB
    # with 4 GiB in use, the one above that 3 GiB with 2.5 GiB in use.
    files = _files(tmp_path, {"meminfo": MEMINFO, "self-cgroup": "0::/system.slice/loraplex.service\n",
                              "cgroup/system.slice/loraplex.service/memory.max": "max\n",
                              "cgroup/system.slice/loraplex.service/memory.current": f"{GIB}\n",
                              "cgroup/system.slice/memory.max": f"{6 * GIB}\n",
                              "cgroup/system.slice/memory.current": f"{4 * GIB}\n"})
    assert host_memory_available(*files) == 2 * GIB
    (tmp_path / "cgroup" / "memory.max").write_text(f"{3 * GIB}\n")
    (tmp_path / "cgroup" / "memory.current").write_text(f"{5 * GIB // 2}\n")
    assert host_memory_available(*files) == GIB // 2


def test_a_cgroup_v1_limit_bounds_it_and_its_unlimited_value_does_not(tmp_path):
    files = {"meminfo": MEMINFO, "cgroup/memory/memory.limit_in_bytes": f"{4 * GIB}\n",
             "cgroup/memory/memory.usage_in_bytes": f"{3 * GIB}\n",
             "cgroup/memory/memory.stat": f"cache 10\ntotal_inactive_file {GIB}\n"}
    assert host_memory_available(*_files(tmp_path, files)) == 2 * GIB
    # the process's own memory cgroup (listed in /proc/self/cgroup) bounds it too
    files["self-cgroup"] = "4:memory:/process_api/abc\n1:cpu:/\n0::/\n"
    files["cgroup/memory/process_api/abc/memory.limit_in_bytes"] = f"{3 * GIB}\n"
    files["cgroup/memory/process_api/abc/memory.usage_in_bytes"] = f"{5 * GIB // 2}\n"
    assert host_memory_available(*_files(tmp_path, files)) == GIB // 2
    files["cgroup/memory/process_api/abc/memory.limit_in_bytes"] = "9223372036854771712\n"
    files["cgroup/memory/memory.limit_in_bytes"] = "9223372036854771712\n"
    assert host_memory_available(*_files(tmp_path, files)) == 20000000 * 1024


def test_unknown_without_the_files_and_never_negative(tmp_path):
    assert host_memory_available(tmp_path / "none", tmp_path / "none", tmp_path / "none") is None
    files = _files(tmp_path, {"meminfo": MEMINFO, "cgroup/memory.max": f"{GIB}\n",
                              "cgroup/memory.current": f"{2 * GIB}\n"})
    assert host_memory_available(*files) == 0


def test_the_spare_is_what_is_left_after_the_kv_pool_and_the_headroom():
    assert spare_for_weights(2 * GIB, available=10 * GIB) == 8 * GIB - HOST_HEADROOM
    assert spare_for_weights(2 * GIB, available=GIB) == 0
    assert spare_for_weights(2 * GIB, available=host_memory_available()) is not None  # Linux


def _resident_bytes() -> int:
    return int(Path("/proc/self/statm").read_text().split()[1]) * 4096


def test_lazy_zeros_are_zeros_that_take_memory_only_when_written():
    import torch

    from loraplex.engine.runner.host_memory import lazy_zeros

    n = 128 << 20  # 256 MiB of bf16
    before = _resident_bytes()
    t = lazy_zeros(n, torch.bfloat16)
    assert t.shape == (n,) and t.dtype is torch.bfloat16
    assert _resident_bytes() - before < (32 << 20), "the pages are not taken at allocation"
    assert not t[:: 1 << 16].any()  # zeros where read (reading maps the shared zero page)
    t[7] = 3.0
    t.view(1024, -1)[-1].fill_(1.0)
    assert t[7].item() == 3.0 and int((t != 0).sum()) == 1 + n // 1024
    t.fill_(2.0)
    assert _resident_bytes() - before >= (200 << 20), "writing every page takes them"
    assert lazy_zeros(0, torch.float32).shape == (0,)
