"""Scoring streams: a conversation's (positions, vocabulary) matrix never exists in the project's own code, and the
streamed figures equal a straightforward float64 computation on the whole matrix."""

import tracemalloc

import numpy as np
import pytest

from pipeline.figures import drift as metrics
from pipeline.runtimes.base import BLOCK_BYTES, FullLogitsRuntime, block_rows


class OnDemand(FullLogitsRuntime):
    """A full-logits runtime whose rows are made a block at a time when asked for (never all at once): row p is a
    fixed random row rolled by p and scaled, so every row differs and any row can be recomputed."""

    name = "on-demand"

    def __init__(self, vocab: int, seed: int = 0, scale: float = 3.0):
        self.base = np.random.default_rng(seed).standard_normal(vocab, dtype=np.float32) * np.float32(scale)
        self.info = {}

    def row(self, p: int) -> np.ndarray:
        return np.roll(self.base, 7 * p) * np.float32(1 + (p % 5) / 10)

    def logit_blocks(self, ids, positions):
        step = block_rows(len(self.base))
        for start in range(0, len(positions), step):
            yield self.block(positions[start:start + step])

    def block(self, part) -> np.ndarray:
        out = np.empty((len(part), len(self.base)), dtype=np.float32)
        for r, p in enumerate(part):
            out[r] = self.row(p)
        return out

    def whole(self, positions) -> np.ndarray:
        return np.stack([self.row(p) for p in positions])

    def generate(self, prompt_ids, max_new_tokens, stop_ids):
        raise NotImplementedError


def _peak_bytes(fn) -> tuple[object, int]:
    tracemalloc.start()
    try:
        out = fn()
        return out, tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


VOCAB, N = 262144, 1024          # a whole float64 matrix: 2 GiB
# One block the runtime hands over, one chunk's temporaries, and a margin for the per-row outputs (N x 64 at most
# here): 144 MiB. Measured: about 100 MiB for score and top-K, 188 MiB for a comparison of two streams.
BOUND = BLOCK_BYTES + metrics.CHUNK_BYTES + 16 * 2**20


@pytest.mark.integration
def test_scoring_a_long_sequence_never_holds_its_whole_matrix(tmp_path):
    rt = OnDemand(VOCAB)
    positions, ids = list(range(N)), list(range(N + 1))
    cand = np.random.default_rng(1).integers(0, VOCAB, size=(N, 33))
    full_rows = np.arange(0, N, 9)
    # the reference's rows at full_rows, as the exact-rows stage leaves them: a float32 .npy read memory-mapped
    ref_file = tmp_path / "ref.npy"
    metrics.write_rows(ref_file, OnDemand(VOCAB, seed=2).logprob_blocks(ids, full_rows.tolist()), len(full_rows))
    full_ref = np.load(ref_file, mmap_mode="r")
    whole_bytes = N * VOCAB * 8
    assert BOUND + BLOCK_BYTES < whole_bytes / 8
    scores, peak = _peak_bytes(lambda: rt.score(ids, positions, cand, full_rows, full_ref))
    assert scores.logprobs.shape == (N, 33) and scores.kld_full.shape == (len(full_rows),)
    assert peak < BOUND, f"score peaked at {peak / 2**20:.0f} MiB (bound {BOUND / 2**20:.0f} MiB)"
    # the reference's top-K, as reference_logprobs takes it
    (ids_k, _, _, _), peak = _peak_bytes(lambda: metrics.topk_chunks(rt.logprob_blocks(ids, positions), 64,
                                                                     np.asarray(ids[1:])))
    assert ids_k.shape == (N, 64)
    assert peak < BOUND, f"top-K peaked at {peak / 2**20:.0f} MiB (bound {BOUND / 2**20:.0f} MiB)"
    # two runtimes compared row by row (parity, corpus): one block of each and one chunk of both's temporaries
    other = OnDemand(VOCAB, seed=3)
    cmp, peak = _peak_bytes(lambda: metrics.compare_chunks(metrics.paired(
        rt.logprob_blocks(ids, positions), other.logprob_blocks(ids, positions))))
    assert cmp["kld"].shape == (N,)
    assert peak < BOUND + BLOCK_BYTES, f"comparison peaked at {peak / 2**20:.0f} MiB"


def _float64_reference(p_logits: np.ndarray, q_logits: np.ndarray, k: int):
    """The figures the plain way: whole float64 matrices, log-softmax by its definition."""
    def lsm(x):
        x = x.astype(np.float64)
        return x - np.log(np.exp(x - x.max(-1, keepdims=True)).sum(-1, keepdims=True)) - x.max(-1, keepdims=True)

    lp, lq = lsm(p_logits), lsm(q_logits)
    kld = (np.exp(lp) * (lp - lq)).sum(-1)
    order = np.argsort(-lp, axis=-1, kind="stable")[:, :k]
    return lp, lq, kld, order


