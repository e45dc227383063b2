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

from pipeline.infra.errors import ConfigError
from pipeline.suites.records import Conversation
from pipeline.runtimes.base import Runtime

log = logging.getLogger(__name__)

# Used only when the user allows it for a tokenizer without a chat template (model.allow_plain_template).
PLAIN_TEMPLATE = (
    "{% for m in messages %}{{ m['role'] | capitalize }}: {{ m['content'] }}\n\n{% endfor %}"
    "{% if add_generation_prompt %}Assistant: {% endif %}"
)
# A system text no template would write on its own, to see whether the template keeps a system turn.
SYSTEM_PROBE = "qd-system-probe-7f3a"


def plain_chat_error(tok) -> Exception | None:
    """What the chat template raises on one plain user message (a tool-use template that needs tools), or None."""
    try:
        tok.apply_chat_template([{"role": "user", "content": "Hello."}], add_generation_prompt=True, tokenize=False)
    except Exception as exc:     # noqa: BLE001  (jinja2's errors, or a template that needs other inputs)
        return exc
    return None


def system_role_support(tok) -> str:
    """How the tokenizer's chat template treats a system message: "native" (rendered), "rejected" (the template
    raises: Gemma 2) or "dropped" (rendered without it: Phi-3's template writes only user and assistant turns);
    "unusable" when it cannot render one plain user message either (a tool-use template that needs tools)."""
    if plain_chat_error(tok) is not None:       # not a system-role question
        return "unusable"
    messages = [{"role": "system", "content": SYSTEM_PROBE}, {"role": "user", "content": "Hello."}]
    try:
        text = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    except Exception:       # noqa: BLE001  (jinja2's TemplateError from raise_exception, or any template failure)
        return "rejected"
    return "native" if SYSTEM_PROBE in text else "dropped"


def fold_system(messages: list[dict]) -> list[dict]:
    """The system message folded into the first user turn (system text, a blank line, the user text), as model
    cards of templates without a system role advise; other messages unchanged."""
    if not messages or messages[0].get("role") != "system":
        return messages
    system, rest = messages[0]["content"], [dict(m) for m in messages[1:]]
    for m in rest:
        if m.get("role") == "user":
            m["content"] = f"{system}\n\n{m['content']}"
            return rest
    return [{"role": "user", "content": system}] + rest


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
        # a template that rejects or drops the system role gets the system text in the first user turn, so the
        # model still sees its instructions (the report says so, from the prepare facts)
        error = plain_chat_error(self.tok)
        if error is not None:
            raise ConfigError(f"the chat template of {checkpoint} cannot render a plain conversation (one user "
                              f"message, no tools): {type(error).__name__}: {error}. quantdrift renders system, user "
                              "and assistant turns; use the model's chat template for plain chat (a tool-use "
                              "template needs tools)")
        self.system_role = system_role_support(self.tok)
        if self.system_role != "native":
            log.info("the chat template of %s %s a system message: the system prompt is folded into the first "
                     "user turn", checkpoint, "rejects" if self.system_role == "rejected" else "drops")

    def render(self, messages: list[dict]) -> str:
        if self.system_role != "native":
            messages = fold_system(messages)
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
                              "next prompt: reasoning templates strip the thinking of earlier replies, some move the "
                              "system message to the last user turn), so one exact token stream per conversation "
                              "cannot be built for this model's multi-turn conversations; measure it on single-turn "
                              "suites (run.suites=[long_output])")
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
    prompt_tokens: int
    prefill_tokens: int
    ttft_s: float
    decode_tokens_per_s: float | None


