"""`quantdrift corpus` follows llama.cpp perplexity's chunking conventions."""

import json
import subprocess
import sys

import numpy as np
import pytest

from pipeline.infra.errors import ConfigError
from pipeline.config.schema import PROJECT_ROOT
from pipeline.commands.corpus import chunk_plan, corpus_drift


def test_chunk_plan_matches_llama_perplexity():
    assert chunk_plan(1024, 512) == (2, 256)
    assert chunk_plan(1500, 512) == (2, 256)     # a partial last chunk is dropped
    with pytest.raises(ConfigError, match="at least 2 x ctx"):
        chunk_plan(1000, 512)
    with pytest.raises(ConfigError, match="even"):
        chunk_plan(1000, 7)


class _Uniformish:
    """A fake runtime that records what it is asked to score."""

    def __init__(self, shift=0.0):
        self.calls = []
        self.shift = shift

    def logprobs(self, ids, positions):
        self.calls.append((list(ids), list(positions)))
        from pipeline.figures.drift import log_softmax

        logits = np.zeros((len(positions), 200))
        logits[:, 3] = 2.0 + self.shift
        return log_softmax(logits)


def test_corpus_scores_second_half_of_each_chunk_with_bos_first():
    ids = list(range(100, 140))
    orig, var = _Uniformish(), _Uniformish(shift=1.0)
    out = corpus_drift(orig, var, ids, ctx=8, bos_id=1)
    assert out["chunks"] == 5 and out["scored_tokens"] == 5 * 3   # positions 4, 5, 6 of each 8-token chunk
    chunk_ids, positions = orig.calls[1]
    assert chunk_ids[0] == 1 and chunk_ids[1:] == ids[9:16] and positions == [4, 5, 6]
    assert out["kld_mean"] > 0 and out["same_top1"] == 1.0
    same = corpus_drift(_Uniformish(), _Uniformish(), ids, ctx=8, bos_id=None)
    assert same["kld_mean"] == pytest.approx(0.0) and same["ppl_original"] == pytest.approx(same["ppl_variant"])


@pytest.mark.slow
def test_corpus_command_prints_llama_cpp_style_json(tmp_path, tiny_llama):
    text = tmp_path / "notes.txt"
    text.write_text(" ".join(f"Ticket SUP-{i} was escalated to tier two on day {i % 28 + 1}." for i in range(120)))
    cmd = [sys.executable, "-m", "pipeline.cli", "corpus", "variant=gguf_q8_0", f"file={text}", "ctx=128",
           "json=true", f"model.source={tiny_llama}", "model.name=tiny", f"paths.artifacts={tmp_path / 'a'}",
           f"paths.cache={PROJECT_ROOT / '.cache'}", f"hydra.run.dir={tmp_path / 'h'}"]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-2000:]
    result = json.loads(out.stdout.strip().splitlines()[-1])
    for key in ("ppl_original", "ppl_variant", "kld_mean", "kld_median", "kld_p99", "same_top1"):
        assert isinstance(result[key], float)
    assert result["kld_mean"] > 0 and 0 < result["same_top1"] <= 1
    missing = subprocess.run(cmd[:5] + ["file=/nonexistent.txt"] + cmd[6:], capture_output=True, text=True, timeout=600)
    assert missing.returncode == 2 and "corpus.file" in missing.stderr


def _llama_tool(name: str):
    """A llama.cpp tool built by `make llama-tools` (the build the bindings load), or None."""
    from pipeline.infra.errors import ConfigError
    from pipeline.infra.llama_tools import tool

    try:
        return str(tool(name))
    except ConfigError:
        return None


def _parse_llama_kld(log: str) -> dict:
    import re

    out = {}
    for key, pattern in (("kld_mean", r"Mean\s+KLD:\s+([-\d.]+)\s+±\s+([-\d.]+)"),
                         ("ln_ppl_ratio", r"Mean ln\(PPL\(Q\)/PPL\(base\)\)\s+:\s+([-\d.]+)\s+±\s+([-\d.]+)"),
                         ("same_top1", r"Same top p:\s+([\d.]+)\s+±")):
        m = re.search(pattern, log)
        assert m, f"{key} not in llama-perplexity's output:\n{log[-3000:]}"
        out[key] = float(m.group(1))
    return out


@pytest.mark.slow
def test_corpus_agrees_with_llama_perplexity_on_the_same_files(tmp_path, tiny_llama):
    """`quantdrift corpus corpus.baseline=f16` against `llama-perplexity --kl-divergence` (built from the same
    vendored llama.cpp by `make llama-tools`, which `make test` runs) on the same GGUF files, text and context:
    mean KLD within 2 %, same top-1 and ln(PPL ratio) close."""
    perplexity = _llama_tool("llama-perplexity")
    if perplexity is None:
        pytest.skip("llama-perplexity is not built: run `make llama-tools` (make test does)")
    from pipeline.stages.prepare import prepare
    from pipeline.stages.quantize import build_artifact
    from pipeline.stages.reference import f16_variant
    from pipeline.compose import load_variant
    from tests.conftest import compose

    text = tmp_path / "notes.txt"
    text.write_text("\n".join(f"Invoice INV-{1000 + i} for {i % 7 + 1} pallets was paid on day {i % 28 + 1}; the "
                              f"<|im_start|> marker stays plain text. Refund RF-{i * 37 % 991} is pending."
                              for i in range(160)))
    ctx = 128
    common = [f"model.source={tiny_llama}", "model.name=tiny", f"paths.artifacts={tmp_path / 'a'}",
              f"paths.cache={PROJECT_ROOT / '.cache'}"]
    cfg = compose(common)
    original = prepare(cfg.model, cfg.model_dir)
    f16 = build_artifact(f16_variant(), original, cfg).path
    base = tmp_path / "base.kld"
    run = subprocess.run([perplexity, "-m", str(f16), "-f", str(text), "-c", str(ctx), "-b", str(ctx), "-t", "2",
                          "--kl-divergence-base", str(base)], capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    for name in ("gguf_q8_0", "gguf_q4_0"):
        q = build_artifact(load_variant(name), original, compose(common + [f"variant={name}"])).path
        ref = subprocess.run([perplexity, "-m", str(q), "-c", str(ctx), "-b", str(ctx), "-t", "2", "--kl-divergence",
                              "--kl-divergence-base", str(base)], capture_output=True, text=True, timeout=600)
        assert ref.returncode == 0, ref.stderr[-3000:]
        theirs = _parse_llama_kld(ref.stdout + ref.stderr)
        out = subprocess.run([sys.executable, "-m", "pipeline.cli", "corpus", f"variant={name}", f"file={text}",
                              f"ctx={ctx}", "json=true", "baseline=f16", *common, f"hydra.run.dir={tmp_path / 'h'}"],
                             capture_output=True, text=True, timeout=600)
        assert out.returncode == 0, out.stderr[-2000:]
        ours = json.loads(out.stdout.strip().splitlines()[-1])
        assert ours["tokenizer"].startswith("llama.cpp")
        assert ours["kld_mean"] == pytest.approx(theirs["kld_mean"], rel=0.02), (name, ours, theirs)
        assert ours["ln_ppl_ratio"] == pytest.approx(theirs["ln_ppl_ratio"], rel=0.05, abs=1e-4), (name, ours, theirs)
        assert abs(100 * ours["same_top1"] - theirs["same_top1"]) < 1.0, (name, ours, theirs)
