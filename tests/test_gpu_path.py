"""The GPU path: device memory read where the work runs (NVML per process, torch's allocator peaks), the capacity
plan and the memory objective on it, scripts/gpu-check's verdict; and, marked `gpu`, every CUDA path on a real
device (deselected where none is present: CI has none)."""

import os
import subprocess
import sys
import types

import pytest

from pipeline.config.schema import PROJECT_ROOT


class _Proc:
    def __init__(self, pid, used):
        self.pid, self.usedGpuMemory = pid, used


def _fake_nvml(processes: dict[int, list], totals: dict[int, int]):
    calls = []
    m = types.ModuleType("pynvml")
    m.nvmlInit = lambda: calls.append("init")
    m.nvmlShutdown = lambda: calls.append("shutdown")
    m.nvmlDeviceGetCount = lambda: len(totals)
    m.nvmlDeviceGetHandleByIndex = lambda i: i
    m.nvmlDeviceGetComputeRunningProcesses = lambda h: processes.get(h, [])
    m.nvmlDeviceGetMemoryInfo = lambda h: types.SimpleNamespace(total=totals[h], used=0, free=totals[h])
    return m, calls


def test_device_memory_reads_nvml_for_this_process_and_torch_peaks(monkeypatch):
    import torch

    from pipeline.instruments.memory import device_memory

    me = os.getpid()
    fake, calls = _fake_nvml({0: [_Proc(me + 1, 9 * 2**30)], 1: [_Proc(me, 3 * 2**30), _Proc(me + 2, 2**30)]},
                             {0: 80 * 2**30, 1: 141 * 2**30})
    monkeypatch.setitem(sys.modules, "pynvml", fake)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda i: 2 * 2**30)
    monkeypatch.setattr(torch.cuda, "max_memory_reserved", lambda i: int(2.5 * 2**30))
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda i: types.SimpleNamespace(total_memory=141 * 2**30))
    d = device_memory("cuda:0")
    assert d["nvml_process_mb"] == pytest.approx(3 * 1024)        # this process only, on the device it uses
    assert d["torch_reserved_peak_mb"] == pytest.approx(2.5 * 1024)
    assert d["peak_mb"] == pytest.approx(3 * 1024)                 # NVML holds the CUDA context too: the larger
    assert d["device_total_mb"] == pytest.approx(141 * 1024)
    assert "NVML" in d["source"] and "torch" in d["source"]
    assert calls == ["init", "shutdown"]
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: False)     # llama.cpp in the process, no torch CUDA
    d = device_memory("cuda")
    assert d["peak_mb"] == pytest.approx(3 * 1024) and d["source"] == "NVML per-process"


def test_device_memory_is_none_off_cuda_and_without_nvml(monkeypatch):
    from pipeline.instruments.memory import device_memory, nvml_process_mb

    assert device_memory("cpu") is None and device_memory(None) is None
    monkeypatch.setitem(sys.modules, "pynvml", None)           # not installed: import fails
    assert nvml_process_mb(os.getpid()) is None


def _variant(rss_mb, device_mb=None, total_mb=None):
    return {"status": "ok", "memory": {"artifact_bytes": 100 * 2**20, "kv_bytes_per_token": 1000.0,
                                       "peak_rss_mb": rss_mb},
            "speed": {"prompt_tokens": 100, "decode_tokens": 100, "decode_tokens_per_s": 50.0},
            "drift": {"kld_mean": 0.01},
            "device_memory": None if device_mb is None else {"peak_mb": device_mb, "device_total_mb": total_mb,
                                                             "source": "NVML per-process", "device": "cuda"}}


