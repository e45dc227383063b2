"""Small random models of the families users bring (Llama 3, Mistral, Qwen 2.5/3, Phi-3, Gemma 2/3, a mixture of
experts, DeepSeek V2), each built from its transformers config class with a real tokenizer (llama.cpp's vocab-only
GGUF files) and its published chat template (llama.cpp's models/templates/, fetched by `make chat-templates`), so the whole pipeline can be
proved on every family offline (`make families`).

The weights are random: the figures say whether each variant's path works on the architecture (conversion, K-quant
shapes, sliding windows, soft-capping, fused projections, experts, latent attention) and how the KV formula meets
the runtime's own report, never how a real model of the family quantizes.

Only the standard library is imported at module level: torch, transformers, gguf and sentencepiece are imported
inside the functions that build."""

from __future__ import annotations

import json
import shutil
from dataclasses import dataclass, field
from pathlib import Path

from pipeline.infra.errors import ConfigError
from pipeline.infra.make_paths import vocab_dir


# Sizes shared by every family: hidden 256 is a multiple of 256, so K-quants keep their own types instead of
# falling back; two layers keep one family's whole run to minutes on two cores.
HIDDEN = 256
BASE = dict(hidden_size=HIDDEN, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=4096)


# DeepSeek LLM's pre-tokenizer splits, as llama.cpp's src/llama-vocab.cpp (LLAMA_VOCAB_PRE_TYPE_DEEPSEEK_LLM) and the
# model's own tokenizer.json have them: transformers' GGUF path does not rebuild this pre-tokenizer
DEEPSEEK_LLM_SPLITS = (
    '[\r\n]',
    '\\s?[A-Za-zµÀ-ÖØ-öø-ƺƼ-ƿǄ-ʓʕ-ʯͰ-ͳͶͷͻ-ͽͿΆΈ-ΊΌΎ-ΡΣ-ϵϷ-ҁҊ-ԯԱ-ՖႠ-ჅᎠ-Ᏽᏸ-ᏽᲐ-ᲺᲽ-Ჿᴀ-ᴫᵫ-ᵷᵹ-ᶚḀ-ἕἘ-Ἕἠ-ὅὈ-Ὅὐ-ὗὙὛὝὟ-ώᾀ-ᾴᾶ-ᾼιῂ-ῄῆ-ῌῐ-ΐῖ-Ίῠ-Ῥῲ-ῴῶ-ῼℂℇℊ-ℓℕℙ-ℝℤΩℨK-ℭℯ-ℴℹℼ-ℿⅅ-ⅉⅎↃↄⰀ-ⱻⱾ-ⳤⳫ-ⳮⳲⳳꙀ-ꙭꚀ-ꚛꜢ-ꝯꝱ-ꞇꞋ-ꞎꭰ-ꮿﬀ-ﬆﬓ-ﬗＡ-Ｚａ-ｚ𐐀-𐑏𐒰-𐓓𐓘-𐓻𐲀-𐲲𐳀-𐳲𑢠-𑣟𞤀-𞥃]+',
    '\\s?[!-/:-~！-／：-～‘-‟\u3000-。]+',
    '\\s+$',
    '[一-龥ࠀ-一가-\ud7ff]+',
    '\\p{N}+',
)


@dataclass(frozen=True)
class Family:
    """One family: its config class and fields, the vocab file its tokenizer comes from and its chat template.

    ``claims`` are config fields with the values that make the family what it is (checked by a unit test on the
    built config); ``features`` says the same in words for the table."""

    name: str
    title: str
    config_class: str
    model_class: str
    vocab: str                     # ggml-vocab-<vocab>.gguf
    template: str                  # llama.cpp's models/templates/<template>
    config: dict
    claims: dict
    features: str
    eos_token: str                 # the template's end-of-turn token, the generation stop
    tokenizer_note: str = ""
    # tokenizer.model for llama.cpp's converter, which reads SentencePiece vocabularies there: its special ids
    # (unk, bos, eos, pad; -1 for none), its piece count (the rest are added tokens in the real repositories) and
    # whether merges follow the file's token order rather than its scores (Gemma's)
    spm_ids: tuple[int, int, int, int] | None = None
    spm_vocab_size: int | None = None
    spm_order_by_position: bool = False
    tokenizer_json_fix: dict = field(default_factory=dict)   # BPE model fields the real tokenizer.json sets
    add_bos_token: bool | None = None    # where the real tokenizer adds BOS and the vocab file does not say so
    pre_tokenizer_splits: tuple[str, ...] = ()   # regexes of the real tokenizer.json's pre-tokenizer, in order
    overrides: tuple[str, ...] = ()      # Hydra overrides a user of this family would pass (named in the table)


