"""Memory arithmetic beside the memory figures: KV-cache bytes per token, how many sequences fit a budget (the
capacity plan), and the roofline (bytes read per decoded token against the measured bandwidth)."""

from __future__ import annotations




def kv_elements_per_layer_token(facts: dict, latent: bool = False) -> float:
    """KV-cache elements one attention layer keeps per token: 2 (K and V) x kv_heads x head_dim; with latent
    attention (DeepSeek V2/V3) a runtime with ``latent_kv_cache`` (llama.cpp, transformers 5) keeps the compressed
    latent and the rope key (kv_lora_rank + qk_rope_head_dim), one without it the full per-head keys and values."""
    mla = (facts.get("kv_layout") or {}).get("mla")
    if mla:
        if latent:
            return mla["kv_lora_rank"] + mla["qk_rope_head_dim"]
        return facts["attention_heads"] * (mla["qk_nope_head_dim"] + mla["qk_rope_head_dim"] + mla["v_head_dim"])
    return 2 * facts["kv_heads"] * facts["head_dim"]


def kv_bytes_per_token_formula(facts: dict, element_bytes: float, context: int | None = None,
                               latent: bool = False, windows: bool = True) -> float:
    """KV-cache bytes per token of a sequence of ``context`` tokens, from the architecture: every full-attention
    layer keeps each token, a sliding-window layer at most its window (so per token it costs window / context
    beyond the window; None: counted in full, the bound at a short context), a linear-attention or state-space
    layer nothing per token. Without a recorded layout (facts from before it): every layer full. ``windows=False``:
    the runtime allocates its sliding-window layers' caches in full (llama.cpp's ``swa_full``)."""
    layout = facts.get("kv_layout") or {}
    kinds = layout.get("layer_kinds") or {"full": facts["layers"], "window": 0, "none": 0}
    window = layout.get("window_tokens")
    share = min(1.0, window / context) if (window and context and windows) else 1.0
    layers = kinds["full"] + kinds["window"] * share
    return layers * kv_elements_per_layer_token(facts, latent) * element_bytes


