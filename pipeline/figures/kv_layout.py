"""How a model's KV cache grows with the context, from its transformers config (no weight read)."""

from __future__ import annotations

# what each layer type keeps per token: every token (full), at most a window of them (sliding, chunked), or a
# constant state that does not grow with the context (linear attention, Mamba, convolution)
FULL_LAYERS = ("full_attention", "attention", "hybrid", "global_attention")
WINDOW_LAYERS = ("sliding_attention", "chunked_attention", "local_attention")


def kv_layout(text_cfg) -> dict:
    """How the model's KV cache grows with the context, from its config: per layer kind the count (full, window,
    none), the window in tokens, and the latent-attention geometry (DeepSeek V2/V3) where it has one."""
    layers = text_cfg.num_hidden_layers
    types = list(getattr(text_cfg, "layer_types", None) or [])
    window = getattr(text_cfg, "sliding_window", None) or getattr(text_cfg, "attention_chunk_size", None)
    if getattr(text_cfg, "use_sliding_window", None) is False and not types:
        window = None
    if types and len(types) == layers:
        kinds = {"full": sum(t in FULL_LAYERS for t in types), "window": sum(t in WINDOW_LAYERS for t in types)}
        kinds["none"] = layers - kinds["full"] - kinds["window"]
        if not window:      # a window layer without a window size keeps every token
            kinds = {"full": kinds["full"] + kinds["window"], "window": 0, "none": kinds["none"]}
    else:
        kinds = {"full": 0, "window": layers, "none": 0} if window else {"full": layers, "window": 0, "none": 0}
    mla = None
    if getattr(text_cfg, "kv_lora_rank", None):
        mla = {k: getattr(text_cfg, k, None) for k in ("kv_lora_rank", "qk_rope_head_dim", "qk_nope_head_dim",
                                                         "v_head_dim")}
    return {"layer_kinds": kinds, "window_tokens": int(window) if window and kinds["window"] else None, "mla": mla}
