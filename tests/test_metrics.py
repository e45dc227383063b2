import numpy as np
import pytest

from pipeline.figures import drift as metrics


def _random_logprobs(rng, n, vocab, temperature):
    return metrics.log_softmax(rng.normal(size=(n, vocab)) / temperature)


@pytest.mark.parametrize("temperature", [0.3, 1.0, 3.0])
def test_topk_tail_kld_is_a_lower_bound_that_tightens_with_k(temperature):
    rng = np.random.default_rng(0)
    p = _random_logprobs(rng, 64, 500, temperature)
    q = metrics.log_softmax(np.log(np.exp(p) + 1e-3 * rng.random((64, 500))))  # a perturbed "variant"
    exact = metrics.kld_full(p, q)
    previous = np.zeros(len(p))
    for k in (1, 8, 32, 128, 500):
        ids, lp, tail = metrics.topk_from_logprobs(p, k)
        approx = metrics.kld_topk_tail(lp, tail, np.take_along_axis(q, ids, axis=-1))
        assert np.all(approx <= exact + 1e-9), "merging the tail can only lower KL (log-sum inequality)"
        assert np.all(approx >= previous - 1e-9), "a finer partition can only raise it"
        previous = approx
    np.testing.assert_allclose(previous, exact, rtol=1e-9, atol=1e-12)


def test_topk_tail_kld_is_close_to_exact_when_topk_hold_most_mass():
    rng = np.random.default_rng(3)
    logits = rng.normal(size=(64, 2000)) / 0.15          # peaked, like a real LM's next-token distribution
    p = metrics.log_softmax(logits)
    q = metrics.log_softmax(logits + 0.3 * rng.normal(size=logits.shape))   # quantization-like logit noise
    ids, lp, tail = metrics.topk_from_logprobs(p, 32)
    assert np.exp(lp).sum(axis=-1).min() > 0.95
    approx = metrics.kld_topk_tail(lp, tail, np.take_along_axis(q, ids, axis=-1))
    assert approx.mean() == pytest.approx(metrics.kld_full(p, q).mean(), rel=0.1)


def test_topk_tail_kld_equals_exact_when_k_covers_the_vocabulary():
    rng = np.random.default_rng(1)
    p, q = _random_logprobs(rng, 10, 50, 1.0), _random_logprobs(rng, 10, 50, 1.0)
    ids, lp, tail = metrics.topk_from_logprobs(p, 50)
    approx = metrics.kld_topk_tail(lp, tail, np.take_along_axis(q, ids, axis=-1))
    np.testing.assert_allclose(approx, metrics.kld_full(p, q), rtol=1e-9, atol=1e-9)


def test_kld_of_identical_distributions_is_zero_and_positive_otherwise():
    rng = np.random.default_rng(2)
    p = _random_logprobs(rng, 5, 100, 1.0)
    ids, lp, tail = metrics.topk_from_logprobs(p, 10)
    assert np.allclose(metrics.kld_topk_tail(lp, tail, np.take_along_axis(p, ids, axis=-1)), 0.0, atol=1e-12)
    q = _random_logprobs(rng, 5, 100, 1.0)
    assert np.all(metrics.kld_topk_tail(lp, tail, np.take_along_axis(q, ids, axis=-1)) > 0)


def test_topk_is_sorted_descending_with_tail_mass():
    lp = metrics.log_softmax(np.array([[1.0, 3.0, 2.0, 0.0]]))
    ids, vals, tail = metrics.topk_from_logprobs(lp, 2)
    assert ids.tolist() == [[1, 2]]
    assert np.exp(tail[0]) == pytest.approx(1 - np.exp(vals).sum())


def test_flips_count_both_directions_and_need_pairs():
    assert metrics.flips([True, True, False, False], [True, False, True, False]) == \
        {"pass_to_fail": 1, "fail_to_pass": 1, "total": 4}
    with pytest.raises(ValueError):
        metrics.flips([True], [True, False])


def test_mcnemar_exact():
    assert metrics.mcnemar_exact_p(0, 0) == 1.0
    assert metrics.mcnemar_exact_p(5, 5) == 1.0
    # b=0, c=6: two-sided p = 2 * 0.5**6
    assert metrics.mcnemar_exact_p(0, 6) == pytest.approx(2 / 64)


def test_chrf_is_wired_to_sacrebleu():
    assert metrics.chrf("The invoice INV-2231 was paid.", "The invoice INV-2231 was paid.") == pytest.approx(100.0)
    low = metrics.chrf("Completely unrelated words here.", "The invoice INV-2231 was paid.")
    assert 0 <= low < 40


def test_repeated_ngram_rate_and_loops():
    assert metrics.repeated_ngram_rate(list(range(20)), 4) == 0.0
    looped = [1, 2, 3] * 10
    assert metrics.repeated_ngram_rate(looped, 4) > 0.8
    assert metrics.longest_loop(looped) >= 27
    assert metrics.longest_loop(list(range(30))) == 0


def test_first_divergence():
    assert metrics.first_divergence([1, 2, 3], [1, 2, 3]) is None
    assert metrics.first_divergence([1, 2, 3], [1, 9, 3]) == 1
    assert metrics.first_divergence([1, 2], [1, 2, 3]) == 2


def test_distribution_and_position_buckets():
    d = metrics.distribution([0.0, 1.0, 2.0, 3.0])
    assert d["mean"] == 1.5 and d["median"] == 1.5 and d["max"] == 3.0 and d["n"] == 4
    assert metrics.distribution([])["mean"] is None
    b = metrics.position_buckets([0, 127, 128, 300], [1.0, 3.0, 5.0, 7.0], 128)
    assert b == {"0-128": {"mean": 2.0, "n": 2}, "128-256": {"mean": 5.0, "n": 1}, "256-384": {"mean": 7.0, "n": 1}}
