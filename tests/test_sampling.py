"""Sampler: filters never emit excluded tokens, penalties move mass the documented way, seeds reproduce."""
from __future__ import annotations

import pytest
import torch

from moeferry.ops.sampler import apply_penalties, draws_on_host, filter_candidates, filter_logits, sample
from moeferry.scheduler.batch_sampler import build_sampling_batch
from moeferry.scheduler.request import Request
from moeferry.scheduler.sampling import SamplingParamError, SamplingParams

V = 50


def reqs(*params, prompt=(1, 2, 3), outputs=()):
    out = []
    for p in params:
        r = Request("r", list(prompt), p)
        r.output_ids = list(outputs)
        out.append(r)
    return out


def draw(logits, rs, n, host_draws=True):
    b = build_sampling_batch(rs, V, {0}, "cpu", host_draws)
    return torch.stack([sample(logits, b) for _ in range(n)])  # [n, B]


def test_top_k_top_p_min_p_never_emit_excluded():
    torch.manual_seed(0)
    logits = torch.randn(3, V) * 2
    rs = reqs(SamplingParams(top_k=5), SamplingParams(top_p=0.5), SamplingParams(min_p=0.2))
    got = draw(logits, rs, 400)
    probs = logits.softmax(-1)
    allowed_k = set(logits[0].topk(5).indices.tolist())
    order = probs[1].argsort(descending=True)
    before = probs[1][order].cumsum(0) - probs[1][order]
    allowed_p = set(order[before < 0.5].tolist())
    allowed_min = set((probs[2] >= 0.2 * probs[2].max()).nonzero()[:, 0].tolist())
    assert set(got[:, 0].tolist()) <= allowed_k and len(set(got[:, 0].tolist())) > 1
    assert set(got[:, 1].tolist()) <= allowed_p
    assert set(got[:, 2].tolist()) <= allowed_min


def test_sampling_matches_distribution():
    logits = torch.tensor([[2.0, 1.0, 0.0] + [-1e4] * (V - 3)])
    got = draw(logits, reqs(SamplingParams(temperature=1.0, seed=3)), 3000)[:, 0]
    freq = torch.bincount(got, minlength=V)[:3].float() / 3000
    assert torch.allclose(freq, logits[0, :3].softmax(-1), atol=0.03)
    cold = draw(logits, reqs(SamplingParams(temperature=0.25, seed=3)), 1000)[:, 0]
    assert (cold == 0).float().mean() > 0.95


def test_seed_reproduces_and_differs():
    logits = torch.randn(1, V)
    a = draw(logits, reqs(SamplingParams(seed=7)), 50)
    b = draw(logits, reqs(SamplingParams(seed=7)), 50)
    c = draw(logits, reqs(SamplingParams(seed=8)), 50)
    assert torch.equal(a, b) and not torch.equal(a, c)


def test_penalties():
    logits = torch.full((1, V), 1.0)
    logits[0, 5] = 3.0
    logits[0, 6] = -3.0
    out = (5, 5, 5, 6)
    b = build_sampling_batch(reqs(SamplingParams(frequency_penalty=0.5, presence_penalty=0.25), outputs=out), V, {0}, "cpu")
    pen = apply_penalties(logits, b)[0]
    assert pen[5] == pytest.approx(3.0 - 1.5 - 0.25) and pen[6] == pytest.approx(-3.0 - 0.5 - 0.25)
    assert pen[7] == 1.0
    b = build_sampling_batch(reqs(SamplingParams(repetition_penalty=2.0), prompt=(7,), outputs=(5, 6)), V, {0}, "cpu")
    pen = apply_penalties(logits, b)[0]
    assert pen[5] == 1.5 and pen[6] == -6.0 and pen[7] == 0.5 and pen[8] == 1.0
    b = build_sampling_batch(reqs(SamplingParams(min_tokens=2, stop_token_ids=(9,))), V, {0}, "cpu")
    pen = apply_penalties(logits, b)[0]
    assert pen[0] == float("-inf") and pen[9] == float("-inf") and pen[5] == 3.0


