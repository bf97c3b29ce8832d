"""A randomized search over valid configurations (tools/parity_search.py), with a fixed
seed: schedule, pipeline, data, tensor, microbatches, virtual stages, uneven stages,
overlapped or synchronous sends, sequence parallelism, ZeRO-1, remat, tied embeddings,
document masks, model families, sliding windows, soft-caps, bfloat16 parameters and
small model shapes drawn at random, each
configuration run twice, loss and every gradient leaf against the single-device
reference. Every registered schedule is in the draw. A longer sweep:
`python tools/parity_search.py --cases 200 --seed 1`."""

import os

import jax
import pytest

from tests.helpers import load_tool

SEED = int(os.environ.get("PARITY_SEARCH_SEED", "20261127"))
CASES = int(os.environ.get("PARITY_SEARCH_CASES", "3"))


@pytest.mark.slow
def test_random_configurations_match_the_reference_twice():
    search = load_tool("parity_search")
    failures = search.search(SEED, CASES, jax.devices())
    assert failures == [], "\n" + "\n".join(failures)
