"""The request bookkeeping (tetrad.inference.core.tracker) and what it hands back
(tetrad.inference.core.output), checked against independent references: streamed deltas concatenate to
the full-recompute greedy ids and the tokenizer's own decode of them, log-probabilities are the
model's own log-softmax, an abort finishes exactly the aborted request, and views and merged views
carry exactly the deltas of the steps they stand for."""

import queue

import torch
from test_engine import GREEDY, PROMPTS, engine, random_model, reference_greedy

from tetrad.inference.core import output as output_module
from tetrad.inference.core import tracker as tracker_module
from tetrad.inference.core.params import SamplingParams
from tetrad.tokenizer import ByteTokenizer


def run_collecting(llm):
    """Step to the end; per request id, the outputs of the steps that touched it, in order."""
    steps: dict[str, list] = {}
    while llm.has_unfinished():
        for out in llm.step():
            steps.setdefault(out.request_id, []).append(out.view())
    return steps


def model_logprobs(model, ids):
    """log_softmax of a full forward over ids: row i scores the token after ids[i]."""
    with torch.no_grad():
        return model(torch.tensor([ids]))[0].float().log_softmax(-1)


def test_streamed_deltas_and_logprobs_add_up_to_the_full_recompute_output():
    model = random_model()
    llm = engine(model, max_num_batched_tokens=7)  # prompts in chunks: steps with no new token
    params = GREEDY.replace(max_tokens=5, logprobs=2, prompt_logprobs=1)
    ids = [llm.add_request(prompt, params) for prompt in PROMPTS[:2]]
    steps = run_collecting(llm)
    tokenizer = ByteTokenizer()
    for request_id, prompt in zip(ids, PROMPTS[:2]):
        views = steps[request_id]
        final = views[-1]
        expected = reference_greedy(model, prompt, 5)
        completion = final.outputs[0]
        deltas = [view.outputs[0] for view in views]
        assert completion.token_ids == expected
        assert sum((d.delta_token_ids for d in deltas), []) == expected
        assert "".join(d.delta_text for d in deltas) == completion.text == tokenizer.decode(
            expected)
        # Only the last step finishes the request; every step before it is unfinished.
        assert [view.finished for view in views] == [False] * (len(views) - 1) + [True]
        assert completion.finish_reason == "length"
        assert final.arrival_time <= final.first_token_time <= final.finish_time
        # The first token arrives in the step whose delta holds it, not before.
        first = next(i for i, d in enumerate(deltas) if d.delta_token_ids)
        assert all(not d.delta_token_ids for d in deltas[:first])
        scores = model_logprobs(model, prompt + expected)
        assert [lp.token_id for lp in completion.logprobs] == expected
        assert sum((d.delta_logprobs for d in deltas), []) == completion.logprobs
        for position, lp in enumerate(completion.logprobs, len(prompt) - 1):
            assert abs(lp.logprob - scores[position, lp.token_id].item()) < 1e-4
            top = scores[position].topk(2)
            assert [t for t, _ in lp.top] == top.indices.tolist()
        # Prompt log-probabilities: none for the first token, the model's for the others.
        assert final.prompt_logprobs[0] is None
        for position, lp in enumerate(final.prompt_logprobs[1:], 1):
            assert lp.token_id == prompt[position]
            assert abs(lp.logprob - scores[position - 1, prompt[position]].item()) < 1e-4


def test_a_repeated_prompt_reports_the_tokens_the_prefix_cache_served():
    llm = engine(random_model())  # blocks of 4
    prompt = PROMPTS[0]  # 12 tokens: 3 full blocks, the last of which holds the last token
    first = llm.generate([prompt], GREEDY.replace(max_tokens=2))[0]
    again = llm.generate([prompt], GREEDY.replace(max_tokens=2))[0]
    assert first.num_cached_tokens == 0
    # Every full block but the one the last prompt token needs recomputed for its logits.
    assert again.num_cached_tokens == (len(prompt) - 1) // 4 * 4 == 8


