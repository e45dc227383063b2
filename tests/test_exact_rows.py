"""The stored KLD: top-K + one tail bucket, exact where the reference kept its whole distribution (exact rows)."""

import numpy as np

from pipeline.figures import drift as metrics
from pipeline.stages.score import exact_sample, kld_exactness, teacher_forced
from pipeline.stages.reference import SuiteReference
from pipeline.runtimes.base import FullLogitsRuntime

VOCAB, N, K = 3000, 80, 32


class FixedLogits(FullLogitsRuntime):
    """Logits looked up by position: a model whose next-token distributions are given."""

    name = "fixed"

    def __init__(self, logits: np.ndarray):
        self.table, self.info = logits, {}

    def logits(self, ids, positions):
        return self.table[np.asarray(positions)].astype(np.float32)

    def generate(self, prompt_ids, max_new_tokens, stop_ids):
        raise NotImplementedError


def _models():
    """An "original" whose positions alternate between peaked and flat (a heavy tail beyond the top-K), and a
    "variant" that perturbs it: the flat positions are where the one-bucket figure under-reads."""
    rng = np.random.default_rng(7)
    temperature = np.where(np.arange(N) % 4 == 0, 2.0, 0.2)[:, None]
    p_logits = rng.normal(size=(N, VOCAB)) / temperature
    q_logits = p_logits + rng.normal(scale=0.5, size=(N, VOCAB))
    return p_logits, q_logits


def _reference(p_logits: np.ndarray, tau: float | None) -> SuiteReference:
    lp = metrics.log_softmax(p_logits.astype(np.float32))
    ids, topk_lp, tail = metrics.topk_from_logprobs(lp, K)
    pos = np.arange(N)
    ids_seq = list(range(N + 1))       # the "transcript": token i+1 follows position i (any ids serve here)
    tr = {"id": "c1", "ids": ids_seq}
    scores = {"c1": {"topk_ids": ids.astype(np.int32), "topk_lp": topk_lp.astype(np.float32),
                     "tail": tail.astype(np.float32), "actual_lp": lp[pos, pos + 1].astype(np.float32),
                     "pos": pos, "out_pos": pos, "turn": np.zeros(N, dtype=np.int64)}}
    rows = {}
    if tau is not None:
        idx = np.flatnonzero(np.exp(tail) > tau)
        rows = {"c1": (idx, lp[idx].astype(np.float32))}
    return SuiteReference(suite="s", transcripts=[tr], scores=scores, producer="p", hash="h", rows=rows,
                          rows_hash="r" if rows else None)


def test_exact_rows_make_the_kld_exact_there_and_leave_the_bucket_elsewhere():
    p_logits, q_logits = _models()
    original, variant = FixedLogits(p_logits), FixedLogits(q_logits)
    exact = metrics.kld_full(original.logprobs([], range(N)), variant.logprobs([], range(N)))
    bucket_only = np.array(teacher_forced(variant, _reference(p_logits, None), K)["c1"]["kld"])
    ref = _reference(p_logits, 0.01)
    rows = ref.rows["c1"][0]
    assert 0 < len(rows) < N, "the fixture must mix positions with and without exact rows"
    out = teacher_forced(variant, ref, K)["c1"]
    hybrid = np.array(out["kld"])
    assert out["exact_rows"] == rows.tolist()
    np.testing.assert_allclose(hybrid[rows], exact[rows], rtol=1e-5)
    others = np.setdiff1d(np.arange(N), rows)
    np.testing.assert_array_equal(hybrid[others], bucket_only[others])
    assert np.all(bucket_only[rows] < exact[rows] * 0.99), "the bucket under-reads where the tail is heavy"
    assert abs(hybrid.mean() / exact.mean() - 1) < abs(bucket_only.mean() / exact.mean() - 1)


def _sample_logprobs(original: FixedLogits, ref: SuiteReference) -> np.ndarray:
    """The original's log-probs at the exactness sample, as exact_sample_logprobs stores them for every variant."""
    tr, idx = exact_sample(ref, N)
    return original.logprobs(tr["ids"], ref.scores[tr["id"]]["pos"][idx].tolist())


def test_the_exactness_sample_reports_the_stored_figure_as_scored_and_the_top_k_only_one():
    p_logits, q_logits = _models()
    original, variant = FixedLogits(p_logits), FixedLogits(q_logits)
    ref = _reference(p_logits, 0.01)
    e = kld_exactness(variant, _sample_logprobs(original, ref), ref, n=N)
    assert e["exact_rows"] > 0 and e["tokens"] == N
    assert e["ratio_topk_only"] < e["ratio"] <= 1.0 + 1e-6
    assert abs(e["ratio"] - 1) < 0.02 < abs(e["ratio_topk_only"] - 1)
    ref = _reference(p_logits, None)
    plain = kld_exactness(variant, _sample_logprobs(original, ref), ref, n=N)
    assert plain["exact_rows"] == 0 and plain["ratio"] == plain["ratio_topk_only"]


def test_the_originals_stored_log_probs_must_be_those_of_the_sample():
    """Every variant reads the original's log-probs at the sample from one stored array (exact_sample_logprobs):
    rows for another sample are refused."""
    import pytest

    p_logits, q_logits = _models()
    original, variant = FixedLogits(p_logits), FixedLogits(q_logits)
    ref = _reference(p_logits, 0.01)
    stored = _sample_logprobs(original, ref)
    with pytest.raises(ValueError, match="rows of the original's log-probs for a sample of"):
        kld_exactness(variant, stored[:-1], ref, n=N)


def test_exact_rows_read_from_their_files_score_the_same_and_leave_no_map_behind(tmp_path):
    """Rows kept in a file (``RowFiles``, as the exact-rows stage hands them over) give the figures of rows held in
    memory, and once scored no map of the file is left in the process: a map held for the run would keep every
    row that scoring read resident into the stages after it."""
    from dataclasses import replace
    from pathlib import Path

    from pipeline.stages.reference import RowFiles

    p_logits, q_logits = _models()
    variant = FixedLogits(q_logits)
    ref = _reference(p_logits, 0.01)
    idx, rows = ref.rows["c1"]
    path = tmp_path / "c1.npy"
    np.save(path, rows)
    on_disk = replace(ref, rows=RowFiles({"c1": (idx, path)}))

    def mapped() -> bool:
        return str(path) in Path("/proc/self/maps").read_text()

    assert list(on_disk.rows) == ["c1"] and len(on_disk.rows) == 1
    assert isinstance(on_disk.rows["c1"][1], np.memmap)
    assert not mapped()
    out = teacher_forced(variant, on_disk, K)["c1"]
    assert out == teacher_forced(variant, ref, K)["c1"]
    assert not mapped(), "scoring left the rows' file mapped"
