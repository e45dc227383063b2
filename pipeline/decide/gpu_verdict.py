"""`scripts/gpu-check`'s verdict: from the summary of a smoke run with runtime.device=cuda, did every CUDA path run
on the GPU? One table (decode tok/s, device and host peaks, kernel, offloaded layers) and the F16 GGUF parity KLD
on CUDA; exit status 1 when any listed variant did not run on the GPU. A leaf module (json and the summary only),
so its logic is tested on any machine."""

from __future__ import annotations

import json
import sys
from pathlib import Path

# GPTQModel's CPU kernel classes: on CUDA tensors they still run (dequantizing every forward in torch), so a name
# without "cpu" in it must not pass for a GPU kernel.
CPU_KERNELS = ("TorchAtenLinear", "TorchAtenAwqLinear", "TorchFusedLinear", "TorchFusedAwqLinear")
VARIANTS = ("original", "gguf_f16", "gguf_q4_k_m", "gptq_w4", "awq_w4", "original+kv_int8", "gguf_q8_0+kv_q8_0")


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
    if "offloaded_layers" in info:          # a runtime that offloads layer by layer (llama.cpp) says how many
        layers = info["offloaded_layers"]
        if not layers or layers.split("/")[0] != layers.split("/")[1]:
            out.append(f"offloaded {layers or 'no'} layers (expected all)")
    peak = (v.get("device_memory") or {}).get("peak_mb")
    if not peak or peak <= 0:
        out.append("no device memory measured")
    return out


def check(summary: dict, variants: tuple[str, ...] = VARIANTS) -> tuple[str, bool]:
    """(the table as Markdown, whether every variant ran on the GPU and the parity holds)."""
    rows = ["| variant | status | device | kernel | offloaded | decode tok/s | device peak MB | host peak MB | verdict |",
            "|---|---|---|---|---|---|---|---|---|"]
    ok = True
    for name in variants:
        v = summary.get("variants", {}).get(name)
        why = problems(name, v)
        ok &= not why
        info = (v or {}).get("runtime_info") or {}
        speed, mem = (v or {}).get("speed") or {}, (v or {}).get("memory") or {}
        peak = ((v or {}).get("device_memory") or {}).get("peak_mb")

        def num(x, spec):
            return "–" if x is None else format(x, spec)

        rows.append(f"| {name} | {(v or {}).get('status', 'missing')} | {info.get('device', '–')} | "
                    f"{info.get('kernel', '–')} | {info.get('offloaded_layers') or '–'} | "
                    f"{num(speed.get('decode_tokens_per_s'), '.1f')} | {num(peak, '.0f')} | "
                    f"{num(mem.get('peak_rss_mb'), '.0f')} | {'on the GPU' if not why else '; '.join(why)} |")
    parity = (summary.get("reference") or {}).get("parity") or {}
    kld = parity.get("f16_kld_mean")
    parity_ok = bool(parity.get("ok")) and kld is not None
    ok &= parity_ok
    rows.append("")
    rows.append(f"F16 GGUF parity on CUDA: mean KLD {kld if kld is None else format(kld, '.2e')} "
                f"(max {parity.get('f16_kld_max')}, limit {parity.get('max_kld')}), top-1 agreement "
                f"{parity.get('f16_top1_agreement')}: {'holds' if parity_ok else 'FAILS'}")
    return "\n".join(rows), ok


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print("usage: python -m pipeline.decide.gpu_verdict RESULTS_DIR_OR_SUMMARY_JSON", file=sys.stderr)
        return 2
    path = Path(argv[0])
    path = path / "summary.json" if path.is_dir() else path
    if not path.is_file():
        print(f"gpu-check: {path} does not exist (the smoke run wrote no summary)", file=sys.stderr)
        return 2
    table, ok = check(json.loads(path.read_text()))
    print(table)
    print("gpu-check: every CUDA path ran on the GPU" if ok else "gpu-check: FAILED (see the verdict column)")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
