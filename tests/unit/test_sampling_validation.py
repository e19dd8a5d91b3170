"""check_sampling's refusals name the field, its allowed range and the value sent (no server needed)."""

from __future__ import annotations

import pytest

from together_train_server.service.errors import ServiceError
from together_train_server.engines.types import SamplingParams
from together_train_server.service.validation import Limits, check_sampling


@pytest.mark.parametrize("top_k", [-1, 21, 100_000])
def test_top_k_prompt_logprobs_out_of_range_names_the_value(top_k):
    # Before: 'top_k_prompt_logprobs must be in [0, 20]' without the value that was sent.
    with pytest.raises(ServiceError) as ei:
        check_sampling([1, 2, 3], SamplingParams(max_tokens=2), num_samples=1, top_k_prompt_logprobs=top_k,
                       limits=Limits(vocab_size=100, max_seq_len=64))
    assert ei.value.code == "INVALID_ARGUMENT" and ei.value.key == "top_k_prompt_logprobs"
    assert f"top_k_prompt_logprobs must be in [0, 20], got {top_k}" in str(ei.value), str(ei.value)
