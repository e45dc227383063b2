"""lm-evaluation-harness's ``LM`` interface over a quantdrift runtime, so a benchmark runs on exactly a variant's
runtime (llama.cpp for GGUF files, transformers or GPTQModel's kernel for HF formats, the variant's KV-cache
settings included) and never on lm-eval's own HF wrapper, which would skip all of them.

Text in, text out, as lm-eval asks; underneath, the pipeline's token path: the original's HF tokenizer (the one
every runtime is fed by on the measurement path; llama.cpp's GGUF vocabulary gives the same ids), the runtime's
``generate`` for replies and its teacher-forced ``score`` for log-likelihoods.

- ``generate_until``: greedy only, through ``Runtime.generate`` (each token by the runtime's ``TokenChoice``: the
  run's repetition penalty applies when the runtime was loaded with one). Every request starts from a cold cache
  (``reset``), so a sample's reply does not depend on which samples ran before it. Stop strings (``until``) are
  honoured as lm-eval's HF model does: generation stops at the first token whose decoded reply contains one, and
  the reply is cut before it. To stop early without a hook inside the runtime's loop, the reply is generated in
  chunks: each chunk's prompt extends the previous call's tokens, which the runtimes continue from their cache,
  the same computation as one uninterrupted call (the test checks the equality). A repetition penalty over the
  reply alone (``repeat_scope=reply``) would restart its window at each chunk, so then one call of
  ``max_gen_toks`` is made and cut afterwards.
- ``loglikelihood``: lm-eval's own context/continuation split (``TemplateLM``), each pair scored in one
  teacher-forced pass (``Runtime.score``): the sum of the continuation's token log-probs and whether each of its
  tokens is the argmax.
- ``loglikelihood_rolling`` (perplexity tasks): as lm-eval's HF model computes it (``HFLM.loglikelihood_rolling``,
  lm-eval 0.4.13): the text's tokens cut into lm-eval's rolling windows (``get_rolling_token_windows`` with the
  prefix token first and ``max_length`` as the window, then ``make_disjoint_window``), each window scored by the
  same teacher-forced pass as ``loglikelihood``; the request's log-likelihood is the sum over its windows. A bench
  task still needs a right/wrong metric per sample (``pipeline.suites.lmeval.registry``), so perplexity tasks are
  not run as ``bench:TASK``; ``quantdrift corpus`` measures drift on a corpus.

lm-eval is imported at this module's top: import this module inside the function that runs a benchmark, never at
the top of a module the CLI loads.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any, Sequence

import numpy as np
from lm_eval.api.model import TemplateLM
from lm_eval.utils import get_rolling_token_windows, make_disjoint_window
from tqdm import tqdm

from pipeline.infra.errors import ConfigError

if TYPE_CHECKING:
    from pipeline.runtimes.base import Runtime

log = logging.getLogger(__name__)

DEFAULT_MAX_GEN_TOKS = 256          # lm-eval's default when a task sets none
CHUNK_TOKENS = 16                   # reply tokens per generate call between stop-string checks
# lm-eval's aliases for the reply budget, in its order of priority
_BUDGET_KEYS = ("max_gen_toks", "max_new_tokens", "max_tokens", "max_completion_tokens")
# sampling knobs that greedy decoding ignores once do_sample is False (as transformers' generate ignores them)
_IGNORED_WHEN_GREEDY = ("temperature", "top_p", "top_k", "min_p", "typical_p", "seed")


def greedy_request(gen_kwargs: dict | None, default_max_gen_toks: int = DEFAULT_MAX_GEN_TOKS
                   ) -> tuple[list[str], int]:
    """(stop strings, reply budget in tokens) of one ``generate_until`` request, refusing anything but greedy
    decoding: ``do_sample=True``, a temperature above 0 without ``do_sample=False``, beams, or any other key that
    would change the decoding (a ValueError naming it and what is allowed)."""
    kw = dict(gen_kwargs or {})
    until = kw.pop("until", None)
    until = [until] if isinstance(until, str) else list(until or [])
    if not all(isinstance(u, str) for u in until):
        raise ValueError(f"generate_until: until={until!r} must be a string or a list of strings")
    budgets = [kw.pop(k) for k in _BUDGET_KEYS if kw.get(k) is not None]
    for k in _BUDGET_KEYS:
        kw.pop(k, None)
    budget = int(budgets[0]) if budgets else default_max_gen_toks
    if budget < 1:
        raise ValueError(f"generate_until: max_gen_toks={budget} must be at least 1")
    do_sample = kw.pop("do_sample", None)
    temperature = kw.get("temperature")
    if do_sample or (do_sample is None and temperature is not None and float(temperature) > 0):
        raise ValueError(f"generate_until: do_sample={do_sample!r}, temperature={temperature!r} asks for sampling; "
                         "quantdrift's runtimes decode greedily only (set do_sample: false, or temperature: 0)")
    for k in _IGNORED_WHEN_GREEDY:
        kw.pop(k, None)
    if kw.get("num_beams", 1) != 1:
        raise ValueError(f"generate_until: num_beams={kw['num_beams']!r}: beam search is not offered, greedy only")
    kw.pop("num_beams", None)
    if kw:
        raise ValueError(f"generate_until: generation settings {sorted(kw)} are not supported: expected only "
                         f"until, {', '.join(_BUDGET_KEYS)}, do_sample=false and the sampling knobs greedy "
                         f"decoding ignores ({', '.join(_IGNORED_WHEN_GREEDY)})")
    return until, budget


def cut_at_stop(text: str, until: Sequence[str]) -> str:
    """``text`` cut before the stop strings, as lm-eval cuts a reply (each non-empty string in turn)."""
    for term in until:
        if term:
            text = text.split(term)[0]
    return text


class RuntimeLM(TemplateLM):
    """lm-eval's ``LM`` over one loaded ``Runtime``.

    ``tokenizer``: the original's HF tokenizer (``ChatRenderer.tok``), which gives the ids every runtime is fed;
    ``stop_ids``: the end-of-turn/end-of-text ids that end a reply (``original.facts["eos_token_ids"]``);
    ``max_length``: the most tokens a request may hold, prompt and reply (llama.cpp's ``n_ctx``; default the
    runtime's own ``n_ctx`` where it has one). A request that does not fit fails with the numbers: it is never
    truncated silently. ``log`` keeps one row per generated reply (prompt and reply tokens, why it stopped)."""

    def __init__(self, runtime: "Runtime", tokenizer: Any, stop_ids: Sequence[int], max_length: int | None = None,
                 chunk_tokens: int = CHUNK_TOKENS):
        super().__init__()
        self.runtime = runtime
        self.tokenizer = tokenizer
        self.stop_ids = [int(t) for t in stop_ids]
        if not self.stop_ids:
            raise ConfigError("RuntimeLM needs at least one stop id (the model's end-of-turn/end-of-text ids)")
        self.max_length = max_length if max_length is not None else getattr(runtime, "n_ctx", None)
        self.chunk_tokens = int(chunk_tokens)
        self.log: list[dict] = []

    @classmethod
    def for_variant(cls, cfg, artifact_path, tokenizer: Any, stop_ids: Sequence[int], n_ctx: int) -> "RuntimeLM":
        """``cfg.variant``'s runtime loaded on ``artifact_path`` as the evaluate stage loads it (its runtime options,
        KV-cache setting, threads, device and decoding rule from ``cfg``), wrapped for lm-eval."""
        from pipeline.runtimes import load_runtime

        return cls(load_runtime(cfg.variant, artifact_path, cfg, n_ctx=n_ctx), tokenizer, stop_ids, max_length=n_ctx)

    # ------------------------------------------------------------------ what the run records
    @property
    def chunked(self) -> bool:
        """Whether a reply may be generated in chunks (stopping early at a stop string) with the same tokens as one
        call: plain greedy, or a penalty whose window spans prompt and reply (a chunk's prompt holds the reply so
        far, so the window is the same)."""
        choice = self.runtime.choice
        return choice.greedy or choice.scope == "context"

    @property
    def info(self) -> dict:
        return {"runtime": dict(self.runtime.info), "decoding": self.runtime.choice.key() or "greedy",
                "stop_strings": "chunked" if self.chunked else "one call, cut after", "max_length": self.max_length}

    # ------------------------------------------------------------------ tokenization (TemplateLM)
    @property
    def eot_token_id(self) -> int:
        eos = getattr(self.tokenizer, "eos_token_id", None)
        return int(eos) if eos is not None else self.stop_ids[0]

    @property
    def prefix_token_id(self) -> int:
        """What an empty context is replaced with: BOS where the tokenizer has one, else end-of-text (lm-eval's
        HF model does the same)."""
        bos = getattr(self.tokenizer, "bos_token_id", None)
        return int(bos) if bos is not None else self.eot_token_id

    def tok_encode(self, string: str, add_special_tokens: bool | None = None, **kwargs) -> list[int]:
        """As lm-eval's HF model encodes (``HFLM.tok_encode``, lm-eval 0.4.13): the tokenizer's own special tokens
        unless told otherwise, so a BOS where its post-processor adds one (Llama 3, Mistral, Gemma; none for
        SmolLM2), and none when the string already starts with the BOS text."""
        kwargs = {} if add_special_tokens is None else {"add_special_tokens": bool(add_special_tokens)}
        if add_special_tokens is None and string.startswith(self.tokenizer.decode([self.prefix_token_id])):
            kwargs = {"add_special_tokens": False}
        return list(self.tokenizer.encode(string, **kwargs))

    def tok_decode(self, ids: Sequence[int]) -> str:
        return self.tokenizer.decode(list(ids), skip_special_tokens=True)

    @property
    def tokenizer_name(self) -> str:
        return str(getattr(self.tokenizer, "name_or_path", "")).replace("/", "__")

    def apply_chat_template(self, chat_history: list[dict[str, str]], add_generation_prompt: bool = True) -> str:
        return self.tokenizer.apply_chat_template(chat_history, tokenize=False,
                                                  add_generation_prompt=add_generation_prompt)

    def chat_template(self, chat_template: bool | str = False) -> str | None:
        return getattr(self.tokenizer, "chat_template", None) if chat_template else None

    def _check_fits(self, n: int, what: str) -> None:
        if self.max_length is not None and n > self.max_length:
            raise ConfigError(f"{what} needs {n} tokens, more than the runtime's context of {self.max_length}: "
                              "raise the context (n_ctx) this benchmark is run with, or lower its max_gen_toks")

    # ------------------------------------------------------------------ the interface
    def _loglikelihood_tokens(self, requests, disable_tqdm: bool = False, **kwargs) -> list[tuple[float, bool]]:
        """((context, continuation), context ids, continuation ids) -> (sum of the continuation's log-probs,
        whether every continuation token is the argmax), one teacher-forced pass each."""
        out = []
        for (context, continuation), ctx, cont in tqdm(requests, desc="loglikelihood", disable=disable_tqdm):
            ctx, cont = [int(t) for t in ctx], [int(t) for t in cont]
            if not ctx or not cont:
                raise ValueError(f"loglikelihood: empty context or continuation ({context!r}, {continuation!r})")
            # the last continuation token is only predicted, never fed: the pass holds one token fewer (as HFLM's)
            ids = (ctx + cont)[:-1]
            self._check_fits(len(ids), "a loglikelihood request")
            positions = list(range(len(ctx) - 1, len(ids)))
            scores = self.runtime.score(ids, positions, np.asarray(cont, dtype=np.int64)[:, None])
            result = (float(scores.logprobs[:, 0].sum()), bool(np.array_equal(scores.argmax, cont)))
            out.append(result)
            if context is not None:         # a rolling window is cached whole, by loglikelihood_rolling
                self.cache_hook.add_partial("loglikelihood", (context, continuation), result)
        return out

    def rolling_windows(self, string: str) -> list[tuple[list[int], list[int]]]:
        """(context ids, continuation ids) of each window lm-eval's HF model scores for ``string``: its tokens
        (``tok_encode``), the prefix token before the first, windows of ``max_length`` tokens made disjoint."""
        if self.max_length is None:
            raise ConfigError("loglikelihood_rolling needs max_length (the window): set the runtime's context")
        return [make_disjoint_window(w) for w in get_rolling_token_windows(
            token_list=self.tok_encode(string), prefix_token=self.prefix_token_id, max_seq_len=self.max_length,
            context_len=1)]

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[float]:
        """Each request's text scored whole: the sum of its windows' continuation log-probs (``rolling_windows``),
        each window one teacher-forced pass of at most ``max_length`` tokens."""
        out = []
        for req in tqdm(requests, desc="loglikelihood_rolling", disable=disable_tqdm):
            (string,) = req.args
            windows = [((None, None), ctx, cont) for ctx, cont in self.rolling_windows(string)]
            total = float(sum(ll for ll, _ in self._loglikelihood_tokens(windows, disable_tqdm=True)))
            out.append(total)
            self.cache_hook.add_partial("loglikelihood_rolling", (string,), total)
        return out

    def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
        out = []
        for req in tqdm(requests, desc="generate_until", disable=disable_tqdm):
            context, gen_kwargs = req.args
            until, budget = greedy_request(gen_kwargs)
            text = self.generate_text(context, until, budget)
            out.append(text)
            self.cache_hook.add_partial("generate_until", req.args, text)
        return out

    def generate_text(self, context: str, until: Sequence[str], max_gen_toks: int) -> str:
        """One greedy reply to ``context`` from a cold cache, stopped at the first token whose decoded reply holds
        a string of ``until`` (or the end-of-turn ids, or ``max_gen_toks``) and cut before that string."""
        prompt = self.tok_encode(context)
        if not prompt:
            prompt = [self.prefix_token_id]
        self._check_fits(len(prompt) + max_gen_toks, "a generate_until request")
        self.runtime.reset()
        ids: list[int] = []
        stop = "length"
        while len(ids) < max_gen_toks:
            left = max_gen_toks - len(ids)
            gen = self.runtime.generate(prompt + ids, min(left, self.chunk_tokens) if self.chunked else left,
                                        self.stop_ids)
            start = len(ids)
            ids.extend(int(t) for t in gen.ids)
            hit = self._first_stop(ids, start, until)
            if hit is not None:
                ids, stop = ids[:hit], "until"
                break
            if gen.stop == "eos":
                stop = "eos"
                break
        self.log.append({"prompt_tokens": len(prompt), "reply_tokens": len(ids), "stop": stop})
        return cut_at_stop(self.tok_decode(ids), until)

    def _first_stop(self, ids: list[int], start: int, until: Sequence[str]) -> int | None:
        """The smallest k > start whose decoded ``ids[:k]`` holds a stop string (None: none does): where lm-eval's
        HF model, checking after every token, would have stopped."""
        terms = [u for u in until if u]
        if not terms or not any(u in self.tok_decode(ids) for u in terms):
            return None
        for k in range(start + 1, len(ids) + 1):
            text = self.tok_decode(ids[:k])
            if any(u in text for u in terms):
                return k
        return len(ids)
