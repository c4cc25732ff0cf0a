"""Sampler: the batched logits processors equal HF's row by row, seeded draws are reproducible
whatever shares the batch, draws follow the filtered distribution, tiny temperatures are greedy,
log-probabilities; and the stop policy (tokens, max_tokens, stop strings held back while
streaming)."""

import pytest
import torch
from transformers.generation.logits_process import (RepetitionPenaltyLogitsProcessor,
                                                    TemperatureLogitsWarper, TopKLogitsWarper,
                                                    TopPLogitsWarper)

from tetrad.inference.core.params import SamplingParams, apply_stop_strings, check_stop_token
from tetrad.inference.worker.sampler import Sampler, apply_repetition_penalty, warp


class Seq:
    def __init__(self, params, token_ids=(1, 2), index=0):
        self.params, self.token_ids, self.index = params, list(token_ids), index
        self.generator = None


def ids(output):
    return output.token_ids.tolist()


def test_batched_warping_equals_hf_logits_warpers_row_by_row():
    torch.manual_seed(0)
    settings = [(0.7, 0, 1.0), (1.3, 5, 1.0), (1.0, 0, 0.8), (0.5, 20, 0.5), (1.0, 0, 0.05),
                (1.0, 0, 1.0)]
    logits = torch.randn(len(settings), 50) * 3
    temperature, top_k, top_p = (torch.tensor(column, dtype=torch.float)
                                 for column in zip(*settings))
    ours = warp(logits, temperature, top_k, top_p)
    for row, (t, k, p) in enumerate(settings):
        expected = TemperatureLogitsWarper(t)(None, logits[row:row + 1].clone())
        if k:
            expected = TopKLogitsWarper(k)(None, expected)
        if p < 1:
            expected = TopPLogitsWarper(p)(None, expected)
        assert torch.equal(ours[row].isinf(), expected[0].isinf()), row
        torch.testing.assert_close(ours[row][~ours[row].isinf()], expected[0][~expected[0].isinf()])


def test_repetition_penalty_equals_hf():
    torch.manual_seed(1)
    logits = torch.randn(2, 30)
    histories = [[3, 7, 7, 12, 29], [0, 5]]
    seen = torch.zeros(2, 30, dtype=torch.bool)
    for row, history in enumerate(histories):
        seen[row, history] = True
    ours = apply_repetition_penalty(logits, seen, torch.tensor([1.3, 0.8]))
    for row, (history, penalty) in enumerate(zip(histories, (1.3, 0.8))):
        expected = RepetitionPenaltyLogitsProcessor(penalty)(torch.tensor([history]),
                                                             logits[row:row + 1].clone())
        torch.testing.assert_close(ours[row], expected[0])


def test_greedy_takes_the_argmax_and_the_penalty_can_change_it():
    logits = torch.tensor([[0.0, 5.0, 4.0, 1.0], [2.0, -1.0, 0.0, 0.0]])
    greedy = SamplingParams(temperature=0)
    assert ids(Sampler()(logits, [Seq(greedy), Seq(greedy)])) == [1, 0]
    penalized = SamplingParams(temperature=0, repetition_penalty=2.0)
    assert ids(Sampler()(logits, [Seq(penalized, token_ids=[1]), Seq(greedy)])) == [2, 0]


def test_a_tiny_temperature_is_greedy_not_nan():
    logits = torch.tensor([[0.0, 5.0, 4.0, 1.0]] * 2)
    for temperature in (1e-300, 1e-6):
        params = SamplingParams(temperature=temperature, seed=3)
        assert params.greedy
        output = Sampler()(logits, [Seq(params), Seq(SamplingParams(temperature=1e-300))], 2)
        assert ids(output) == [1, 1]
        assert torch.isfinite(output.logprobs).all() and torch.isfinite(output.top_logprobs).all()


def test_a_seed_fixes_the_draws_whatever_shares_the_batch_and_samples_differ():
    logits = torch.zeros(3, 1000)  # uniform: two streams agreeing on 8 draws would be a fluke
    params = SamplingParams(seed=1234)

    def draws(index, others):
        seq, sampler = Seq(params, index=index), Sampler(seed=others)
        neighbours = [Seq(SamplingParams(temperature=0.5 + others)), Seq(SamplingParams())]
        return [ids(sampler(logits[:1 + len(neighbours[:others])],
                            [seq] + neighbours[:others]))[0] for _ in range(8)]

    assert draws(0, others=0) == draws(0, others=1) == draws(0, others=2)
    assert draws(0, others=0) != draws(1, others=0)
    # No seed: the engine's own seed decides, still reproducible.
    unseeded = SamplingParams()
    runs = [[ids(Sampler(seed=5)(logits[:1], [Seq(unseeded)]))[0] for _ in range(3)]
            for _ in range(2)]
    assert runs[0] == runs[1]


