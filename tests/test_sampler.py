"""Greedy sampling: the most likely token after NaN counts as impossible and +inf as the largest
finite value, whatever path the sampler takes to it."""

from __future__ import annotations

import math

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from hybridmoe.engine.sampler import SamplingParams, sample


@settings(max_examples=400, deadline=None)
@given(
    logits=st.lists(
        st.one_of(
            st.floats(width=32),
            st.sampled_from([math.inf, -math.inf, math.nan, 0.0, 1.0]),  # ties too
        ),
        min_size=1,
        max_size=12,
    )
)
def test_greedy_takes_the_first_best_token_of_the_cleaned_logits(logits):
    t = torch.tensor(logits)
    cleaned = torch.nan_to_num(t, nan=-math.inf, posinf=torch.finfo(torch.float32).max)
    best = cleaned.max()
    expected = int(torch.nonzero(cleaned == best)[0]) if best > -math.inf else int(cleaned.argmax())
    assert sample(t, SamplingParams(temperature=0), None) == expected