def test_streamed_figures_equal_a_plain_float64_computation(monkeypatch):
    vocab, n, k = 5000, 40, 16
    p, q = OnDemand(vocab, seed=4), OnDemand(vocab, seed=5, scale=2.5)
    positions, ids = list(range(n)), list(range(n + 1))
    lp, lq, kld, order = _float64_reference(p.whole(positions), q.whole(positions), k)
    targets = np.asarray(ids[1:]) % vocab
    cand = np.concatenate([order, targets[:, None]], axis=1)
    full_rows = np.array([0, 3, 17, 39])
    # small blocks and chunks of other sizes, so that every row path crosses block and chunk boundaries
    import pipeline.runtimes.base as base

    monkeypatch.setattr(base, "BLOCK_BYTES", 7 * 4 * vocab)
    monkeypatch.setattr(metrics, "CHUNK_BYTES", 3 * metrics.PEAK_BYTES_PER_ENTRY * vocab)
    assert block_rows(vocab) == 7 and metrics.chunk_rows(vocab) == 3
    s = q.score(ids, positions, cand, full_rows, lp[full_rows].astype(np.float32))
    ids_k, lps_k, tail, target_lp = metrics.topk_chunks(p.logprob_blocks(ids, positions), k, targets)
    cmp = metrics.compare_chunks(metrics.paired(p.logprob_blocks(ids, positions), q.logprob_blocks(ids, positions)),
                                 targets)
    np.testing.assert_allclose(s.logprobs, np.take_along_axis(lq, cand, axis=1), rtol=1e-12, atol=1e-12)
    np.testing.assert_array_equal(s.argmax, lq.argmax(-1))
    exact_at_rows = (np.exp(lp[full_rows].astype(np.float32).astype(np.float64))
                     * (lp[full_rows].astype(np.float32) - lq[full_rows])).sum(-1)
    np.testing.assert_allclose(s.kld_full, exact_at_rows, rtol=1e-9)
    np.testing.assert_array_equal(ids_k, order)
    np.testing.assert_allclose(lps_k, np.take_along_axis(lp, order, axis=1), rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(tail, np.log1p(-np.exp(lps_k).sum(-1)), rtol=1e-9)
    np.testing.assert_allclose(target_lp, lp[np.arange(n), targets], rtol=1e-12)
    np.testing.assert_allclose(cmp["kld"], kld, rtol=1e-9)
    np.testing.assert_allclose(cmp["target_b"], lq[np.arange(n), targets], rtol=1e-12)
    assert kld.min() > 1e-3, "the two models must differ for the comparison to mean anything"


def test_unsorted_positions_come_back_in_their_order():
    from pipeline.runtimes.base import in_position_order

    rt = OnDemand(300)
    wanted = [5, 1, 9, 1]
    blocks = list(in_position_order(wanted, lambda asc: rt.logit_blocks([], asc)))
    np.testing.assert_array_equal(np.concatenate(blocks), rt.whole(wanted))


def test_paired_streams_must_cover_the_same_rows():
    a = [np.zeros((3, 4)), np.zeros((2, 4))]
    with pytest.raises(ValueError, match="different lengths"):
        list(metrics.paired(iter(a), iter([np.zeros((4, 4))])))
    cut = [(len(x), len(y)) for x, y in metrics.paired(iter(a), iter([np.zeros((1, 4)), np.zeros((4, 4))]))]
    assert cut == [(1, 1), (2, 2), (2, 2)]


@pytest.mark.parametrize("family", ["llama", "gemma2", "qwen2_moe"])
def test_the_transformers_head_run_a_block_at_a_time_is_the_models_own_forward(tmp_path, monkeypatch, family):
    """transformers: the body once, then the model's own head and what follows it (Gemma 2 soft-caps its logits; a
    mixture of experts reads its body's router logits) a block of positions at a time, equal to one whole forward
    pass."""
    import torch
    import transformers

    import pipeline.runtimes.base as base
    from pipeline.runtimes.hf import HFRuntime
    from tests.conftest import compose

    torch.manual_seed(0)
    shape = dict(vocab_size=1000, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, head_dim=8, max_position_embeddings=512)
    if family == "gemma2":
        model = transformers.Gemma2ForCausalLM(transformers.Gemma2Config(**shape, final_logit_softcapping=2.0))
    elif family == "qwen2_moe":
        moe = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=32,
                   output_router_logits=True)
        model = transformers.Qwen2MoeForCausalLM(transformers.Qwen2MoeConfig(
            **{k: v for k, v in shape.items() if k != "head_dim"}, **moe))
    else:
        model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**shape))
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 2:
                p.normal_(0.0, 0.3)
    model.save_pretrained(str(tmp_path / "m"), safe_serialization=True)
    cfg = compose([f"paths.artifacts={tmp_path / 'a'}"])
    rt = HFRuntime(tmp_path / "m", {"dtype": "float32"}, cfg.runtime)
    monkeypatch.setattr(base, "BLOCK_BYTES", 16 * 4 * 1000)       # 16 rows a block: 14 blocks below
    ids = np.random.default_rng(0).integers(0, 1000, size=240).tolist()
    positions = list(range(30, 239))
    blocks = list(rt.logit_blocks(ids, positions))
    assert rt._split_head_ok and len(blocks) == 14 and max(len(b) for b in blocks) == 16
    whole = rt._whole_logits(ids, positions)
    np.testing.assert_allclose(np.concatenate(blocks), whole, rtol=1e-5, atol=1e-5 * float(np.abs(whole).max()))
    if family == "gemma2":
        assert np.abs(whole).max() <= 2.0 and np.abs(whole).max() > 1.5, "the cap applies and matters"
    rt.close()
