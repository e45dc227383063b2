"""Threads are sized by the CPUs this process may use: the affinity mask capped by a cgroup quota (a container
given 2 CPUs of a 64-core host must not run 64 threads)."""

import os

from pipeline.infra.cpus import cgroup_quota, usable_cpus


def test_cgroup_v2_quota_caps_the_affinity_mask(tmp_path):
    (tmp_path / "cpu.max").write_text("150000 100000\n")          # 1.5 CPUs
    assert cgroup_quota(tmp_path) == 1.5
    assert usable_cpus(tmp_path) == min(len(os.sched_getaffinity(0)), 2)
    (tmp_path / "cpu.max").write_text("50000 100000\n")           # half a CPU: still one thread
    assert usable_cpus(tmp_path) == 1


def test_no_quota_leaves_the_affinity_mask(tmp_path):
    (tmp_path / "cpu.max").write_text("max 100000\n")
    assert cgroup_quota(tmp_path) is None
    assert usable_cpus(tmp_path) == len(os.sched_getaffinity(0))
    assert cgroup_quota(tmp_path / "absent") is None


def test_cgroup_v1_quota(tmp_path):
    d = tmp_path / "cpu"
    d.mkdir()
    (d / "cpu.cfs_quota_us").write_text("100000\n")
    (d / "cpu.cfs_period_us").write_text("100000\n")
    assert cgroup_quota(tmp_path) == 1.0 and usable_cpus(tmp_path) == 1
    (d / "cpu.cfs_quota_us").write_text("-1\n")                   # unlimited
    assert cgroup_quota(tmp_path) is None


def test_the_run_and_the_hardware_record_use_it():
    from pipeline.infra.stage_cache import hardware
    from tests.conftest import compose

    assert compose([]).runtime.n_threads == usable_cpus()
    assert hardware()["usable_cpus"] == usable_cpus()