def test_batched_draws_follow_each_rows_filtered_distribution():
    base = torch.log(torch.tensor([0.5, 0.3, 0.15, 0.05]))
    rows = [SamplingParams(top_k=2, seed=0), SamplingParams(top_p=0.7), SamplingParams(
        temperature=0.5), SamplingParams(temperature=0), SamplingParams(repetition_penalty=4.0)]
    seqs = [Seq(params, token_ids=[0]) for params in rows]
    sampler, draws = Sampler(), 4000
    picks = torch.stack([sampler(base.expand(len(rows), 4), seqs).token_ids
                         for _ in range(draws)])  # [draws, rows]
    freq = torch.stack([torch.bincount(picks[:, row], minlength=4) for row in range(len(rows))
                        ]).float() / draws
    sharpened = (base / 0.5).softmax(-1)
    penalized = base.clone()
    penalized[0] *= 4.0  # log-probabilities are negative: the penalty multiplies them
    expected = torch.stack([torch.tensor([0.5, 0.3, 0, 0]) / 0.8, torch.tensor([0.5, 0.3, 0, 0])
                            / 0.8, sharpened, torch.tensor([1.0, 0, 0, 0]), penalized.softmax(-1)])
    torch.testing.assert_close(freq, expected, atol=0.03, rtol=0)
    assert (freq[expected == 0] == 0).all()  # filtered tokens are never drawn


def test_top_k_filters_a_batch_with_fewer_rows_than_k():
    """Whether any row filters compares top_k with the vocabulary, not with the batch: a lone
    row with top_k 2 (of 4 tokens) never draws the two least likely tokens."""
    probs = torch.tensor([0.3, 0.3, 0.2, 0.2])
    sampler = Sampler()
    for rows in (1, 2):
        seqs = [Seq(SamplingParams(top_k=2)) for _ in range(rows)]
        picks = torch.cat([sampler(probs.log().expand(rows, 4), seqs).token_ids
                           for _ in range(300)])
        assert set(picks.tolist()) == {0, 1}


def test_logprobs_are_the_models_for_the_chosen_and_top_tokens():
    torch.manual_seed(2)
    logits = torch.randn(3, 40)
    seqs = [Seq(SamplingParams(temperature=0)), Seq(SamplingParams(seed=1)),
            Seq(SamplingParams(temperature=0, repetition_penalty=1.5))]
    output = Sampler()(logits, seqs, num_logprobs=3)
    reference = logits.log_softmax(-1)
    chosen = output.token_ids
    torch.testing.assert_close(output.logprobs, reference.gather(1, chosen[:, None])[:, 0])
    torch.testing.assert_close(output.top_logprobs, reference.topk(3).values)
    assert torch.equal(output.top_ids, reference.topk(3).indices)
    assert Sampler()(logits, seqs).logprobs is None


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


def kept(logits: torch.Tensor, top_k: int = 0, top_p: float = 1.0) -> list[int]:
    """The token ids warp leaves sampleable in a one-row batch."""
    row = warp(logits[None], torch.tensor([1.0]), torch.tensor([float(top_k)]),
               torch.tensor([top_p]))[0]
    return (~row.isinf()).nonzero().flatten().tolist()


# Probabilities 1/2, 1/4, 1/8, 1/8 exactly (log2 spacing): cumulative sums land exactly on 0.5,
# 0.75 and 0.875, so a top_p there tests the boundary itself, not a neighbourhood of it.
DYADIC = torch.log(torch.tensor([0.5, 0.25, 0.125, 0.125]))


def test_top_p_keeps_the_smallest_set_that_reaches_it_exactly_on_the_boundary():
    cumulative = DYADIC.softmax(-1).cumsum(-1)
    assert cumulative[:3].tolist() == [0.5, 0.75, 0.875]  # the premise: exact sums
    # Reaching top_p is enough: a token is dropped once the ones above it sum to top_p or more.
    assert kept(DYADIC, top_p=0.5) == [0]
    assert kept(DYADIC, top_p=0.75) == [0, 1]
    assert kept(DYADIC, top_p=0.875) == [0, 1, 2]
    assert kept(DYADIC, top_p=0.7500001) == [0, 1, 2]
    # HF's warper keeps as many on the boundary (which of the tied 1/8s it keeps may differ).
    for top_p in (0.5, 0.75, 0.875):
        expected = TopPLogitsWarper(top_p)(None, DYADIC[None].clone())[0]
        assert len(kept(DYADIC, top_p=top_p)) == int((~expected.isinf()).sum()), top_p
    # Sampled with a fixed seed, a row with top_p 0.75 draws both kept tokens and nothing else.
    seq, sampler = Seq(SamplingParams(top_p=0.75, seed=11)), Sampler()
    draws = {ids(sampler(DYADIC[None], [seq]))[0] for _ in range(400)}
    assert draws == {0, 1}