def test_greedy_rows_take_argmax_in_mixed_batch():
    logits = torch.randn(4, V)
    rs = reqs(SamplingParams(temperature=0.0), SamplingParams(temperature=1.0, seed=1),
              SamplingParams(temperature=0.0), SamplingParams(top_k=1))
    got = draw(logits, rs, 20)
    assert (got[:, 0] == logits[0].argmax()).all() and (got[:, 2] == logits[2].argmax()).all()
    assert (got[:, 3] == logits[3].argmax()).all()


def test_greedy_rows_take_argmax_beside_rows_drawn_on_the_host():
    """Every sampling row has a top-k: the draw runs on the host (`draws_on_host`), the greedy
    rows still take the argmax, and the top-k rows stay within their k best."""
    logits = torch.randn(3, V)
    rs = reqs(SamplingParams(temperature=0.0), SamplingParams(temperature=0.8, top_k=4, seed=2),
              SamplingParams(temperature=0.0))
    assert draws_on_host(build_sampling_batch(rs, V, {0}, "cpu").top_k_max, V)
    got = draw(logits, rs, 30)
    assert (got[:, 0] == logits[0].argmax()).all() and (got[:, 2] == logits[2].argmax()).all()
    assert set(got[:, 1].tolist()) <= set(logits[1].topk(4).indices.tolist())
    assert len(set(got[:, 1].tolist())) > 1  # drawn, not the argmax each time


def test_the_short_path_draws_the_same_on_the_host_and_on_the_device():
    """The top-k draw on the logits' device (an overlapped step's: its tokens stay there) is the
    host's draw, the same candidates and race: on the CPU, with the same generators, the same
    tokens, greedy rows beside included."""
    logits = torch.randn(3, V) * 2
    params = (SamplingParams(temperature=0.9, top_k=6, top_p=0.8, seed=11), SamplingParams(temperature=0.0),
              SamplingParams(temperature=1.2, top_k=3, min_p=0.1, seed=12))
    on_device = build_sampling_batch(reqs(*params), V, {0}, "cpu", host_draws=False)
    assert on_device.top_k_max == 6 and not on_device.draw_on_host
    assert build_sampling_batch(reqs(*params), V, {0}, "cpu").draw_on_host
    host, device = draw(logits, reqs(*params), 40), draw(logits, reqs(*params), 40, host_draws=False)
    assert torch.equal(host, device) and len(set(host[:, 0].tolist())) > 1
    assert (host[:, 1] == logits[1].argmax()).all()


def test_logit_bias_moves_the_logits_it_names():
    """OpenAI's logit_bias: added to those tokens' logits before sampling (greedy rows too);
    +100 forces a token, -100 bans it."""
    logits = torch.randn(2, V)
    top = int(logits[0].argmax())
    forced = reqs(SamplingParams(temperature=0.0, logit_bias=((7, 100.0),)),
                  SamplingParams(temperature=0.0, logit_bias=((top, -100.0),)))
    got = draw(logits, forced, 3)
    assert (got[:, 0] == 7).all() and (got[:, 1] != top).all()
    b = build_sampling_batch(forced, V, {0}, "cpu")
    assert b.adjusts and b.bias[0, 7] == 100.0 and b.bias[1, top] == -100.0 and b.bias.count_nonzero() == 2
    sampled = reqs(SamplingParams(temperature=1.0, top_k=5, seed=1, logit_bias=((3, 100.0),)))
    assert (draw(logits[:1], sampled, 20) == 3).all()  # the short path sees the biased logits
    with pytest.raises(SamplingParamError, match="logit_bias"):
        SamplingParams(logit_bias=((1, 101.0),)).validate()
    with pytest.raises(SamplingParamError, match="logit_bias"):
        SamplingParams(logit_bias=((-1, 1.0),)).validate()


def test_filter_keeps_best_token():
    logits = torch.randn(1, V)
    b = build_sampling_batch(reqs(SamplingParams(top_p=1e-6, min_p=1.0)), V, {0}, "cpu")
    kept = torch.isfinite(filter_logits(logits, b))[0]
    assert kept.sum() == 1 and kept[logits[0].argmax()]


