"""What the host can still give (ckptzip/memory/host.py): the memory cgroups a process is in, v2 or
v1, nested as Slurm and systemd nest them or seen from inside a container, each limit less what
the kernel cannot reclaim of what is charged there."""

from __future__ import annotations

from pathlib import Path

import pytest

from ckptzip.memory import host

MIB = 1 << 20


def _cgroups(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, membership: str, files: dict[str, str]) -> None:
    """A /proc/self/cgroup of ``membership`` and a cgroup mount holding ``files`` (path: text)."""
    proc = tmp_path / "cgroup"
    proc.write_text(membership)
    for name, text in files.items():
        path = tmp_path / "sys" / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    monkeypatch.setattr(host, "_PROC_CGROUP", str(proc))
    monkeypatch.setattr(host, "_CGROUP_ROOT", str(tmp_path / "sys"))


def test_a_v2_limit_of_an_ancestor_counts_less_the_page_cache_it_may_reclaim(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _cgroups(tmp_path, monkeypatch, "0::/system.slice/job_42/step_0\n", {
        "system.slice/job_42/step_0/memory.max": "max\n",
        "system.slice/job_42/step_0/memory.current": f"{300 * MIB}\n",
        "system.slice/job_42/memory.max": f"{1024 * MIB}\n",
        "system.slice/job_42/memory.current": f"{512 * MIB}\n",
        "system.slice/job_42/memory.stat": f"anon {256 * MIB}\ninactive_file {200 * MIB}\nactive_file {56 * MIB}\n",
        "memory.max": "max\n",
    })
    assert host.cgroup_room() == (1024 - 512 + 200) * MIB


def test_a_v1_memory_controllers_limit_is_found_under_its_own_mount(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _cgroups(tmp_path, monkeypatch, "5:devices:/slurm/uid_7/job_9\n4:memory:/slurm/uid_7/job_9\n0::/\n", {
        "memory/slurm/uid_7/job_9/memory.limit_in_bytes": f"{2048 * MIB}\n",
        "memory/slurm/uid_7/job_9/memory.usage_in_bytes": f"{1536 * MIB}\n",
        "memory/slurm/uid_7/job_9/memory.stat": f"cache {600 * MIB}\ntotal_inactive_file {512 * MIB}\n",
        "memory/slurm/memory.limit_in_bytes": "9223372036854771712\n",
        "memory/slurm/memory.usage_in_bytes": f"{4096 * MIB}\n",
    })
    assert host.cgroup_room() == (2048 - 1536 + 512) * MIB


def test_inside_a_container_the_mounts_root_is_its_own_cgroup(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # no cgroup namespace: the host's path, which the container's mount does not hold
    _cgroups(tmp_path, monkeypatch, "0::/kubepods/burstable/pod1/abc\n", {
        "memory.max": f"{8192 * MIB}\n",
        "memory.current": f"{1024 * MIB}\n",
    })
    assert host.cgroup_room() == 7168 * MIB


@pytest.mark.parametrize("files", [
    {"memory.max": "max\n", "memory.current": "12345\n"},
    {"memory/memory.limit_in_bytes": "9223372036854771712\n", "memory/memory.usage_in_bytes": "1\n"},
    {},
])
def test_no_limit_is_no_room_to_count(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, files: dict[str, str]) -> None:
    _cgroups(tmp_path, monkeypatch, "4:memory:/a\n0::/a\n", files)
    assert host.cgroup_room() is None


def test_the_host_gives_no_more_than_its_tightest_cgroup(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _cgroups(tmp_path, monkeypatch, "0::/\n", {"memory.max": f"{64 * MIB}\n", "memory.current": f"{48 * MIB}\n"})
    assert host.host_available() == 16 * MIB
    _cgroups(tmp_path, monkeypatch, "0::/\n", {"memory.max": f"{64 * MIB}\n", "memory.current": f"{96 * MIB}\n"})
    assert host.host_available() == 0  # over its limit (reclaim pending): nothing to give