FAMILIES: tuple[Family, ...] = (
    Family("llama3", "Llama 3.2", "LlamaConfig", "LlamaForCausalLM", "llama-bpe",
           "meta-llama-Llama-3.2-3B-Instruct.jinja",
           dict(BASE, max_position_embeddings=131072, vocab_size=128256, tie_word_embeddings=True, bos_token_id=128000, eos_token_id=128009,
                rope_parameters=dict(rope_type="llama3", rope_theta=500000.0, factor=32.0, low_freq_factor=1.0,
                                     high_freq_factor=4.0, original_max_position_embeddings=8192)),
           {"tie_word_embeddings": True, "vocab_size": 128256},
           "GQA 4/2, llama3 RoPE scaling (θ 500k), tied embeddings", "<|eot_id|>",
           "`ignore_merges` and BOS set as in Llama 3's tokenizer.json (llama.cpp's converter then identifies it as "
           "`llama-bpe`)", tokenizer_json_fix={"ignore_merges": True}, add_bos_token=True),
    Family("mistral", "Mistral 7B v0.1", "MistralConfig", "MistralForCausalLM", "llama-spm",
           "mistralai-Mistral-Nemo-Instruct-2407.jinja",
           dict(BASE, vocab_size=32000, sliding_window=64, tie_word_embeddings=False, bos_token_id=1,
                eos_token_id=2),
           {"sliding_window": 64},
           "sliding window 64 on every layer (prompts are longer), GQA 4/2", "</s>",
           "SentencePiece tokenizer.model rebuilt from the vocab file; Llama 2 tokenizer.json shape",
           spm_ids=(0, 1, 2, -1)),
    Family("qwen2", "Qwen 2.5", "Qwen2Config", "Qwen2ForCausalLM", "qwen2", "Qwen-Qwen2.5-7B-Instruct.jinja",
           dict(BASE, vocab_size=151936, tie_word_embeddings=True, bos_token_id=151643, eos_token_id=151645,
                rope_parameters=dict(rope_type="default", rope_theta=1000000.0)),
           {"tie_word_embeddings": True, "vocab_size": 151936},
           "q/k/v bias, GQA 4/2, tied embeddings", "<|im_end|>"),
    Family("qwen3", "Qwen 3", "Qwen3Config", "Qwen3ForCausalLM", "qwen2", "Qwen-Qwen3-0.6B.jinja",
           dict(BASE, vocab_size=151936, head_dim=64, tie_word_embeddings=True, bos_token_id=151643,
                eos_token_id=151645, rope_parameters=dict(rope_type="default", rope_theta=1000000.0)),
           {"head_dim": 64, "attention_bias": False},
           "q/k RMSNorm, no qkv bias, GQA 4/2", "<|im_end|>",
           "`qwen2` vocabulary (Qwen 3 keeps Qwen 2's pre-tokenizer; `<think>` is not one of its tokens, so the "
           "template's think markers tokenize as text)"),
    Family("phi3", "Phi-3.5", "Phi3Config", "Phi3ForCausalLM", "phi-3", "microsoft-Phi-3.5-mini-instruct.jinja",
           dict(BASE, vocab_size=32064, num_key_value_heads=4, tie_word_embeddings=False, bos_token_id=1,
                eos_token_id=32007, pad_token_id=32000),
           {"vocab_size": 32064},
           "fused qkv_proj and gate_up_proj, MHA 4/4", "<|end|>",
           "SentencePiece tokenizer.model (first 32000 pieces) rebuilt from the vocab file",
           spm_ids=(0, 1, 2, -1), spm_vocab_size=32000),
    Family("gemma2", "Gemma 2", "Gemma2Config", "Gemma2ForCausalLM", "gemma-4", "google-gemma-2-2b-it.jinja",
           dict(BASE, vocab_size=262144, head_dim=64, sliding_window=64, attn_logit_softcapping=50.0,
                final_logit_softcapping=30.0, query_pre_attn_scalar=64,
                layer_types=["sliding_attention", "full_attention"], bos_token_id=2, eos_token_id=1,
                pad_token_id=0),
           {"attn_logit_softcapping": 50.0, "final_logit_softcapping": 30.0, "sliding_window": 64,
            "layer_types": ["sliding_attention", "full_attention"]},
           "no system role (template raises), attention and final-logit soft-capping, local (64)/global layers "
           "interleaved", "<eos>",
           "`gemma-4` vocabulary (262,144 tokens; the Gemma 2 vocabulary is not among llama.cpp's vocab files, so "
           "`<start_of_turn>`/`<end_of_turn>` tokenize as text); SentencePiece tokenizer.model rebuilt from it, "
           "merges in the file's token order", spm_ids=(3, 2, 1, 0), spm_order_by_position=True),
    Family("gemma3", "Gemma 3", "Gemma3TextConfig", "Gemma3ForCausalLM", "gemma-4", "google-gemma-4-31B-it.jinja",
           dict(BASE, vocab_size=262144, head_dim=64, sliding_window=64, query_pre_attn_scalar=64,
                layer_types=["sliding_attention", "full_attention"], bos_token_id=2, eos_token_id=1,
                pad_token_id=0),
           {"sliding_window": 64, "layer_types": ["sliding_attention", "full_attention"]},
           "q/k RMSNorm, local (64)/global layers, separate local RoPE base", "<turn|>",
           "`gemma-4` vocabulary with Gemma 4's published template (its turn markers are tokens of that "
           "vocabulary; the Gemma 3 template's are not); no tokenizer.model, so llama.cpp's converter takes "
           "tokenizer.json with `model.gguf_pre_tokenizer=gemma4`",
           overrides=("model.gguf_pre_tokenizer=gemma4",)),
    Family("qwen2moe", "Qwen2-MoE", "Qwen2MoeConfig", "Qwen2MoeForCausalLM", "qwen2",
           "Qwen-Qwen2.5-7B-Instruct.jinja",
           dict(BASE, vocab_size=151936, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=256,
                shared_expert_intermediate_size=512, decoder_sparse_step=1, tie_word_embeddings=False,
                bos_token_id=151643, eos_token_id=151645),
           {"num_experts": 4, "num_experts_per_tok": 2},
           "mixture of experts: 4 routed (top-2) + a gated shared expert per layer, untied output (llama.cpp's "
           "qwen2moe requires output.weight: a tied model fails to load)", "<|im_end|>"),
    Family("deepseek2", "DeepSeek V2", "DeepseekV2Config", "DeepseekV2ForCausalLM",
           "deepseek-llm", "deepseek-ai-DeepSeek-V3.1.jinja",
           dict(BASE, vocab_size=102400, num_key_value_heads=4, kv_lora_rank=128, q_lora_rank=128,
                qk_rope_head_dim=32, qk_nope_head_dim=64, v_head_dim=64, n_routed_experts=4,
                num_experts_per_tok=2, n_shared_experts=1, moe_intermediate_size=256, first_k_dense_replace=1,
                n_group=1, topk_group=1, tie_word_embeddings=False, bos_token_id=100000, eos_token_id=100001),
           {"kv_lora_rank": 128, "q_lora_rank": 128, "n_routed_experts": 4},
           "multi-head latent attention (KV rank 128, query rank 128: llama.cpp takes a model without a query rank "
           "as V2-Lite only at 27 layers), 4 routed experts + 1 shared, first layer dense",
           "<｜end▁of▁sentence｜>",
           "`deepseek-llm` vocabulary with its pre-tokenizer splits restored; template: DeepSeek V3.1's (no "
           "DeepSeek V2 template in llama.cpp's collection)", pre_tokenizer_splits=DEEPSEEK_LLM_SPLITS),
)