@pytest.mark.parametrize("field,value,needle", [
    ("top_p", 0.0, "top_p"), ("top_p", 1.5, "(0, 1]"), ("temperature", -1.0, "temperature"),
    ("top_k", -2, "top_k"), ("min_p", 2.0, "min_p"), ("max_tokens", 0, "max_tokens"),
    ("repetition_penalty", 0.0, "repetition_penalty"), ("presence_penalty", 3.0, "presence_penalty"),
    ("logprobs", 21, "logprobs"), ("n", 2, "n=1"), ("min_tokens", 50, "min_tokens"), ("stop", ("",), "stop"),
])
def test_validation_messages(field, value, needle):
    with pytest.raises(SamplingParamError) as e:
        SamplingParams(**{field: value}).validate()
    assert e.value.param == field and needle in str(e.value)


@pytest.mark.parametrize("temperature", [1e-40, 1e-30, 1e-8, 1e-6])
def test_tiny_temperatures_are_greedy_not_token_zero(temperature):
    """Dividing logits by 1e-40 overflows to inf and the softmax to NaN (which argmaxed to token 0)."""
    torch.manual_seed(1)
    logits = torch.randn(4, V) * 3
    logits[:, 0] = -5.0  # token 0 is never the best
    rs = reqs(*[SamplingParams(temperature=temperature, seed=s) for s in range(4)])
    got = draw(logits, rs, 20)
    assert (got == logits.argmax(-1)).all()


def test_sampling_is_finite_over_the_accepted_range_edges():
    """Extreme but valid parameters: the draw stays among the tokens the parameters allow, never NaN's token 0."""
    torch.manual_seed(2)
    logits = torch.randn(3, V) * 3
    logits[:, 0] = -5.0
    prompt = (5, 6, 7, 8)
    tiny_rep, huge_rep, hot = (SamplingParams(repetition_penalty=1e-40, seed=1),
                               SamplingParams(repetition_penalty=10.0, temperature=100.0, seed=2),
                               SamplingParams(temperature=100.0, top_p=1e-40, seed=3))
    got = draw(logits, reqs(tiny_rep, huge_rep, hot, prompt=prompt), 50)
    # repetition 1e-40 makes every positive prompt token's logit huge: only those can be drawn
    boosted = {t for t in prompt if logits[0, t] > 0}
    assert boosted and set(got[:, 0].tolist()) <= boosted
    assert 0 not in set(got[:, 1].tolist()) or logits[1].argmax() == 0
    assert len(set(got[:, 1].tolist())) > 5  # temperature 100 is close to uniform, and finite
    assert (got[:, 2] == logits[2].argmax()).all()  # top_p 1e-40 keeps the best token only
    b = build_sampling_batch(reqs(tiny_rep, prompt=prompt), V, {0}, "cpu")
    assert torch.isfinite(apply_penalties(logits[:1], b)).all()


def test_filtered_candidates_keep_the_filtered_distribution():
    """Where every sampling row has a top-k, sampling draws among each row's top-k_max tokens
    (no sort of the vocabulary): the same probabilities as the full filter, row by row."""
    g = torch.Generator().manual_seed(5)
    logits = torch.randn(4, V, generator=g) * 3
    rs = reqs(SamplingParams(top_k=7, top_p=0.6, temperature=0.7), SamplingParams(top_k=3),
              SamplingParams(top_k=12, min_p=0.1, temperature=1.5), SamplingParams(temperature=0.0))
    b = build_sampling_batch(rs, V, {0}, "cpu")
    assert b.top_k_max == 12 and not b.adjusts
    full = filter_logits(logits, b).softmax(-1)
    best, ids = logits.topk(b.top_k_max, dim=-1)
    mine = torch.zeros_like(full).scatter_(1, ids, filter_candidates(best, b).softmax(-1))
    assert torch.allclose(mine[:3], full[:3], atol=1e-6)


