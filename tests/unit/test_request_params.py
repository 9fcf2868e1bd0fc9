"""The values a request and the engine are built from refuse what they cannot run, by name:
the in-process API has no parser in front of it."""

from __future__ import annotations

import pytest

from tiny_mindie.engine.engine import EngineLimits
from tiny_mindie.engine.request import GenerationParams
from tiny_mindie.model.options import BackendOptions


@pytest.mark.parametrize(("fields", "message"), [
    ({"top_k": 2.5}, "top_k must be an int, got 2.5"),
    ({"max_new_tokens": "8"}, "max_new_tokens must be an int"),
    ({"n": True}, "n must be an int, got True"),
    ({"temperature": "0.5"}, "temperature must be a number, got '0.5'"),
    ({"ignore_eos": 1}, "ignore_eos must be True or False"),
    ({"do_sample": "yes"}, "do_sample must be True, False or None"),
    ({"seed": 1.0}, "seed must be an int or None"),
    ({"timeout_s": "1"}, "timeout_s must be a number or None"),
    ({"stop": ["a", 3]}, "stop must be a string or a list of strings"),
    ({"stop_token_ids": [1, "2"]}, "stop_token_ids must be a list of ints"),
])
def test_a_field_of_the_wrong_type_is_a_type_error_naming_it(fields, message):
    with pytest.raises(TypeError, match=message):
        GenerationParams(**fields)


def test_one_stop_string_is_one_stop_and_right_types_pass():
    p = GenerationParams(stop="and", top_k=3, temperature=1, seed=None, timeout_s=2)
    assert p.stop == ("and",)
    assert p.requests([1, 2])[0].stop.stop_strings == ("and",)


@pytest.mark.parametrize(("build", "message"), [
    (lambda: EngineLimits(max_seq_len=0), "max_seq_len must be > 0, got 0"),
    (lambda: EngineLimits(max_input_len=-5), "max_input_len must be > 0"),
    (lambda: EngineLimits(e2e_timeout_s=0), "e2e_timeout_s must be > 0"),
    (lambda: BackendOptions(threads=-1), "threads must be >= 0, got -1"),
    (lambda: BackendOptions(parallel_runs=-2), "parallel_runs must be >= 0"),
])
def test_limits_and_options_out_of_range_are_value_errors(build, message):
    with pytest.raises(ValueError, match=message):
        build()