def test_top_p_one_is_off_even_where_a_float_cumulative_sum_reaches_one_early():
    logits = torch.tensor([0.0, -30.0, -31.0])  # the first probability rounds to 1.0 in fp32
    assert logits.softmax(-1).cumsum(-1)[0].item() == 1.0  # the premise
    assert kept(logits, top_p=1.0) == [0, 1, 2]
    assert kept(logits, top_p=0.999) == [0]


def test_top_k_keeps_every_token_tied_with_the_kth():
    logits = torch.tensor([3.0, 2.0, 2.0, 1.0, 2.0])
    assert kept(logits, top_k=2) == [0, 1, 2, 4]
    assert kept(logits, top_k=1) == [0]
    assert kept(logits, top_k=4) == [0, 1, 2, 4]
    assert kept(logits, top_k=0) == kept(logits, top_k=5) == [0, 1, 2, 3, 4]  # off
    # top-k first, then top-p renormalized over what is left (HF's order): top_k=2 leaves 3.0
    # and three 2.0s, of probabilities e/(e+3) = 0.475 and 0.175 each; the first two sum to
    # 0.65 < 0.7, so a third is needed.
    survivors = kept(logits, top_k=2, top_p=0.7)
    assert survivors[0] == 0 and len(survivors) == 3


def test_two_stop_strings_cut_at_the_earliest_match_whichever_is_listed_first():
    params = SamplingParams(stop=["world", "##"])  # the one listed second occurs first
    assert apply_stop_strings(params, "hello ## world") == ("hello ", True, 0)
    assert apply_stop_strings(params.replace(stop=["##", "world"]), "hello ## world") == (
        "hello ", True, 0)
    # Overlapping candidates: "abcd" starts before "bc" ends; the earlier start wins.
    assert apply_stop_strings(SamplingParams(stop=["bc", "abcd"]), "xabcde") == ("x", True, 0)


def test_the_longest_held_back_prefix_wins_over_a_shorter_one_of_another_stop_string():
    # "abc" may become "abcd" (hold 3); "c" alone may become "cx" (hold 1): hold the 3.
    params = SamplingParams(stop=["abcd", "cx"])
    assert apply_stop_strings(params, "zabc") == ("z", False, 3)
    assert apply_stop_strings(params.replace(stop=["cx", "abcd"]), "zabc") == ("z", False, 3)
    # Within one stop string too: "abab" and "ab" both start "abab!"; hold the longer.
    assert apply_stop_strings(SamplingParams(stop=["abab!"]), "xabab") == ("x", False, 4)


def test_a_stop_string_split_over_tokens_is_never_shown_and_stops_at_its_last_token():
    from tetrad.inference.core.output import Detokenizer
    from tetrad.tokenizer import ByteTokenizer

    tokenizer = ByteTokenizer()
    text = "fine ENxEND xx more"
    detokenizer = Detokenizer(tokenizer, SamplingParams(stop=["END", "xx"]))
    shown, stopped_at = [""], None
    for position, token in enumerate(tokenizer.encode(text)):
        delta, stopped = detokenizer.add([token])
        shown.append(shown[-1] + delta)
        if stopped:
            stopped_at = position
            break
    # The cut is at "END" (listed first, and earlier in the text than "xx"), found at its last
    # byte. The stream grew through prefixes of the final text, each held back while it could
    # still start a stop string: "E" and "EN" wait (for "END"), then "x" waits (for "xx").
    assert stopped_at == text.index("END") + len("END") - 1
    assert shown[-1] == detokenizer.text == "fine ENx"
    assert sorted(set(shown), key=len) == [text[:i] for i in range(6)] + ["fine EN", "fine ENx"]


def test_the_penalty_skips_history_ids_past_the_models_vocabulary():
    """A tokenizer may know more ids than the model can emit (ids >= vocab have no logit): the
    penalty ignores them instead of indexing past the row."""
    logits = torch.tensor([[0.0, 5.0, 4.0, 1.0]])
    params = SamplingParams(temperature=0, repetition_penalty=2.0)
    for history in ([1], [1, 4], [1, 4, 9]):
        assert ids(Sampler()(logits, [Seq(params, token_ids=history)])) == [2], history
