"""Multi-turn driving, written once for every runtime.

The chat template is rendered with the original's tokenizer and the token stream is built incrementally:
each turn's prompt = previous prompt + the reply's exact generated ids + the template's glue (end of turn,
next user message, generation prompt). The reference transcript is therefore a token stream that the
variants can score exactly, with no re-tokenisation of generated text.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from pathlib import Path

from pipeline.errors import ConfigError
from pipeline.prompts import Conversation, check_label, run_check
from pipeline.runtimes.base import Runtime

log = logging.getLogger(__name__)

# Used only when the user allows it for a tokenizer without a chat template (model.allow_plain_template).
PLAIN_TEMPLATE = (
    "{% for m in messages %}{{ m['role'] | capitalize }}: {{ m['content'] }}\n\n{% endfor %}"
    "{% if add_generation_prompt %}Assistant: {% endif %}"
)


class ChatRenderer:
    def __init__(self, checkpoint: Path, trust_remote_code: bool = False, allow_plain_template: bool = False):
        from transformers import AutoTokenizer

        self.tok = AutoTokenizer.from_pretrained(str(checkpoint), trust_remote_code=trust_remote_code)
        self.plain = False
        if not isinstance(self.tok.chat_template, str):
            if not allow_plain_template:
                raise ConfigError(f"the tokenizer of {checkpoint} has no chat template: conversations cannot be "
                                  "rendered as the model expects. Use an instruct/chat model, or accept a plain "
                                  "'User:/Assistant:' format with model.allow_plain_template=true")
            self.tok.chat_template = PLAIN_TEMPLATE
            self.plain = True

    def render(self, messages: list[dict]) -> str:
        return self.tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)

    def encode(self, text: str) -> list[int]:
        return list(self.tok(text, add_special_tokens=False)["input_ids"])

    def text_around(self, text: str, token_index: int, width: int = 24) -> str:
        """The characters of ``text`` around the start of its HF token ``token_index``."""
        spans = self.tok(text, add_special_tokens=False, return_offsets_mapping=True)["offset_mapping"]
        at = spans[token_index][0] if token_index < len(spans) else len(text)
        return text[max(0, at - width): at + width]

    def pre_tokenizer(self) -> str | None:
        """The HF tokenizer's pre-tokenizer as a short description, e.g. 'Sequence[Digits(individual_digits=True),
        ByteLevel(use_regex=True)]'; None for a tokenizer without a Rust backend."""
        import json

        backend = getattr(self.tok, "backend_tokenizer", None)
        return _describe_component(json.loads(backend.to_str()).get("pre_tokenizer")) if backend else None

    def decode(self, ids: list[int]) -> str:
        return self.tok.decode(ids, skip_special_tokens=False)

    def first_prompt(self, messages: list[dict]) -> list[int]:
        return self.encode(self.render(messages))

    def next_prompt(self, messages: list[dict], prompt_ids: list[int], reply_ids: list[int], reply_text: str,
                    user: str) -> list[int]:
        """Prompt for the next turn; ``messages`` ends with the previous user message."""
        prefix = self.render(messages) + reply_text
        full = self.render(messages + [{"role": "assistant", "content": reply_text}, {"role": "user", "content": user}])
        if not full.startswith(prefix):
            raise ConfigError("the chat template rewrites earlier turns (the rendered history is not a prefix of the "
                              "next prompt), so exact multi-turn token streams cannot be built for this model")
        return prompt_ids + reply_ids + self.encode(full[len(prefix):])


def _describe_component(node) -> str | None:
    if not isinstance(node, dict):
        return None
    kind = node.get("type", "?")
    if kind == "Sequence":
        parts = node.get("pretokenizers") or node.get("normalizers") or []
        return f"Sequence[{', '.join(_describe_component(p) or '?' for p in parts)}]"
    args = ", ".join(f"{k}={v!r}" for k, v in node.items() if k != "type" and not isinstance(v, (dict, list)))
    if isinstance(node.get("pattern"), dict):
        args = ", ".join(x for x in (args, f"pattern={next(iter(node['pattern'].values()))!r}") if x)
    return f"{kind}({args})"


def base_messages(conv: Conversation) -> list[dict]:
    return [{"role": "system", "content": conv.system}] if conv.system else []


@dataclass
class TurnResult:
    start: int              # reply token span [start, end) in the final token stream
    end: int
    text: str
    stop: str
    checks: list[bool]
    check_labels: list[str]
    prompt_tokens: int
    prefill_tokens: int
    ttft_s: float
    decode_tokens_per_s: float | None


def run_conversation(runtime: Runtime, renderer: ChatRenderer, conv: Conversation, stop_ids: list[int],
                     max_context: int | None = None, served: bool = False) -> dict:
    """Greedy free-running through every turn; the model's own replies are carried into later turns.

    ``served=False`` (the measurement path): one token stream built from the original's tokenizer, replies
    carried as their exact ids, so every runtime sees the same ids. ``served=True`` (the deployment path): each
    turn's conversation is rendered to text and tokenized by the runtime's own tokenizer, and replies are
    detokenized by it, as a server that receives chat messages does (``Runtime.tokenize_served``)."""
    messages = base_messages(conv)
    ids: list[int] = []
    turns: list[TurnResult] = []
    runtime.reset()
    started = time.perf_counter()
    for i, turn in enumerate(conv.turns):
        if i > 0:
            messages.append({"role": "assistant", "content": turns[-1].text})
        messages.append({"role": "user", "content": turn.user})
        if served:
            ids = runtime.tokenize_served(renderer.render(messages))
        elif i == 0:
            ids = renderer.first_prompt(messages)
        else:
            prev = turns[-1]
            ids = renderer.next_prompt(messages[:-2], ids[: prev.start], ids[prev.start: prev.end], prev.text,
                                       turn.user)
        budget = turn.max_new_tokens or 512
        if max_context and len(ids) + budget > max_context:
            raise ConfigError(f"conversation {conv.suite}/{conv.id} turn {i + 1}: {len(ids)} prompt tokens + "
                              f"{budget} reply tokens exceed the model's context of {max_context} tokens")
        gen = runtime.generate(ids, budget, stop_ids)
        text = runtime.detokenize_served(gen.ids) if served else renderer.decode(gen.ids)
        decode_s = sum(gen.decode_times_s)
        turns.append(TurnResult(
            start=len(ids), end=len(ids) + len(gen.ids), text=text, stop=gen.stop,
            checks=[run_check(c, text) for c in turn.checks],
            check_labels=[check_label(c, j) for j, c in enumerate(turn.checks)],
            prompt_tokens=gen.prompt_tokens, prefill_tokens=gen.prefill_tokens, ttft_s=gen.ttft_s,
            decode_tokens_per_s=(len(gen.decode_times_s) / decode_s) if decode_s > 0 else None,
        ))
        ids = ids + gen.ids
    return {
        "id": conv.id,
        "suite": conv.suite,
        "ids": ids,
        "turns": [t.__dict__ for t in turns],
        "wall_s": time.perf_counter() - started,
    }