def _scaled(base: Family, name: str, title: str, features: str, **config) -> Family:
    import dataclasses

    return dataclasses.replace(base, name=name, title=title, features=features, config=dict(base.config, **config),
                               claims={k: config[k] for k in ("hidden_size", "num_hidden_layers")})


# Larger random models of a published geometry, run alone (never in the CI matrix): they test the plan's scaling
# beyond the 135 M demo model (docs/plan.md, "A 1.24 B model planned from the 135 M demo run"). llama3-1b:
# Llama-3.2-1B's shapes (1.24 B parameters); qwen2-1.5b: Qwen2.5-1.5B's (1.54 B, a 152k vocabulary), a check of the
# plan on a model it was not fitted on; gemma3-270m: Gemma-3-270M's (268 M, a 262k vocabulary: its output rows
# cost more than its 18 layers).
SCALED: tuple[Family, ...] = (
    _scaled(FAMILIES[0], "llama3-1b", "Llama 3.2 1B geometry", "Llama-3.2-1B's shapes: 16 layers, hidden 2048, "
            "GQA 32/8, head 64, MLP 8192, tied embeddings", hidden_size=2048, intermediate_size=8192,
            num_hidden_layers=16, num_attention_heads=32, num_key_value_heads=8, head_dim=64),
    _scaled(FAMILIES[2], "qwen2-1.5b", "Qwen 2.5 1.5B geometry", "Qwen2.5-1.5B's shapes: 28 layers, hidden 1536, "
            "GQA 12/2, head 128, MLP 8960, q/k/v bias, tied embeddings", hidden_size=1536, intermediate_size=8960,
            num_hidden_layers=28, num_attention_heads=12, num_key_value_heads=2, head_dim=128),
    _scaled(FAMILIES[6], "gemma3-270m", "Gemma 3 270M geometry", "Gemma-3-270M's shapes: 18 layers, hidden 640, "
            "MQA 4/1, head 256, MLP 2048, five local (512) layers to one global, a 262,144-token vocabulary, tied "
            "embeddings (168 M of its 268 M parameters)", hidden_size=640, intermediate_size=2048,
            num_hidden_layers=18, num_attention_heads=4, num_key_value_heads=1, head_dim=256,
            query_pre_attn_scalar=256, sliding_window=512, max_position_embeddings=32768,
            layer_types=(["sliding_attention"] * 5 + ["full_attention"]) * 3),
)
BY_NAME = {f.name: f for f in FAMILIES + SCALED}


