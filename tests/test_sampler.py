"""Sampler: logits processors equal HF's, seeded draws are reproducible and follow the
distribution, and the stop policy (tokens, max_tokens, stop strings held back while streaming)."""

import pytest
import torch
from transformers.generation.logits_process import (RepetitionPenaltyLogitsProcessor,
                                                    TemperatureLogitsWarper, TopKLogitsWarper,
                                                    TopPLogitsWarper)

from tetrad.inference.params import SamplingParams, apply_stop_strings, check_stop_token
from tetrad.inference.sampler import Sampler, apply_repetition_penalty, warp


class Seq:
    def __init__(self, params, token_ids=(1, 2), index=0):
        self.params, self.token_ids, self.index = params, list(token_ids), index
        self.generator = None


@pytest.mark.parametrize("temperature,top_k,top_p", [(0.7, 0, 1.0), (1.3, 5, 1.0), (1.0, 0, 0.8),
                                                     (0.5, 20, 0.5), (1.0, 0, 0.05)])
def test_warping_equals_hf_logits_warpers(temperature, top_k, top_p):
    torch.manual_seed(0)
    logits = torch.randn(4, 50) * 3
    expected = TemperatureLogitsWarper(temperature)(None, logits.clone())
    if top_k:
        expected = TopKLogitsWarper(top_k)(None, expected)
    if top_p < 1:
        expected = TopPLogitsWarper(top_p)(None, expected)
    params = SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p)
    ours = torch.stack([warp(row, params) for row in logits])
    assert torch.equal(ours.isinf(), expected.isinf())
    torch.testing.assert_close(ours[~ours.isinf()], expected[~expected.isinf()])


def test_repetition_penalty_equals_hf():
    torch.manual_seed(1)
    logits = torch.randn(1, 30)
    history = [3, 7, 7, 12, 29]
    expected = RepetitionPenaltyLogitsProcessor(1.3)(torch.tensor([history]), logits.clone())
    torch.testing.assert_close(apply_repetition_penalty(logits[0], history, 1.3), expected[0])


def test_greedy_takes_the_argmax_and_the_penalty_can_change_it():
    logits = torch.tensor([[0.0, 5.0, 4.0, 1.0], [2.0, -1.0, 0.0, 0.0]])
    greedy = SamplingParams(temperature=0)
    assert Sampler()(logits, [Seq(greedy), Seq(greedy)]) == [1, 0]
    penalized = SamplingParams(temperature=0, repetition_penalty=2.0)
    assert Sampler()(logits, [Seq(penalized, token_ids=[1]), Seq(greedy)]) == [2, 0]


def test_a_seed_fixes_the_draws_and_different_samples_differ():
    logits = torch.zeros(1, 1000)  # uniform: two streams agreeing on 8 draws would be a fluke
    params = SamplingParams(seed=1234)

    def draws(index):
        seq, sampler = Seq(params, index=index), Sampler(seed=99)
        return [sampler(logits, [seq])[0] for _ in range(8)]

    assert draws(0) == draws(0)
    assert draws(0) != draws(1)
    # No seed: the engine's own seed decides, still reproducible.
    unseeded = SamplingParams()
    runs = [[Sampler(seed=5)(logits, [Seq(unseeded)])[0] for _ in range(3)] for _ in range(2)]
    assert runs[0] == runs[1]


def test_draws_follow_the_filtered_distribution():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    sampler = Sampler()
    seq = Seq(SamplingParams(top_k=2, seed=0))
    counts = torch.bincount(torch.tensor([sampler(logits, [seq])[0] for _ in range(4000)]),
                            minlength=4)
    assert counts[2] == counts[3] == 0  # outside the top 2
    assert abs(counts[0] / 4000 - 0.5 / 0.8) < 0.03  # renormalized over the top 2
    seq = Seq(SamplingParams(top_p=0.7, seed=0))
    drawn = {sampler(logits, [seq])[0] for _ in range(500)}
    assert drawn == {0, 1}  # 0.5 < 0.7, 0.5 + 0.3 >= 0.7: the nucleus is two tokens


def test_stop_tokens_eos_and_max_tokens():
    params = SamplingParams(max_tokens=3, stop_token_ids=[9])
    assert check_stop_token(params, 9, 1, eos_token_ids=(2,)) == "stop"
    assert check_stop_token(params, 2, 1, eos_token_ids=(2,)) == "stop"
    assert check_stop_token(params.replace(ignore_eos=True), 2, 1, eos_token_ids=(2,)) is None
    assert check_stop_token(params, 5, 2, eos_token_ids=(2,)) is None
    assert check_stop_token(params, 5, 3, eos_token_ids=(2,)) == "length"


def test_stop_strings_cut_the_text_and_hold_back_a_partial_match():
    params = SamplingParams(stop=["###", "\nUser:"])
    assert apply_stop_strings(params, "hello ## world###more") == ("hello ## world", True, 0)
    assert apply_stop_strings(params, "hello\nUs") == ("hello", False, 3)  # may become "\nUser:"
    assert apply_stop_strings(params, "hello #") == ("hello ", False, 1)
    assert apply_stop_strings(params, "plain") == ("plain", False, 0)
    assert apply_stop_strings(SamplingParams(), "x###") == ("x###", False, 0)