def sequences_that_fit(budget_bytes: float, headroom: float, weights_bytes: float, kv_bytes_per_token: float,
                       context_tokens: int, overhead_bytes: float = 0.0) -> int:
    """Concurrent sequences of ``context_tokens`` that fit a budget:
    floor((budget x (1 - headroom) - weights - overhead) / (KV/token x context)), never below zero."""
    free = budget_bytes * (1 - headroom) - weights_bytes - overhead_bytes
    return max(0, int(free // (kv_bytes_per_token * context_tokens)))


def _allocated(kv: dict) -> bool:
    """The report is an allocation for a context (llama.cpp's log of its KV buffer), not a live cache."""
    return bool(kv.get("allocated_bytes") and kv.get("allocated_cells"))


def kv_reported_per_token(kv: dict | None) -> float | None:
    """KV bytes per token as the runtime reports them: llama.cpp's own log of its KV buffer (bytes / cells),
    else the bytes the runtime holds for the live sequence divided by its tokens."""
    if not kv:
        return None
    if _allocated(kv):
        return kv["allocated_bytes"] / kv["allocated_cells"]
    return kv["bytes"] / kv["tokens"] if kv.get("tokens") else None


def kv_live_tokens(kv: dict | None) -> int | None:
    """The tokens a live-cache report holds (the context its bytes per token are for); None for an allocation
    (its context is the runtime's n_ctx) or no report."""
    return kv.get("tokens") if kv and not _allocated(kv) else None


def runtime_overhead_bytes(v: dict) -> float | None:
    """The runtime's own memory: the probe's peak (the device's where the variant ran on a GPU, else the host's
    RSS) less the weights and the KV cache the probe held, never below zero; None where a figure is missing."""
    mem, speed = v.get("memory") or {}, v.get("speed") or {}
    device = v.get("device_memory") or {}
    peak_mb = device["peak_mb"] if device.get("peak_mb") is not None else mem.get("peak_rss_mb")
    if peak_mb is None or mem.get("artifact_bytes") is None or mem.get("kv_bytes_per_token") is None:
        return None
    probe_kv = mem["kv_bytes_per_token"] * ((speed.get("prompt_tokens") or 0) + (speed.get("decode_tokens") or 0))
    return max(0.0, peak_mb * 2**20 - float(mem["artifact_bytes"]) - probe_kv)


def capacity_plan(v: dict, facts: dict, cap, latent: bool = False) -> dict:
    """Concurrent sequences of cap.context_tokens that fit each budget, for this model and (with params_b) for
    a published model of that size: floor((budget x (1 - headroom) - weights - overhead) / (KV/token x context)).

    weights: the artifact's bytes; overhead: the probe's peak memory minus weights and the KV it held (the
    runtime's own memory: libraries, buffers, activations, the CUDA context), never below zero. The peak is the
    device's where the variant ran on a GPU (``device_memory``: NVML / torch), else the host's RSS; on a GPU the
    device's own memory is planned for too. KV per token: the formula with the variant's cache type. For
    params_b: weights scale by the artifact's bytes per parameter, KV by the given geometry."""
    mem = v["memory"]
    weights = float(mem["artifact_bytes"])
    kv_tok = mem["kv_bytes_per_token"]
    device = v.get("device_memory") or {}
    on_device = device.get("peak_mb") is not None
    overhead = runtime_overhead_bytes(v) or 0.0
    windows = not (v.get("runtime_info") or {}).get("swa_full")
    element = kv_tok / kv_bytes_per_token_formula(facts, 1.0, cap.context_tokens, latent, windows)

    def fits(budget_gb: float, w: float, per_tok: float) -> int:
        return sequences_that_fit(budget_gb * 1e9, cap.headroom, w, per_tok, cap.context_tokens, overhead)

    budgets = list(cap.memory_budget_gb)
    own = (device.get("device_total_mb") or 0) * 2**20 / 1e9 if on_device else 0
    if own and round(own, 1) not in [round(float(b), 1) for b in budgets]:
        budgets.append(round(own, 1))                 # the device this ran on
    plan = {"context_tokens": cap.context_tokens, "headroom": cap.headroom, "weights_bytes": weights,
            "overhead_bytes": overhead, "kv_bytes_per_token": kv_tok,
            "memory_basis": f"device ({device.get('source')})" if on_device else "host RSS",
            "device_budget_gb": round(own, 1) if own else None,
            "max_sequences": {str(b): fits(b, weights, kv_tok) for b in budgets}}
    if cap.params_b and facts.get("params"):
        w_big = weights / facts["params"] * cap.params_b * 1e9
        kv_big = 2 * cap.layers * cap.kv_heads * cap.head_dim * element
        plan["scaled"] = {"params_b": cap.params_b, "layers": cap.layers, "kv_heads": cap.kv_heads,
                          "head_dim": cap.head_dim, "weights_bytes": w_big, "kv_bytes_per_token": kv_big,
                          "max_sequences": {str(b): fits(b, w_big, kv_big) for b in budgets}}
    return plan


def roofline(v: dict, bandwidth: dict | None) -> dict | None:
    """Bytes read per decoded token (every weight once + the KV cache at the probe's mean context) and the share
    of the measured memory bandwidth that decode achieved: decode tok/s x bytes/token / bandwidth."""
    sp, mem = v["speed"], v["memory"]
    if not bandwidth or not sp.get("decode_tokens_per_s"):
        return None
    context = (sp.get("prompt_tokens") or 0) + (sp.get("decode_tokens") or 0) / 2
    per_token = mem["artifact_bytes"] + mem["kv_bytes_per_token"] * context
    achieved = sp["decode_tokens_per_s"] * per_token
    return {"bytes_per_token": per_token, "context_tokens": context, "achieved_bytes_per_s": achieved,
            "bandwidth_bytes_per_s": bandwidth["bytes_per_s"], "share": achieved / bandwidth["bytes_per_s"],
            "ceiling_tokens_per_s": bandwidth["bytes_per_s"] / per_token}