def family(name: str) -> Family:
    if name not in BY_NAME:
        raise ConfigError(f"family={name!r} is not valid: expected one of {sorted(BY_NAME)}")
    return BY_NAME[name]


def template_text(fam: Family) -> str:
    """The family's published chat template as llama.cpp's source (the version llama-cpp-python vendors) has it."""
    path = vocab_dir() / "templates" / fam.template
    if not path.is_file():
        raise ConfigError(f"{path} is absent: expected llama.cpp's published chat template (run `make chat-templates`)")
    return path.read_text(encoding="utf-8")


def build_config(fam: Family):
    """The family's transformers config (no weights)."""
    import transformers

    return getattr(transformers, fam.config_class)(**fam.config)


# ---- tokenizers ------------------------------------------------------------------------------------------------

def reference_cases(vocab_file: Path) -> list[tuple[str, list[int]]]:
    """llama.cpp's reference tokenizations of a vocab file (``.inp``/``.out``), split as its test-tokenizer-0
    splits them; duplicates collapse as in its map."""
    inp, out = Path(f"{vocab_file}.inp"), Path(f"{vocab_file}.out")
    if not (inp.is_file() and out.is_file()):
        raise ConfigError(f"{inp} / {out} are absent: expected llama.cpp's reference tokenizations "
                          "(run `make chat-templates`)")
    raw, sep, texts, pos = inp.read_text(encoding="utf-8"), "\n__ggml_vocab_test__\n", [], 0
    while pos < len(raw):
        nxt = raw.find(sep, pos)
        if nxt < 0:
            texts.append(raw[pos:])
            break
        texts.append(raw[pos:nxt])
        pos = nxt + len(sep)
    lines = out.read_text(encoding="utf-8").split("\n")
    cases = {t: [int(x) for x in line.split()] for t, line in zip(texts, lines)}
    return list(cases.items())


