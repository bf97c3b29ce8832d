"""Issue 46, item 7 (and 10 on resume): a run resumed under another optimizer is told
so in one line, with its checkpoint left in place, and continues from its step with
train.reset_optimizer=true; a resume on data of another tokenizer is refused. In
process (framework.run.train.run), two short runs on the tiny recipe."""

import dataclasses

import pytest

from framework.errors import ConfigError
from framework.io.checkpoint.manager import Checkpointer
from framework.run import train
from tests.helpers import compose_recipe


def config(*overrides):
    return compose_recipe("llama_tiny_debug", "train.steps=2", "logging=no_wandb",
                          "logging.progress=false", "profile.steps=0", "eval.every=0",
                          "checkpoint.async_save=false", *overrides)


def steps(run_dir):
    ckpt = Checkpointer(str(run_dir / "checkpoints"), read_only=True)
    try:
        return ckpt.complete_steps()
    finally:
        ckpt.close()


def test_7_a_resume_under_another_optimizer_asks_for_reset_optimizer(tmp_path, capsys):
    run_dir = tmp_path / "run"
    assert train.run(config(), run_dir, {})["status"] == "completed"
    saved = steps(run_dir)
    muon = config("optim.name=muon", "train.steps=3")
    with pytest.raises(ConfigError) as err:
        train.run(muon, run_dir, {})
    assert str(err.value) == (
        f"the checkpoint of step 2 in {run_dir / 'checkpoints'} holds the state of "
        f"optim.name=adamw, and this run uses optim.name=muon: set "
        f"train.reset_optimizer=true to keep its weights and step and start muon afresh, "
        f"or resume with optim.name=adamw")
    assert steps(run_dir) == saved and not list((run_dir / "checkpoints").glob("*.damaged"))
    reset = dataclasses.replace(muon, train=dataclasses.replace(muon.train,
                                                                reset_optimizer=True))
    capsys.readouterr()
    summary = train.run(reset, run_dir, {})
    assert summary["status"] == "completed" and summary["resumed_from_step"] == 2
    assert "optim.name=muon starts afresh (train.reset_optimizer=true)" in capsys.readouterr().out
    assert steps(run_dir)[-1] == 3


def test_10_a_resume_on_data_of_another_tokenizer_is_refused(tmp_path):
    text = tmp_path / "a.txt"
    text.write_text("some words to train on " * 200)
    run_dir = tmp_path / "run"
    assert train.run(config("data=text", f"data.path={text}"), run_dir, {})["status"] == \
        "completed"  # byte-level ids
    from tests.unit.test_provenance import word_tokenizer
    from tests.helpers import load_tool

    tok = word_tokenizer(tmp_path / "t.json", ["some", "words", "to", "train", "on"])
    load_tool("prepare_data").build([str(tmp_path / "w.bin"), str(text), "--tokenizer",
                                    str(tok)])
    other = config("data=tokens", f"data.path={tmp_path / 'w.bin'}", "train.steps=3")
    with pytest.raises(ConfigError, match="was trained on byte-level ids, this run's data is "
                                          "tokenizer "):
        train.run(other, run_dir, {})
