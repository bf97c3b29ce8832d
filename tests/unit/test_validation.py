"""Validation before anything is compiled (framework/engine/validate.py): every rule on
the degrees, the schedule and the model's shape is one line naming the setting."""

import dataclasses

import pytest

from framework.config import ParallelConfig, stage_layers_value
from framework.engine.validate import validate
from framework.errors import ConfigError
from tests.helpers import MODEL, TRAIN


BAD = [  # (overrides, the setting the message must name)
    (dict(pipeline=2, data=2, tensor=1), "parallel.pipeline*data*context*tensor"),  # 4 != 8
    (dict(pipeline=3, data=1, tensor=1), "model.n_layers"),
    (dict(pipeline=1, data=8, tensor=1, microbatches=4), "train.global_batch_size"),
    (dict(pipeline=0, data=8, tensor=1), "parallel.pipeline"),
    (dict(pipeline=1, data=-3, tensor=1), "parallel.data"),
    (dict(pipeline=1, data=2, tensor=1, schedule="zigzag"), "parallel.schedule"),
    (dict(pipeline=1, data=8, context=0), "parallel.context"),
]


@pytest.mark.parametrize("seq_len,overrides,words", [
    (12, dict(context=4, data=2), "train.seq_len=12 is not divisible by 2 x parallel.context=8"),
    (12, dict(context=2, tensor=4, sequence_parallel=True),
     "train.seq_len/parallel.context=6 is not divisible by parallel.tensor=4"),
    (24, dict(context=4, tensor=2, sequence_parallel=True), None)])
def test_the_sequence_splits_over_context_and_tensor(seq_len, overrides, words):
    train = dataclasses.replace(TRAIN, seq_len=seq_len, global_batch_size=8)
    if words is None:
        validate(MODEL, ParallelConfig(**overrides), train, 8)
        return
    with pytest.raises(ConfigError) as err:
        validate(MODEL, ParallelConfig(**overrides), train, 8)
    assert words in str(err.value) and "\n" not in str(err.value)


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
             (dict(schedule="zigzag"), "parallel.schedule='zigzag' is not one of"),
             (dict(collective_matmul=True), "collective_matmul=true needs parallel.sequence_parallel=true"),
             (dict(fsdp=True, fsdp_regather="layer"), "parallel.fsdp_regather='layer' is not one of microbatch, step")]
    for kw, text in cases:
        with pytest.raises(ConfigError) as err:
            validate(MODEL, ParallelConfig(pipeline=4, data=2, **{"microbatches": 8, **kw}), TRAIN, 8)
        assert text in str(err.value) and "\n" not in str(err.value), str(err.value)


# parallel.stage_layers of a form no model could use: refused when ParallelConfig is
# built (framework/config/), as given on the command line (Hydra's values).
WRONG_FORMS = [(4, "=4 is a number, not a list"), (True, "=true is true/false, not a list"),
               ([2, "2"], "=[2,'2'] holds '2' (a string) where a number of layers belongs"),
               ([2, 2.5], "=[2,2.5] holds 2.5 (a decimal number)"),
               ([1, True], "=[1,true] holds true (true/false)"),
               ([[1], 2], "=[[1],2] holds [1] (a list)"),
               ({"a": 1}, "is a mapping, not a list"), ("even", "='even' is a string"),
               ([0, 4], "=[0,4] holds 0, but every stage needs at least 1 layer")]


@pytest.mark.parametrize("given,problem", WRONG_FORMS, ids=[str(g) for g, _ in WRONG_FORMS])
def test_stage_layers_of_the_wrong_form_are_one_line(given, problem):
    with pytest.raises(ConfigError) as err:
        ParallelConfig(pipeline=2, stage_layers=given)
    message = str(err.value)
    assert message.startswith("parallel.stage_layers") and problem in message, message
    assert "\n" not in message and message.endswith(
        "it takes a list of positive whole numbers, the layers of each global stage "
        "(e.g. [2,2]), or auto, or null (unset: model.n_layers split evenly)")


def test_stage_layers_of_the_right_form_are_kept():
    assert stage_layers_value([2, 3]) == (2, 3)  # hashable: the planner's caches key on it
    assert stage_layers_value("auto") == "auto" and stage_layers_value(None) is None
    assert ParallelConfig(stage_layers=[1, 3]).stage_layers == (1, 3)


def test_a_value_the_schema_refuses_is_one_line_from_the_task(capsys):
    """What both `framework.run` and `framework.compile` do with a composed config
    whose ParallelConfig cannot be built: one line, exit status 2 (no Hydra line)."""
    from hydra import compose, initialize_config_dir

    from framework.run import cli

    cli.register_configs()
    with initialize_config_dir(config_dir=str(cli.CONF_DIR), version_base=None):
        cfg = compose("config", overrides=["recipe=llama_small_3d", "parallel.stage_layers=4"])
    with pytest.raises(SystemExit) as done:
        cli.typed_config(cfg)
    lines = capsys.readouterr().err.splitlines()
    assert done.value.code == 2 and len(lines) == 1, lines
    assert lines[0].startswith("error: parallel.stage_layers=4 is a number, not a list")