def tokenizer_agreement(tokenizer_dir: Path, vocab_file: Path) -> dict:
    """How many of the vocab file's reference tokenizations the saved tokenizer reproduces (no special tokens
    added, as llama.cpp's test tokenizes)."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(tokenizer_dir))
    cases = reference_cases(vocab_file)
    wrong = [text for text, ids in cases if list(tok.encode(text, add_special_tokens=False)) != ids]
    return {"cases": len(cases), "agree": len(cases) - len(wrong), "disagree": wrong[:5]}


def sentencepiece_agreement(model_file: Path, vocab_file: Path) -> dict:
    """The same reference check for a written tokenizer.model, through SentencePiece itself (what llama.cpp's
    converter reads)."""
    import sentencepiece

    sp = sentencepiece.SentencePieceProcessor(model_file=str(model_file))
    cases = reference_cases(vocab_file)
    wrong = [text for text, ids in cases if list(sp.encode(text)) != ids]
    return {"cases": len(cases), "agree": len(cases) - len(wrong), "disagree": wrong[:5]}


def _gguf_vocab(vocab_file: Path) -> tuple[list[str], list[float], list[int]]:
    from gguf import GGUFReader

    fields = GGUFReader(str(vocab_file)).fields
    tok = fields["tokenizer.ggml.tokens"]
    tokens = [bytes(tok.parts[i]).decode("utf-8") for i in tok.data]
    scores = ([float(fields["tokenizer.ggml.scores"].parts[i][0]) for i in fields["tokenizer.ggml.scores"].data]
              if "tokenizer.ggml.scores" in fields else [0.0] * len(tokens))
    tt = fields["tokenizer.ggml.token_type"]
    return tokens, scores, [int(tt.parts[i][0]) for i in tt.data]


def write_sentencepiece_model(vocab_file: Path, out: Path, ids: tuple[int, int, int, int],
                              pieces: int | None = None, order_by_position: bool = False) -> None:
    """A SentencePiece BPE ``tokenizer.model`` from a vocab file's tokens, scores and types (llama.cpp's token
    types number as SentencePiece's do). ``pieces`` keeps the first N; ``order_by_position`` scores each piece by
    its place in the file (Gemma's scores do not follow its merge order), respells whitespace-only pieces with
    '▁' as SentencePiece spells them, and adds no dummy prefix (Gemma's vocabulary adds none)."""
    from sentencepiece import sentencepiece_model_pb2 as pb

    tokens, scores, types = _gguf_vocab(vocab_file)
    n = pieces or len(tokens)
    m = pb.ModelProto()
    m.trainer_spec.model_type = pb.TrainerSpec.BPE
    m.trainer_spec.vocab_size = n
    m.trainer_spec.byte_fallback = True
    m.trainer_spec.unk_id, m.trainer_spec.bos_id, m.trainer_spec.eos_id, m.trainer_spec.pad_id = ids
    m.normalizer_spec.name = "identity"
    m.normalizer_spec.add_dummy_prefix = not order_by_position
    m.normalizer_spec.remove_extra_whitespaces = False
    m.normalizer_spec.escape_whitespaces = True
    for i, (piece, score, kind) in enumerate(zip(tokens[:n], scores[:n], types[:n])):
        p = m.pieces.add()
        if order_by_position:
            piece, score = ("\u2581" * len(piece) if " " in piece and not piece.strip() else piece), -float(i)
        p.piece, p.score, p.type = piece, score, kind
    out.write_bytes(m.SerializeToString())


def _llama2_shape(backend) -> None:
    """Llama 2 / Mistral tokenizer.json: the prefix space comes from the normalizer (Prepend '▁', spaces to '▁'),
    with no pre-tokenizer, so leading spaces tokenize as SentencePiece does."""
    from tokenizers import normalizers

    backend.normalizer = normalizers.Sequence([normalizers.Prepend("\u2581"), normalizers.Replace(" ", "\u2581")])
    backend.pre_tokenizer = None


def _align_tokens(data: dict, tokens: list[str], types: list[int]) -> dict:
    """tokenizer.json with exactly the vocab file's tokens: no added token past its count (transformers' GPT-2
    builder adds a default ``<|endoftext|>``), and every control token the file lists (type 3) added under its own
    id and spelling, as the real repositories' tokenizer.json files have them (the byte-level builder re-spells
    those that are not in the byte alphabet, so ``<｜begin▁of▁sentence｜>`` would otherwise be added anew)."""
    n = len(tokens)
    added = {a["id"]: a for a in data.get("added_tokens", []) if a["id"] < n}
    vocab = data["model"]["vocab"]
    by_id = {i: t for t, i in vocab.items()} if isinstance(vocab, dict) else {}
    for i, (text, kind) in enumerate(zip(tokens, types)):
        if kind != 3 or (i in added and added[i]["content"] == text):
            continue
        if by_id and by_id.get(i) != text:
            vocab.pop(by_id.get(i), None)
            vocab[text] = i
        added[i] = {"id": i, "content": text, "single_word": False, "lstrip": False, "rstrip": False,
                    "normalized": False, "special": True}
    data["added_tokens"] = [added[i] for i in sorted(added)]
    return data


def save_tokenizer(fam: Family, out: Path, cache_dir: Path | None = None) -> None:
    """The family's tokenizer, built by transformers from the vocab file, with its chat template and end-of-turn
    token, saved into ``out``; plus ``tokenizer.model`` for SentencePiece families."""
    from tokenizers import Tokenizer
    from transformers import PreTrainedTokenizerFast
    from transformers.integrations.gguf.gguf_tokenizer_mapping import convert_gguf_tokenizer, get_gguf_tokenizer

    vocab_file = vocab_dir(cache_dir) / f"ggml-vocab-{fam.vocab}.gguf"
    if not vocab_file.is_file():
        raise ConfigError(f"{vocab_file} is absent: expected llama.cpp's vocab file (run `make chat-templates`)")
    # transformers' own GGUF path (AutoTokenizer.from_pretrained(gguf_file=...)) also parses the file's model
    # config, which fails on vocab-only files of newer architectures (gemma4); the tokenizer part is the same
    arch, tok_dict, tok_cfg = get_gguf_tokenizer(str(vocab_file))
    backend, _ = convert_gguf_tokenizer(arch, tok_dict)
    if fam.vocab == "llama-spm":
        _llama2_shape(backend)
    if fam.pre_tokenizer_splits:
        from tokenizers import Regex, pre_tokenizers

        backend.pre_tokenizer = pre_tokenizers.Sequence(
            [pre_tokenizers.Split(Regex(r), behavior="isolated") for r in fam.pre_tokenizer_splits]
            + [pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tokens, _, types = _gguf_vocab(vocab_file)
    data = _align_tokens(json.loads(backend.to_str()), tokens, types)
    data["model"].update(fam.tokenizer_json_fix)
    backend = Tokenizer.from_str(json.dumps(data, ensure_ascii=False))
    vocab = backend.get_vocab()
    specials = {k: v for k, v in tok_cfg.items() if k.endswith("_token") and v in vocab}
    add_bos = fam.add_bos_token if fam.add_bos_token is not None else tok_cfg.get("add_bos_token", False)
    tok = PreTrainedTokenizerFast(tokenizer_object=backend, add_bos_token=add_bos, **specials)
    tok.chat_template = template_text(fam)
    tok.eos_token = fam.eos_token
    if len(tok) != len(tokens) or fam.eos_token not in vocab:
        raise ConfigError(f"family={fam.name!r}: the tokenizer built from {vocab_file.name} has {len(tok)} tokens "
                          f"and end-of-turn {fam.eos_token!r} {'in' if fam.eos_token in vocab else 'not in'} its "
                          f"vocabulary: expected the file's {len(tokens)} tokens and the token among them")
    tok.save_pretrained(str(out))
    if fam.spm_ids:
        write_sentencepiece_model(vocab_file, out / "tokenizer.model", fam.spm_ids, fam.spm_vocab_size,
                                  fam.spm_order_by_position)


# ---- models ----------------------------------------------------------------------------------------------------

def multi_turn_refusal(folder: Path) -> str | None:
    """The pipeline's own refusal of multi-turn conversations on this template, or None. The probe reply carries
    the surrounding whitespace a random model emits: a template that trims earlier replies (Llama 3, Gemma 2)
    rewrites such history too, and the pipeline then refuses the multi-turn suites mid-run."""
    from pipeline.suites.conversation import ChatRenderer

    renderer = ChatRenderer(folder)
    chat = [{"role": "system", "content": "You answer billing questions."},
            {"role": "user", "content": "Summarise invoice INV-2231."}]
    ids, reply = renderer.first_prompt(chat), " Invoice INV-2231 totals GBP 1,240.\n"
    try:
        renderer.next_prompt(chat, ids, renderer.encode(reply), reply, "And the due date?")
    except ConfigError as exc:
        return str(exc)
    return None


def build_family(fam: Family, out: Path, seed: int = 0, cache_dir: Path | None = None) -> dict:
    """Build the family's folder (fp32 safetensors, config, tokenizer, template) into ``out`` atomically and
    return its facts (also written to ``out/family.json``). An existing complete folder is kept."""
    facts_path = out / "family.json"
    if facts_path.is_file():
        facts = json.loads(facts_path.read_text())
        if facts.get("spec") == _spec_key(fam):
            return facts
    import torch
    import transformers

    tmp = out.with_name(out.name + ".partial")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    torch.manual_seed(seed)
    cfg = build_config(fam)
    model = getattr(transformers, fam.model_class)(cfg)
    # a larger-than-default init, so the distributions are peaked enough for drift to show: 0.08 at hidden 256,
    # scaled by 1/sqrt(hidden) beyond it so that a wider model's logits keep that scale (at 0.08, hidden 2048's
    # F16 conversion alone moved the KLD past the parity limit)
    std = 0.08 * min(1.0, (HIDDEN / int(cfg.hidden_size)) ** 0.5)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 2:
                p.normal_(0.0, std)
    model.save_pretrained(str(tmp), safe_serialization=True)
    save_tokenizer(fam, tmp, cache_dir)
    vocab_file = vocab_dir(cache_dir) / f"ggml-vocab-{fam.vocab}.gguf"
    facts = {"family": fam.name, "spec": _spec_key(fam), "architecture": fam.model_class,
             "params": sum(p.numel() for p in model.parameters()),
             "tokenizer": {"vocab": fam.vocab, **tokenizer_agreement(tmp, vocab_file)},
             "multi_turn_refusal": multi_turn_refusal(tmp)}
    if fam.spm_ids:
        facts["tokenizer_model"] = sentencepiece_agreement(tmp / "tokenizer.model", vocab_file)
    from pipeline.suites.conversation import ChatRenderer

    facts["system_role"] = ChatRenderer(tmp).system_role
    (tmp / "family.json").write_text(json.dumps(facts, indent=1, ensure_ascii=False))
    shutil.rmtree(out, ignore_errors=True)
    tmp.rename(out)
    return facts


def _spec_key(fam: Family) -> str:
    """What the folder's files depend on (not the words the table shows)."""
    import dataclasses
    import hashlib

    spec = {k: v for k, v in dataclasses.asdict(fam).items()
            if k not in ("title", "features", "claims", "tokenizer_note", "overrides")}
    text = json.dumps([spec, template_text(fam)], sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:16]