def test_an_abort_finishes_only_that_request_and_an_unknown_id_is_ignored():
    model = random_model()
    llm = engine(model)
    params = GREEDY.replace(max_tokens=6)
    kept = llm.add_request(PROMPTS[1], params)
    aborted = llm.add_request(PROMPTS[2], params)
    llm.step()
    llm.step()
    llm.abort(aborted)
    llm.abort("no-such-request")
    outputs = {out.request_id: out for out in llm.step()}
    assert outputs[aborted].finished and outputs[aborted].outputs[0].finish_reason == "abort"
    assert not outputs[kept].finished
    steps = run_collecting(llm)
    assert aborted not in steps  # a finished request is never touched again
    assert steps[kept][-1].token_ids == reference_greedy(model, PROMPTS[1], 6)
    assert llm.block_manager.num_used_blocks == 0 and not llm.tracker.requests


def test_a_request_of_n_samples_finishes_when_its_last_sample_does():
    llm = engine(random_model())
    params = SamplingParams(temperature=1.0, seed=1, max_tokens=4, ignore_eos=True, n=3)
    request_id = llm.add_request(PROMPTS[1], params)
    steps = run_collecting(llm)[request_id]
    final = steps[-1]
    assert [view.finished for view in steps].count(True) == 1 and final.finished
    assert [c.finish_reason for c in final.outputs] == ["length"] * 3
    assert [len(c.token_ids) for c in final.outputs] == [4] * 3
    assert not llm.tracker.requests


def test_a_drained_queue_yields_its_items_in_order_then_stops():
    items = queue.SimpleQueue()
    for item in (3, 1, 2):
        items.put(item)
    assert list(tracker_module.iter_queue(items)) == [3, 1, 2]
    assert list(tracker_module.iter_queue(items)) == []


def completion(index, **fields):
    return output_module.CompletionOutput(index, **fields)


def test_a_view_of_an_unfinished_output_carries_only_its_deltas_and_then_joins_them():
    request = output_module.RequestOutput("r", None, [1, 2], [
        completion(0, token_ids=[7, 8, 9], text="abc", delta_text="c", delta_token_ids=[9]),
        completion(1, token_ids=[4], text="d", delta_text="d", delta_token_ids=[4])])
    view = request.view()
    assert [c.token_ids for c in view.outputs] == [[], []] and view.outputs[0].text == ""
    assert [c.delta_token_ids for c in view.outputs] == [[9], [4]]
    assert view.outputs[0] is not request.outputs[0]
    later = output_module.RequestOutput("r", None, [1, 2], [
        completion(0, token_ids=[7, 8, 9, 5], delta_text="e", delta_token_ids=[5]),
        completion(1, token_ids=[4, 6], delta_text="f", delta_token_ids=[6])], finished=True)
    joined = view.then(later.view())
    assert [c.delta_token_ids for c in joined.outputs] == [[9, 5], [4, 6]]
    assert [c.delta_text for c in joined.outputs] == ["ce", "df"]
    assert joined.finished and joined.token_ids == [7, 8, 9, 5]
    # A finished output's view copies each completion whole, so later edits of one don't leak.
    finished = later.view()
    finished.outputs[0].delta_text = "changed"
    assert later.outputs[0].delta_text == "e" and finished.outputs[1].token_ids == [4, 6]


def test_the_detokenizer_waits_for_a_whole_character_and_flushes_at_the_end():
    tokenizer = ByteTokenizer()
    text = "aé€b"
    ids = tokenizer.encode(text)  # 1 + 2 + 3 + 1 bytes
    detokenizer = output_module.Detokenizer(tokenizer, SamplingParams())
    deltas = [detokenizer.add([token])[0] for token in ids]
    assert "".join(deltas) == text == detokenizer.text
    assert all(output_module.REPLACEMENT_CHAR not in delta for delta in deltas)
    assert deltas[:3] == ["a", "", "é"]  # the second byte of é completes it
    cut = output_module.Detokenizer(tokenizer, SamplingParams())
    assert cut.add(ids[:1]) == ("a", False)
    assert cut.add(ids[1:2]) == ("", False)  # half of é waits
    assert cut.add([], final=True) == (tokenizer.decode(ids[:2])[1:], False)  # then it shows
