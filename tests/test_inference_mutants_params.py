"""What a request may ask for (tetrad.inference.core.params): every rule at its exact edge, the value
just inside accepted and the one just outside refused, and each type rule on its own; the stop
policy at the exact token count; stop strings held back only while they can still complete."""

import math
import re
from pathlib import Path

import pytest

from tetrad.errors import ConfigError
from tetrad.inference.core import params
from tetrad.inference.core.params import SamplingParams, apply_stop_strings

EDGES = [  # (field, the last accepted values, the first refused values)
    ("temperature", [0, 0.0, 1e-9, 7], [-1e-9, -1]),
    ("top_p", [1, 1.0, 1e-9], [0, 0.0, 1 + 1e-9, -0.5]),
    ("top_k", [0, 1, 1000], [-1]),
    ("repetition_penalty", [1e-9, 1, 2.5], [0, 0.0, -1]),
    ("n", [1, 2], [0, -1]),
    ("max_tokens", [1, 2, None], [0, -1]),
    ("seed", [None, 0, -5, 2**70], []),
    # OpenAI's API allows up to 20 top log-probabilities per token.
    ("logprobs", [None, 0, 1, 20], [-1, 21]),
    ("prompt_logprobs", [None, 0, 20], [-1, 21]),
]


@pytest.mark.parametrize("name,accepted,refused", EDGES)
def test_each_rule_holds_exactly_at_its_edge(name, accepted, refused):
    for value in accepted:
        assert getattr(SamplingParams(**{name: value}), name) == value
    for value in refused:
        with pytest.raises(ConfigError, match=f"{name} must be"):
            SamplingParams(**{name: value})


@pytest.mark.parametrize("name", ["temperature", "top_p", "repetition_penalty"])
def test_a_real_field_refuses_infinity_nan_booleans_and_strings(name):
    for value in (math.inf, -math.inf, math.nan, True, False, "1"):
        with pytest.raises(ConfigError, match=f"{name} must be a finite number"):
            SamplingParams(**{name: value})


@pytest.mark.parametrize("name", ["top_k", "n", "max_tokens", "seed", "logprobs",
                                  "prompt_logprobs"])
def test_an_integer_field_refuses_reals_booleans_and_strings(name):
    for value in (1.0, 2.5, True, "3"):
        with pytest.raises(ConfigError, match=f"{name} must be an integer"):
            SamplingParams(**{name: value})


def test_stop_lists_and_flags_are_checked_item_by_item():
    assert SamplingParams(stop=["a", "bc"]).stop == ("a", "bc")
    assert SamplingParams(stop_token_ids=[0, 7]).stop_token_ids == (0, 7)
    for bad in (dict(stop=["a", ""]), dict(stop=["a", 5]), dict(stop=5),
                dict(stop_token_ids=[1, True]), dict(stop_token_ids=[1, "2"]),
                dict(stop_token_ids=3), dict(ignore_eos=1), dict(ignore_eos="yes")):
        with pytest.raises(ConfigError):
            SamplingParams(**bad)
    assert SamplingParams(ignore_eos=True).ignore_eos is True


def test_greedy_is_a_temperature_below_the_greedy_threshold():
    assert SamplingParams(temperature=0).greedy
    assert SamplingParams(temperature=params.GREEDY_TEMPERATURE / 2).greedy
    assert not SamplingParams(temperature=params.GREEDY_TEMPERATURE).greedy
    assert not SamplingParams(temperature=1).greedy


def test_the_stop_policy_at_the_exact_token_count():
    limited = SamplingParams(max_tokens=4)
    assert [params.check_stop_token(limited, 5, count, (2,)) for count in (3, 4, 5)] == [
        None, "length", "length"]
    unlimited = SamplingParams()
    assert params.check_stop_token(unlimited, 5, 10**6, (2,)) is None
    assert params.check_stop_token(unlimited, 2, 1, (2,)) == "stop"
    assert params.check_stop_token(unlimited, 2, 1, ()) is None
    both = SamplingParams(ignore_eos=True, stop_token_ids=[2])  # an explicit stop id still stops
    assert params.check_stop_token(both, 2, 1, (2,)) == "stop"


def test_a_tail_is_held_back_only_while_it_can_still_become_a_stop_string():
    stops = SamplingParams(stop=["abc", "xy"])
    assert apply_stop_strings(stops, "hello ab") == ("hello ", False, 2)
    assert apply_stop_strings(stops, "hello a") == ("hello ", False, 1)
    assert apply_stop_strings(stops, "hello x") == ("hello ", False, 1)
    assert apply_stop_strings(stops, "hello b") == ("hello b", False, 0)
    assert apply_stop_strings(stops, "ab") == ("", False, 2)  # the whole text may be held
    assert apply_stop_strings(stops, "a") == ("", False, 1)
    assert apply_stop_strings(stops, "") == ("", False, 0)
    assert apply_stop_strings(stops, "xyabc") == ("", True, 0)  # a match at index 0
    assert apply_stop_strings(SamplingParams(), "abc") == ("abc", False, 0)
    # A full stop string is never held back as its own prefix: it is a hit.
    assert apply_stop_strings(SamplingParams(stop=["ab"]), "zab") == ("z", True, 0)


def test_the_stop_string_limit_is_the_documented_default():
    table = (Path(__file__).parent.parent / "docs" / "serving.md").read_text()
    documented = re.search(r"^\| `--max-stop-strings` \| (\d+) \|", table, re.MULTILINE)
    assert int(documented.group(1)) == params.DEFAULT_MAX_STOP_STRINGS