def test_top_k_rows_draw_the_right_distribution_by_the_short_path():
    logits = torch.tensor([[2.0, 1.0, 0.0, -0.5] + [-3.0] * (V - 4)])
    rs = reqs(SamplingParams(temperature=1.0, top_k=3, seed=4))
    assert build_sampling_batch(rs, V, {0}, "cpu").top_k_max == 3
    got = draw(logits, rs, 3000)[:, 0]
    freq = torch.bincount(got, minlength=V).float() / 3000
    assert freq[3:].sum() == 0
    assert torch.allclose(freq[:3], logits[0, :3].softmax(-1), atol=0.03)
    again = [draw(logits, reqs(SamplingParams(temperature=1.0, top_k=3, seed=4)), 20) for _ in range(2)]
    assert torch.equal(*again)  # a seed reproduces


def test_batch_flags_say_when_the_general_path_is_needed():
    def flags(*params, outputs=()):
        b = build_sampling_batch(reqs(*params, outputs=outputs), V, {0}, "cpu")
        return b.adjusts, b.top_k_max
    assert flags(SamplingParams(top_k=5), SamplingParams(temperature=0.0)) == (False, 5)  # greedy rows need no top-k
    assert flags(SamplingParams(top_k=5), SamplingParams()) == (False, 0)  # a sampling row without top-k
    assert flags(SamplingParams(top_k=5, presence_penalty=0.5))[0]
    assert flags(SamplingParams(top_k=5, repetition_penalty=1.2))[0]
    assert flags(SamplingParams(top_k=5, min_tokens=4), outputs=(1,))[0]
    assert not flags(SamplingParams(top_k=5, min_tokens=1), outputs=(1,))[0]


def test_the_repetition_set_follows_the_outputs_step_by_step():
    """The request keeps its repetition-penalty mask from step to step and marks only the new
    outputs: after each step it is exactly the set of the prompt's and outputs' tokens (also
    when it starts with outputs already, e.g. after a preemption), and a batch of another
    vocabulary size gets a fresh one."""
    import random

    rng = random.Random(4)
    r = Request("r", [rng.randrange(V) for _ in range(30)], SamplingParams(repetition_penalty=1.3))
    r.output_ids = [3, 4]
    for step in range(40):
        b = build_sampling_batch([r], V, {0}, "cpu")
        want = torch.zeros(V, dtype=torch.bool)
        want[torch.tensor(r.all_ids)] = True
        assert torch.equal(b.seen[0], want), step
        r.output_ids.append(rng.randrange(V))
    wider = build_sampling_batch([r], V + 7, {0}, "cpu")
    assert wider.seen.shape == (1, V + 7) and int(wider.seen[0].sum()) == len(set(r.all_ids))


def test_building_a_batch_never_sets_a_scalar_through_an_index_tensor(monkeypatch):
    """`x[ids] = True` with ids a tensor: PyTorch makes the True a host tensor and, on CUDA, copies
    it to the device synchronously, so the host waits for the step in flight (what failed the GPU
    test `test_launching_a_steps_sampling_never_waits_for_the_device` on the H200). Checked here on
    the CPU for a batch with every input: no such assignment happens."""
    scalar_sets = []
    setitem = torch.Tensor.__setitem__

    def watch(self, index, value):
        parts = index if isinstance(index, tuple) else (index,)
        if any(isinstance(p, torch.Tensor) for p in parts) and not isinstance(value, torch.Tensor):
            scalar_sets.append((tuple(type(p).__name__ for p in parts), value))
        return setitem(self, index, value)

    monkeypatch.setattr(torch.Tensor, "__setitem__", watch)
    params = [SamplingParams(temperature=0.9, repetition_penalty=1.05, presence_penalty=0.5, frequency_penalty=0.2,
                             logit_bias=((7, 2.0),), min_tokens=6, seed=2), SamplingParams(temperature=0.0)]
    reqs = [Request(f"r{i}", list(range(10, 30)), p) for i, p in enumerate(params)]
    for r in reqs:
        r.output_ids = [3, 4, 5]
    for _ in range(2):  # the repetition mask made, then marked incrementally
        b = build_sampling_batch(reqs, V, {0}, "cpu")
        for r in reqs:
            r.output_ids.append(9)
    assert not scalar_sets, scalar_sets
    assert bool(b.banned[0, 0]) and bool(b.seen[0, 9]) and bool(b.seen[0, 10]) and not bool(b.seen[0, 8])
