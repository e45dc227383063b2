"""`scripts/gpu-check`'s verdict: from the summary of a smoke run with runtime.device=cuda, did every CUDA path run
on the GPU? One table (kernel, offloaded layers, decode and prefill tok/s with their intervals over the interleaved
trials, device and host peaks, drift against the original) and the F16 GGUF parity KLD on CUDA; exit status 1 when
any listed variant did not run on the GPU. ``--partial`` judges only the variants the summary holds (the table
written after each variant while the run goes on). A leaf module (json and the summary only), so its logic is tested
on any machine."""

from __future__ import annotations

import json
import sys
from pathlib import Path

# GPTQModel's CPU kernel classes: on CUDA tensors they still run (dequantizing every forward in torch), so a name
# without "cpu" in it must not pass for a GPU kernel.
CPU_KERNELS = ("TorchAtenLinear", "TorchAtenAwqLinear", "TorchFusedLinear", "TorchFusedAwqLinear")
VARIANTS = ("original", "gguf_f16", "gguf_q8_0", "gguf_q4_k_m", "gptq_w4", "awq_w4", "original+kv_int8",
            "gguf_q8_0+kv_q8_0")


def problems(name: str, v: dict | None) -> list[str]:
    """Why ``name`` did not demonstrably run on the GPU (empty: it did)."""
    if not v:
        return ["not in the summary"]
    if v.get("status") != "ok":
        return [f"{v.get('status')}: {v.get('reason')}"]
    info = v.get("runtime_info") or {}
    out = []
    if not str(info.get("device", "")).startswith("cuda"):
        out.append(f"ran on {info.get('device')!r}, not cuda")
    kernel = str(info.get("kernel") or "")
    if "cpu" in kernel.lower() or any(k in kernel for k in CPU_KERNELS):
        out.append(f"kernel {kernel!r} is a CPU one")
    if info.get("torch_in_process"):        # llama.cpp's CUDA backend beside torch's (pipeline.runtimes.worker)
        out.append("llama.cpp loaded in a process that had imported torch")
    if "offloaded_layers" in info:          # a runtime that offloads layer by layer (llama.cpp) says how many
        layers = info["offloaded_layers"]
        if not layers or layers.split("/")[0] != layers.split("/")[1]:
            out.append(f"offloaded {layers or 'no'} layers (expected all)")
    peak = (v.get("device_memory") or {}).get("peak_mb")
    if not peak or peak <= 0:
        out.append("no device memory measured")
    return out


def _num(x, spec: str) -> str:
    return "–" if x is None else format(x, spec)


def _with_interval(v: dict, key: str, value, spec: str) -> str:
    """``value`` with its interval from the summary (``intervals[key]``: low-high) where there is one."""
    iv = (v.get("intervals") or {}).get(key) or {}
    if value is None:
        return "–"
    if iv.get("low") is None or iv.get("high") is None:
        return format(value, spec)
    return f"{format(value, spec)} [{format(iv['low'], spec)}, {format(iv['high'], spec)}]"


def check(summary: dict, variants: tuple[str, ...] = VARIANTS, partial: bool = False) -> tuple[str, bool]:
    """(the table as Markdown, whether every variant ran on the GPU and the parity holds). ``partial``: only the
    variants the summary holds, and no verdict on the speed trials or the parity not yet measured."""
    rows = ["| variant | status | device | kernel | offloaded | decode tok/s [95 %] | prefill tok/s [95 %] | trials "
            "| device peak MB | host peak MB | KLD vs original [95 %] | verdict |",
            "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    ok = True
    held = summary.get("variants", {})
    for name in [n for n in variants if n in held] if partial else variants:
        v = held.get(name)
        why = problems(name, v)
        if partial:        # speed and its memory readings come with the speed trials, after every variant
            why = [w for w in why if w != "no device memory measured"]
        ok &= not why
        v = v or {}
        info = v.get("runtime_info") or {}
        speed, mem = v.get("speed") or {}, v.get("memory") or {}
        peak = (v.get("device_memory") or {}).get("peak_mb")
        kld = (v.get("drift") or {}).get("kld_mean")
        rows.append(f"| {name} | {v.get('status', 'missing')} | {info.get('device', '–')} | "
                    f"{info.get('kernel', '–')} | {info.get('offloaded_layers') or '–'} | "
                    f"{_with_interval(v, 'decode_tokens_per_s', speed.get('decode_tokens_per_s'), '.1f')} | "
                    f"{_with_interval(v, 'prefill_tokens_per_s', speed.get('prefill_tokens_per_s'), '.0f')} | "
                    f"{_num(speed.get('trials'), 'd')} | {_num(peak, '.0f')} | {_num(mem.get('peak_rss_mb'), '.0f')} | "
                    f"{'–' if name == 'original' else _with_interval(v, 'kld_mean', kld, '.2e')} | "
                    f"{'on the GPU' if not why else '; '.join(why)} |")
    parity = (summary.get("reference") or {}).get("parity") or {}
    kld = parity.get("f16_kld_mean")
    parity_ok = bool(parity.get("ok")) and kld is not None
    if partial and not parity:
        return "\n".join(rows), ok
    ok &= parity_ok
    rows.append("")
    rows.append(f"F16 GGUF parity on CUDA: mean KLD {kld if kld is None else format(kld, '.2e')} "
                f"(max {parity.get('f16_kld_max')}, limit {parity.get('max_kld')}), top-1 agreement "
                f"{parity.get('f16_top1_agreement')}: {'holds' if parity_ok else 'FAILS'}")
    return "\n".join(rows), ok


def main(argv: list[str]) -> int:
    partial = "--partial" in argv
    argv = [a for a in argv if a != "--partial"]
    variants = VARIANTS
    if "--variants" in argv[:-1]:
        i = argv.index("--variants")
        variants = tuple(v for v in argv[i + 1].split(",") if v)
        argv = argv[:i] + argv[i + 2:]
    if len(argv) != 1 or not variants:
        print("usage: python -m pipeline.decide.gpu_verdict [--partial] [--variants A,B,...] "
              "RESULTS_DIR_OR_SUMMARY_JSON", file=sys.stderr)
        return 2
    path = Path(argv[0])
    path = path / "summary.json" if path.is_dir() else path
    if not path.is_file():
        print(f"gpu-check: {path} does not exist (the smoke run wrote no summary)", file=sys.stderr)
        return 2
    table, ok = check(json.loads(path.read_text()), variants, partial=partial)
    print(table)
    if partial:
        print("gpu-check: so far every finished variant ran on the GPU" if ok else
              "gpu-check: so far FAILED (see the verdict column)")
        return 0 if ok else 1
    print("gpu-check: every CUDA path ran on the GPU" if ok else "gpu-check: FAILED (see the verdict column)")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
