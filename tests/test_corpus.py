"""`quantdrift corpus` follows llama.cpp perplexity's chunking conventions."""

import json
import subprocess
import sys

import numpy as np
import pytest

from pipeline.config import ConfigError, PROJECT_ROOT
from pipeline.corpus import chunk_plan, corpus_drift


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
        from pipeline.metrics import log_softmax

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