class _ConversationState:
    """One conversation advancing turn by turn. The measurement path (``served`` None): one token stream,
    replies carried as their exact ids. The deployment path (``served``: the runtime): each turn's chat rendered
    to text and tokenized by that runtime's own tokenizer."""

    def __init__(self, conv: Conversation, renderer: ChatRenderer, max_context: int | None,
                 served: Runtime | None = None):
        self.conv, self.renderer, self.max_context, self.served = conv, renderer, max_context, served
        self.messages = base_messages(conv)
        self.ids: list[int] = []
        self.turns: list[TurnResult] = []
        self.started = time.perf_counter()

    @property
    def done(self) -> bool:
        return len(self.turns) == len(self.conv.turns)

    def next_request(self) -> tuple[list[int], int]:
        i = len(self.turns)
        turn = self.conv.turns[i]
        if i > 0:
            self.messages.append({"role": "assistant", "content": self.turns[-1].text})
        self.messages.append({"role": "user", "content": turn.user})
        if self.served is not None:
            self.ids = self.served.tokenize_served(self.renderer.render(self.messages))
        elif i == 0:
            self.ids = self.renderer.first_prompt(self.messages)
        else:
            prev = self.turns[-1]
            self.ids = self.renderer.next_prompt(self.messages[:-2], self.ids[: prev.start],
                                                 self.ids[prev.start: prev.end], prev.text, turn.user)
        budget = turn.max_new_tokens or 512
        if self.max_context and len(self.ids) + budget > self.max_context:
            raise ConfigError(f"conversation {self.conv.suite}/{self.conv.id} turn {i + 1}: {len(self.ids)} prompt "
                              f"tokens + {budget} reply tokens exceed the model's context of {self.max_context} tokens")
        return self.ids, budget

    def finish_turn(self, gen, text: str) -> None:
        decode_s = sum(gen.decode_times_s)
        self.turns.append(TurnResult(
            start=len(self.ids), end=len(self.ids) + len(gen.ids), text=text, stop=gen.stop,
            prompt_tokens=gen.prompt_tokens, prefill_tokens=gen.prefill_tokens, ttft_s=gen.ttft_s,
            decode_tokens_per_s=(len(gen.decode_times_s) / decode_s) if decode_s > 0 else None,
        ))
        self.ids = self.ids + gen.ids

    def result(self) -> dict:
        return {"id": self.conv.id, "suite": self.conv.suite, "ids": self.ids,
                "turns": [t.__dict__ for t in self.turns], "wall_s": time.perf_counter() - self.started}


def run_conversations(runtime: Runtime, renderer: ChatRenderer, convs: list[Conversation], stop_ids: list[int],
                      max_context: int | None = None, width: int = 4, on_done=None) -> list[dict]:
    """Free-running through several conversations at once on a batched runtime: up to ``width`` conversations
    occupy a slot each; every round, each occupied slot's next turn is generated in one batched call
    (``Runtime.generate_many``), each conversation keeping its own history and its own KV cells; a finished
    conversation frees its slot for the next. ``on_done(result)`` is called as each one finishes (a journal
    writes it, so an interrupted run resumes). Results in the order of ``convs``; the same tokens as
    ``run_conversation`` up to the last bits of batched float arithmetic."""
    queue = list(convs)
    slots: list[_ConversationState | None] = [None] * max(1, width)
    results: dict[str, dict] = {}
    while queue or any(slots):
        for k in range(len(slots)):
            if slots[k] is None and queue:
                slots[k] = _ConversationState(queue.pop(0), renderer, max_context)
        live = [k for k, st in enumerate(slots) if st is not None]
        requests = [(k, *slots[k].next_request()) for k in live]
        gens = runtime.generate_many(requests, stop_ids, slots=len(slots))
        for k, gen in zip(live, gens):
            st = slots[k]
            st.finish_turn(gen, renderer.decode(gen.ids))
            if st.done:
                results[st.conv.id] = st.result()
                if on_done:
                    on_done(results[st.conv.id])
                slots[k] = None
    return [results[c.id] for c in convs]


def free_run(runtime: Runtime, renderer: ChatRenderer, convs: list[Conversation], stop_ids: list[int],
             max_context: int | None, width: int, on_done, desc: str) -> None:
    """Every conversation of ``convs`` free-running, each result handed to ``on_done`` as it finishes: ``width``
    at once on a runtime that batches sequences (``Runtime.batched``), else one after another."""
    from tqdm import tqdm

    bar = tqdm(total=len(convs), desc=desc, unit="conv")
    try:
        if width > 1 and runtime.batched and len(convs) > 1:
            def done(result: dict) -> None:
                on_done(result)
                bar.update(1)

            run_conversations(runtime, renderer, convs, stop_ids, max_context, width, on_done=done)
        else:
            for conv in convs:
                on_done(run_conversation(runtime, renderer, conv, stop_ids, max_context))
                bar.update(1)
    finally:
        bar.close()


def run_conversation(runtime: Runtime, renderer: ChatRenderer, conv: Conversation, stop_ids: list[int],
                     max_context: int | None = None, served: bool = False) -> dict:
    """Greedy free-running through every turn; the model's own replies are carried into later turns.

    ``served=False`` (the measurement path): one token stream built from the original's tokenizer, replies
    carried as their exact ids, so every runtime sees the same ids. ``served=True`` (the deployment path): each
    turn's conversation is rendered to text and tokenized by the runtime's own tokenizer, and replies are
    detokenized by it, as a server that receives chat messages does (``Runtime.tokenize_served``)."""
    runtime.reset()
    state = _ConversationState(conv, renderer, max_context, runtime if served else None)
    while not state.done:
        ids, budget = state.next_request()
        gen = runtime.generate(ids, budget, stop_ids)
        state.finish_turn(gen, runtime.detokenize_served(gen.ids) if served else renderer.decode(gen.ids))
    return state.result()