def test_the_capacity_plan_uses_device_memory_and_the_devices_own_budget_on_a_gpu():
    from pipeline.figures.capacity import capacity_plan
    from pipeline.config.commands import CapacityConfig

    facts = {"layers": 2, "kv_heads": 1, "head_dim": 250, "params": 1e8}
    cap = CapacityConfig(memory_budget_gb=[16], context_tokens=1000, headroom=0.2)
    host = capacity_plan(_variant(rss_mb=2000), facts, cap)
    gpu = capacity_plan(_variant(rss_mb=2000, device_mb=900, total_mb=80 * 1024), facts, cap)
    probe_kv = 1000.0 * 200
    assert host["memory_basis"] == "host RSS" and host["device_budget_gb"] is None
    assert host["overhead_bytes"] == pytest.approx(2000 * 2**20 - 100 * 2**20 - probe_kv)
    assert gpu["memory_basis"].startswith("device")
    assert gpu["overhead_bytes"] == pytest.approx(900 * 2**20 - 100 * 2**20 - probe_kv)
    assert gpu["device_budget_gb"] == pytest.approx(85.9, abs=0.05)         # 80 GiB
    assert set(gpu["max_sequences"]) == {"16", "85.9"}
    free = 16e9 * 0.8 - 100 * 2**20 - gpu["overhead_bytes"]
    assert gpu["max_sequences"]["16"] == int(free // (1000.0 * 1000))
    assert gpu["max_sequences"]["16"] > host["max_sequences"]["16"]


def test_the_memory_objective_and_the_pareto_axis_read_the_device_peak_on_a_gpu():
    from pipeline.decide.recommendation import objective_value, pareto_point

    v = _variant(rss_mb=2000, device_mb=900, total_mb=80 * 1024)
    assert objective_value(v, "memory") == 900 and pareto_point(v)[2] == 900
    host = _variant(rss_mb=2000)
    assert objective_value(host, "memory") == 2000 and pareto_point(host)[2] == 2000


def _gpu_summary():
    from pipeline.decide.gpu_verdict import VARIANTS

    variants = {}
    for n in VARIANTS:
        llama = n.startswith("gguf")
        variants[n] = {"status": "ok", "runtime_info": {
            "runtime": "llamacpp" if llama else "hf", "device": "cuda" if llama else "cuda:0",
            "kernel": "ggml-cuda" if llama else "MarlinQuantLinear", **({"offloaded_layers": "31/31"} if llama else {})},
            "speed": {"decode_tokens_per_s": 300.0}, "memory": {"peak_rss_mb": 1500.0},
            "device_memory": {"peak_mb": 700.0}}
    return {"variants": variants, "reference": {"parity": {"ok": True, "f16_kld_mean": 3e-6, "f16_kld_max": 2e-5,
                                                           "max_kld": 1e-3, "f16_top1_agreement": 0.998}}}


def test_gpu_check_passes_when_every_variant_ran_on_the_gpu_and_names_each_failure():
    from pipeline.decide.gpu_verdict import check

    table, ok = check(_gpu_summary())
    assert ok and table.count("on the GPU") == 8 and "parity on CUDA: mean KLD 3.00e-06" in table
    s = _gpu_summary()
    s["variants"]["original"]["runtime_info"]["device"] = "cpu"
    s["variants"]["gguf_q4_k_m"]["runtime_info"]["offloaded_layers"] = "20/31"
    s["variants"]["awq_w4"] = {"status": "skipped", "reason": "no CUDA kernel"}
    s["variants"]["gptq_w4"]["device_memory"] = None
    s["variants"]["gguf_q8_0"]["runtime_info"]["torch_in_process"] = True
    del s["variants"]["original+kv_int8"]
    table, ok = check(s)
    assert not ok
    for why in ("ran on 'cpu', not cuda", "offloaded 20/31 layers (expected all)", "skipped: no CUDA kernel",
                "no device memory measured", "not in the summary",
                "llama.cpp loaded in a process that had imported torch"):
        assert why in table, why
    s = _gpu_summary()
    s["reference"]["parity"]["ok"] = False
    assert not check(s)[1]


def test_gpu_checks_partial_table_judges_the_finished_variants_with_their_intervals():
    """Written after each variant while the run goes on: the variants finished so far, judged on where they ran;
    the speed trials' memory and the parity are judged only by the final table."""
    from pipeline.decide.gpu_verdict import check

    s = _gpu_summary()
    for name in list(s["variants"])[2:]:
        del s["variants"][name]
    del s["reference"]
    for v in s["variants"].values():
        v["device_memory"] = None
    f16 = s["variants"]["gguf_f16"]
    f16["drift"] = {"kld_mean": 2e-6}
    f16["intervals"] = {"decode_tokens_per_s": {"low": 290.0, "high": 310.0}, "kld_mean": {"low": 1e-6, "high": 3e-6}}
    table, ok = check(s, partial=True)
    assert ok and table.count("on the GPU") == 2 and "awq_w4" not in table
    assert "300.0 [290.0, 310.0]" in table and "2.00e-06 [1.00e-06, 3.00e-06]" in table
    assert not check(s)[1]                 # the final verdict wants every variant, its device memory, the parity
    f16["runtime_info"]["device"] = "cpu"
    table, ok = check(s, partial=True)
    assert not ok and "ran on 'cpu', not cuda" in table


def test_gpu_check_main_reads_a_results_folder(tmp_path, capsys):
    import json

    from pipeline.decide.gpu_verdict import main

    (tmp_path / "summary.json").write_text(json.dumps(_gpu_summary()))
    assert main([str(tmp_path)]) == 0
    assert "every CUDA path ran on the GPU" in capsys.readouterr().out
    assert main([str(tmp_path / "nowhere")]) == 2
    # the variants a run was asked for: one that is not in it fails; the others are not judged
    assert main(["--variants", "original,gguf_f16", str(tmp_path)]) == 0
    assert main(["--variants", "original,gguf_q2_k", str(tmp_path)]) == 1
    assert "not in the summary" in capsys.readouterr().out


def test_the_gpu_check_script_says_clearly_that_there_is_no_device(tmp_path):
    env = {**os.environ, "PATH": f"{tmp_path}:/usr/bin:/bin"}        # a fake nvidia-smi that finds no device
    (tmp_path / "nvidia-smi").write_text("#!/bin/sh\necho 'No devices were found' >&2\nexit 6\n")
    (tmp_path / "nvidia-smi").chmod(0o755)
    out = subprocess.run([str(PROJECT_ROOT / "scripts" / "gpu-check")], capture_output=True, text=True, env=env,
                         timeout=60)
    assert out.returncode == 2 and "no CUDA device on this machine" in out.stderr


# ------------------------------------------------------------------ on a real CUDA device (deselected without one)

def _cfg(tmp_path, model, *extra):
    from tests.conftest import compose

    return compose([f"model.source={model}", "model.name=tiny", "profile=smoke", "run.suites=[smoke]",
                    f"paths.artifacts={tmp_path / 'a'}", f"paths.cache={PROJECT_ROOT / '.cache'}",
                    "runtime.device=cuda", *extra])


@pytest.mark.gpu
@pytest.mark.parametrize("variant", ["original", "original+kv_int8"])
def test_transformers_on_cuda_generates_and_records_device_memory(tmp_path, tiny_llama, variant):
    from pipeline.instruments.memory import device_memory
    from pipeline.stages.prepare import prepare
    from pipeline.runtimes import load_runtime

    cfg = _cfg(tmp_path, tiny_llama, f"variant={variant}")
    original = prepare(cfg.model, cfg.model_dir)
    rt = load_runtime(cfg.variant, original.checkpoint, cfg)
    try:
        gen = rt.generate([1, 2, 3, 4, 5, 6, 7, 8], 16, [])
        assert len(gen.ids) == 16 and str(rt.info["device"]).startswith("cuda")
        mem = device_memory(rt.info["device"])
        assert mem["peak_mb"] > 0 and mem["torch_reserved_peak_mb"] > 0
    finally:
        rt.close()


@pytest.mark.gpu
@pytest.mark.parametrize("variant", ["gguf_f16", "gguf_q8_0+kv_q8_0"])
def test_llama_cpp_offloads_every_layer_on_cuda(tmp_path, tiny_llama, variant):
    from pipeline.instruments.memory import device_memory
    from pipeline.stages.prepare import prepare
    from pipeline.stages.quantize import build_artifact
    from pipeline.runtimes import load_runtime

    cfg = _cfg(tmp_path, tiny_llama, f"variant={variant}")
    original = prepare(cfg.model, cfg.model_dir)
    art = build_artifact(cfg.variant, original, cfg)
    rt = load_runtime(cfg.variant, art.path, cfg, n_ctx=512)
    try:
        assert rt.info["kernel"] == "ggml-cuda"
        done, total = rt.info["offloaded_layers"].split("/")
        assert done == total
        assert len(rt.generate([1, 2, 3, 4], 8, []).ids) == 8
        assert device_memory("cuda")["nvml_process_mb"] > 0
    finally:
        rt.close()


@pytest.mark.gpu
def test_gptq_runs_on_a_cuda_kernel(tmp_path, tiny_tokenizer_dir):
    pytest.importorskip("gptqmodel")
    from pipeline.compose import load_variant
    from pipeline.stages.prepare import prepare
    from pipeline.stages.quantize import build_artifact
    from pipeline.runtimes import load_runtime
    from tests.conftest import build_tiny_llama

    model = build_tiny_llama(tmp_path / "m", tiny_tokenizer_dir, hidden=128)
    cfg = _cfg(tmp_path, model, "variant=gptq_w4")
    original = prepare(cfg.model, cfg.model_dir)
    v = load_variant("gptq_w4")
    v.quantize["calibration"]["samples"] = 16
    v.quantize["calibration"]["seq_len"] = 64
    art = build_artifact(v, original, cfg)
    rt = load_runtime(v, art.path, cfg)
    try:
        assert str(rt.info["device"]).startswith("cuda") and rt.info["kernel"] != "TorchAtenLinear"
        assert len(rt.generate([1, 2, 3, 4], 8, []).ids) == 8
    finally:
        rt.close()


@pytest.mark.gpu
def test_the_bandwidth_figure_is_measured_on_the_device(tmp_path, tiny_llama):
    from pipeline.instruments.bandwidth import run_bandwidth

    bw = run_bandwidth(_cfg(tmp_path, tiny_llama), "cuda")
    assert bw["bytes_per_s"] > 1e11 and "device-to-device" in bw["method"]
