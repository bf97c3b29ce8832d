"""Validation before anything is compiled (framework/engine/validate.py): every rule on
the degrees, the schedule and the model's shape is one line naming the setting."""

import dataclasses

import pytest

from framework.config import ParallelConfig
from framework.engine.validate import validate
from framework.errors import ConfigError
from tests.helpers import MODEL, TRAIN


BAD = [  # (overrides, the setting the message must name)
    (dict(pipeline=2, data=2, tensor=1), "parallel.pipeline*data*tensor"),  # 4 != 8
    (dict(pipeline=3, data=1, tensor=1), "model.n_layers"),
    (dict(pipeline=1, data=8, tensor=1, microbatches=4), "train.global_batch_size"),
    (dict(pipeline=0, data=8, tensor=1), "parallel.pipeline"),
    (dict(pipeline=1, data=-3, tensor=1), "parallel.data"),
    (dict(pipeline=1, data=2, tensor=1, schedule="zigzag"), "parallel.schedule"),
]


@pytest.mark.parametrize("overrides,setting", BAD, ids=[s for _, s in BAD])
def test_bad_degrees_raise_one_clear_line(overrides, setting):
    with pytest.raises(ConfigError) as err:
        validate(MODEL, ParallelConfig(**overrides), TRAIN, 8)
    message = str(err.value)
    assert setting in message and "\n" not in message


def test_each_divisibility_rule_is_checked():
    cases = {
        "model.n_heads": dataclasses.replace(MODEL, n_heads=6, n_kv_heads=2, d_model=48),
        "model.n_kv_heads": dataclasses.replace(MODEL, n_kv_heads=2),  # tensor=4
        "model.d_ff": dataclasses.replace(MODEL, d_ff=130),
        "model.vocab_size": dataclasses.replace(MODEL, vocab_size=130),
    }
    for setting, model in cases.items():
        with pytest.raises(ConfigError, match=setting.replace(".", r"\.")):
            validate(model, ParallelConfig(pipeline=1, data=2, tensor=4), TRAIN, 8)


def test_data_minus_one_fills_devices_and_few_microbatches_warns():
    par = validate(MODEL, ParallelConfig(pipeline=2, data=-1, tensor=2, microbatches=2),
                   TRAIN, 8)
    assert par.data == 2
    with pytest.warns(UserWarning, match="bubble will exceed 50%"):
        validate(MODEL, ParallelConfig(pipeline=4, data=1, tensor=2, microbatches=2), TRAIN, 8)


def test_invalid_combinations_are_one_line_errors():
    cases = [(dict(schedule="interleaved_1f1b", microbatches=6, virtual_stages=2), "multiple of parallel.pipeline"),
             (dict(schedule="zb_h1", virtual_stages=2), "parallel.virtual_stages=2 only applies"),
             (dict(schedule="circular", microbatches=2, virtual_stages=2), "microbatches >= pipeline"),
             (dict(schedule="zigzag"), "parallel.schedule='zigzag' is not one of")]
    for kw, text in cases:
        with pytest.raises(ConfigError) as err:
            validate(MODEL, ParallelConfig(pipeline=4, data=2, **{"microbatches": 8, **kw}), TRAIN, 8)
        assert text in str(err.value) and "\n" not in str(err.value), str(err.value)
