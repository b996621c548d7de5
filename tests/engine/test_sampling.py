"""SamplingParams validation and the batched sampler: masks, greedy, batch-independent seeds."""

from __future__ import annotations

import math

import pytest
import torch

from engine.model.sampler import (
    Sampler,
    gumbel_noise,
    mix32,
    sampled_with_logprobs,
    uniform_of_hash,
)
from scheduler import SamplingParams

VOCAB = 50


def logits_row(seed: int = 0) -> torch.Tensor:
    return torch.randn(VOCAB, generator=torch.Generator().manual_seed(seed)) * 2


@pytest.mark.parametrize(
    "field,value",
    [
        ("max_new_tokens", 0),
        ("max_new_tokens", 2.5),
        ("temperature", -0.1),
        ("temperature", float("nan")),
        ("temperature", float("inf")),
        ("temperature", True),
        ("top_p", True),
        ("top_p", 0.0),
        ("top_p", 1.5),
        ("top_k", -2),
        ("top_k", 1.5),
        ("min_p", -0.1),
        ("min_p", 1.1),
        ("seed", -1),
        ("seed", 1 << 63),
        ("seed", "7"),
        ("stop", [""]),
        ("stop", ""),
        ("stop", 5),
        ("stop_token_ids", [-1]),
        ("stop_token_ids", ["a"]),
        ("ignore_eos", 1),
    ],
)
def test_invalid_params_raise_value_error_naming_the_field(field: str, value: object) -> None:
    with pytest.raises(ValueError, match=field):
        SamplingParams(**{field: value})


def test_vllms_spellings_one_stop_string_and_top_k_minus_one_are_taken() -> None:
    assert SamplingParams(stop="###").stop == ["###"]
    assert SamplingParams(top_k=-1) == SamplingParams(top_k=0)


def test_params_cannot_be_changed_after_construction_so_they_stay_valid() -> None:
    params = SamplingParams()
    with pytest.raises(AttributeError):
        params.top_p = 0.0  # type: ignore[misc]
    assert params.top_p == 1.0


def test_defaults_are_valid_and_greedy_means_temperature_zero() -> None:
    assert not SamplingParams().is_greedy
    assert SamplingParams(temperature=0).is_greedy
    assert SamplingParams().max_new_tokens == 64


def test_greedy_rows_take_the_argmax() -> None:
    logits = torch.stack([logits_row(i) for i in range(4)])
    params = [SamplingParams(temperature=0)] * 2 + [SamplingParams(temperature=0, seed=3)] * 2
    assert Sampler().sample(logits, params, [0] * 4).tolist() == logits.argmax(-1).tolist()


def test_seeded_rows_give_the_same_token_whatever_else_is_in_the_batch() -> None:
    target = logits_row(7)
    params = SamplingParams(temperature=1.3, top_p=0.95, seed=1234)
    alone = [int(Sampler().sample(target[None], [params], [s])[0]) for s in range(20)]
    for step in range(20):
        others = torch.stack([logits_row(100 + step), target, logits_row(200 + step)])
        mixed = [
            SamplingParams(temperature=0.7),
            params,
            SamplingParams(temperature=0.0, seed=9),
        ]
        assert int(Sampler(seed=step).sample(others, mixed, [3, step, 0])[1]) == alone[step]
    assert len(set(alone)) > 1  # the step counter moves the noise


def test_different_seeds_draw_different_sequences() -> None:
    logits = logits_row(3)[None]
    draws = {
        tuple(int(Sampler().sample(logits, [SamplingParams(seed=s)], [t])[0]) for t in range(10))
        for s in range(5)
    }
    assert len(draws) == 5


def test_samples_follow_the_softmax_distribution() -> None:
    n = 4000
    logits = torch.tensor([2.0, 1.0, 0.0, -1.0])
    params = [SamplingParams(seed=s) for s in range(n)]
    tokens = Sampler().sample(logits.expand(n, 4), params, [0] * n)
    freq = torch.bincount(tokens, minlength=4).float() / n
    assert torch.allclose(freq, logits.softmax(-1), atol=0.03)


def _draws(logits: torch.Tensor, n: int = 1000, **kw: float) -> set[int]:
    params = [SamplingParams(seed=s, **kw) for s in range(n)]
    return set(Sampler().sample(logits.expand(n, -1), params, [0] * n).tolist())


def test_top_k_keeps_only_the_k_best_tokens() -> None:
    logits = logits_row(1)
    best = set(logits.topk(3).indices.tolist())
    assert _draws(logits, temperature=3.0, top_k=3) == best


def test_top_p_keeps_the_smallest_nucleus_covering_p() -> None:
    logits = torch.tensor([3.0, 2.0, 1.0, 0.0, -1.0, -2.0])
    probs = logits.softmax(-1)  # 0.636, 0.234, 0.086, ...
    assert float(probs[0]) < 0.8 < float(probs[:2].sum())
    assert _draws(logits, top_p=0.8) == {0, 1}
    assert _draws(logits, top_p=0.5) == {0}


