"""The stage contract (framework/parallel/pipeline/stage.py) as the model meets it: a
layer weight that does not go through `weight_op` would get a zero gradient from the
zero-bubble split backward's W half, which replays the weight ops only. The engine
refuses it when it is built, before anything is traced or compiled."""

import dataclasses

import flax.linen as nn
import jax.numpy as jnp
import pytest

from framework.errors import PlanError
from framework.model import llama
from tests.helpers import MODEL, engine


class BlockWithBias(llama.Block):
    """A Block with one more weight, added to the output directly (no weight_op)."""

    @nn.compact
    def __call__(self, x, cache=None, start=0):
        out = super().__call__(x, cache, start)
        bias = self.param("out_bias", nn.initializers.zeros, (x.shape[-1],), jnp.float32)
        return out + bias.astype(out.dtype)


def test_every_block_weight_goes_through_weight_op():
    assert llama.weights_outside_weight_op(MODEL) == []


@pytest.mark.parametrize("schedule", ["zb_h1", "zb_v"])
def test_a_weight_that_bypasses_weight_op_is_refused_when_the_engine_is_built(
        monkeypatch, schedule):
    # A model config of its own: what is cached per config (the parameter axes, the
    # check) then never reaches another test.
    model = dataclasses.replace(MODEL, d_ff=136)
    monkeypatch.setattr(llama, "Block", BlockWithBias)
    assert llama.weights_outside_weight_op(model) == ["out_bias"]
    with pytest.raises(PlanError, match="out_bias.*zero gradient"):
        engine(2, 1, 1, 4, model=model, schedule=schedule)
    engine(2, 1, 1, 4, model=model, schedule="1f1b")  # the whole VJP: no split, no refusal