def test_min_p_drops_tokens_below_a_fraction_of_the_best() -> None:
    logits = torch.log(torch.tensor([0.5, 0.3, 0.1, 0.06, 0.04]))
    assert _draws(logits, min_p=0.15) == {0, 1, 2}


def test_filters_combine_per_row() -> None:
    logits = logits_row(5)
    n = 600
    params = [SamplingParams(seed=s, temperature=2.0, top_k=1 if s % 2 else 0) for s in range(n)]
    tokens = Sampler().sample(logits.expand(n, -1), params, [0] * n)
    best = int(logits.argmax())
    assert all(t == best for t in tokens[1::2].tolist())
    assert len(set(tokens[0::2].tolist())) > 5


def test_params_and_rows_must_align() -> None:
    with pytest.raises(ValueError, match="params"):
        Sampler().sample(torch.zeros(2, VOCAB), [SamplingParams()], [0])


def test_noise_is_a_pure_function_of_seed_step_and_index() -> None:
    seeds = torch.tensor([5, 5, 6, (1 << 62) + 5])
    steps = torch.tensor([0, 1, 0, 0])
    a, b = gumbel_noise(seeds, steps, 1000), gumbel_noise(seeds, steps, 1000)
    assert torch.equal(a, b)
    assert (
        not torch.equal(a[0], a[1]) and not torch.equal(a[0], a[2]) and not torch.equal(a[0], a[3])
    )
    assert torch.isfinite(a).all()
    assert abs(float(a.mean()) - 0.5772) < 0.05  # Euler-Mascheroni: the Gumbel mean


def test_uniforms_stay_strictly_inside_zero_one_for_every_hash() -> None:
    top_bits = torch.arange(1 << 24, dtype=torch.int64) << 8  # every value the noise reads
    u = uniform_of_hash(top_bits | 0xFF)
    assert bool((u > 0).all()) and bool((u < 1).all())
    assert torch.isfinite(-torch.log(-torch.log(u))).all()


# Seed 433 at step 0 hashes token 36593 of a 49,152-token vocabulary to the top 24-bit value:
# before the clamp, its noise was +inf and it was sampled through any mask.
TOP_NOISE_SEED, TOP_NOISE_TOKEN, BIG_VOCAB = 433, 36593, 49152


def test_the_top_noise_value_is_finite() -> None:
    noise = gumbel_noise(torch.tensor([TOP_NOISE_SEED]), torch.tensor([0]), BIG_VOCAB)
    assert torch.isfinite(noise).all()
    assert int(noise.argmax()) == TOP_NOISE_TOKEN


@pytest.mark.parametrize(
    "mask",
    [{"top_k": 1}, {"top_p": 0.01}, {"logit_bias": {TOP_NOISE_TOKEN: -100.0}}],
    ids=["top_k", "top_p", "logit_bias"],
)
def test_a_masked_token_is_never_sampled_at_the_top_noise(mask: dict[str, object]) -> None:
    logits = torch.zeros(1, BIG_VOCAB)
    logits[0, 7] = 30.0  # the only token top-k / top-p keep
    params = SamplingParams(temperature=1.0, seed=TOP_NOISE_SEED, **mask)  # type: ignore[arg-type]
    token = Sampler().sample(logits, [params], [0], [[1, 2]], [[]])
    assert token.tolist() == [7]


def test_mix32_is_a_32_bit_bijection_on_a_sample() -> None:
    x = torch.arange(1 << 16, dtype=torch.int64) * 65537
    h = mix32(x)
    assert int(h.min()) >= 0 and int(h.max()) < 1 << 32
    assert h.unique().numel() == x.numel()
    assert math.isclose(float(h.float().mean()) / 2**32, 0.5, abs_tol=0.01)


@pytest.mark.parametrize("counts", [[], [0], [3], [0, 5, 2]])
def test_one_packed_copy_reads_what_separate_reads_gave(counts: list[int]) -> None:
    """``sampled_with_logprobs`` packs tokens, log-probabilities, ranks and alternatives into
    one float64 tensor for one device-to-host copy: every value is exactly what reading each
    part alone gives (float32 log-probabilities and token ids are exact in float64)."""
    gen = torch.Generator().manual_seed(len(counts))
    logits = torch.randn(5, 300, generator=gen) * 4
    tokens = torch.randint(0, 300, (5,), generator=gen)
    rows = [4, 1, 2][: len(counts)]
    sampled, scores = sampled_with_logprobs(tokens, logits, rows, counts)
    assert sampled == tokens.tolist()
    logp = logits.float().log_softmax(dim=-1)
    for row, count, score in zip(rows, counts, scores, strict=True):
        token = int(tokens[row])
        assert score.token_id == token
        assert score.logprob == logp[row, token].item()
        assert score.rank == int((logp[row] > logp[row, token]).sum()) + 1
        values, ids = logp[row].topk(count) if count else (torch.empty(0), torch.empty(0))
        assert score.top == list(zip(ids.tolist(), values.tolist()))
