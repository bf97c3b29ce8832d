"""Raw text -> tokenizer -> training from Hugging Face weights on (2, 2, 2) with 1F1B ->
samples -> generation -> export, in one run (framework.train.run in this process).

    tools/prepare_data.py --tokenizer  (a tokenizer.json built here with `tokenizers`)
    train.run: train.init_from=<fixture>, data.kind=tokens, eval.sample_prompt, 2 steps
    checks: step-1 loss == the loss of the imported weights on a (1, 1, 1) engine;
            eval/sample in metrics.jsonl and W&B; the tokenizer kept with the run;
            framework.generate on the run folder (one device) == the training sample;
            export of the (2, 2, 2) checkpoint == export after restoring it at (1, 1, 1)
            and saving it again, bit for bit.
"""

import dataclasses
import json
from pathlib import Path

import jax
import numpy as np
import pytest

from framework.io import data
from framework.run import generate, train
from framework.io.hf import llama as hf
from framework.io.checkpoint.manager import Checkpointer
from framework.config import (OptimConfig, CheckpointConfig, DataConfig, DevicesConfig,
                              EvalConfig, LoggingConfig, ModelConfig, ParallelConfig,
                              RunConfig, TrainConfig, WandbConfig)
from framework.errors import ConfigError
from framework.io.hf.safetensors import Tensors
from tests.helpers import FIXTURES, engine, load_tool

REPO = Path(__file__).resolve().parent.parent
FIXTURE = FIXTURES / "hf" / "untied_gqa"  # vocabulary 64
WORDS = ("the cat dog sat on a mat and ran to big small red blue house tree under over "
         "bird sang sun moon saw it was day night").split()
PROMPT, SAMPLE_TOKENS = "the cat", 8



@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    """A word-level tokenizer.json (made with the `tokenizers` library) and a token file
    prepared with it by tools/prepare_data.py."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    folder = tmp_path_factory.mktemp("corpus")
    vocab = WORDS + ["[UNK]"] + [f"w{i}" for i in range(len(WORDS) + 1, 64)]  # the model's 64
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(vocab)}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece()  # joins words with spaces
    tok.save(str(folder / "tokenizer.json"))
    rng = np.random.default_rng(0)
    (folder / "text.txt").write_text(" ".join(rng.choice(WORDS, 3000)))
    load_tool("prepare_data").build([str(folder / "corpus.bin"), str(folder / "text.txt"),
                                    "--tokenizer", str(folder / "tokenizer.json")])
    return folder


def run_config(corpus: Path, **train_kw) -> RunConfig:
    return RunConfig(
        model=ModelConfig(dtype="float32"),
        parallel=ParallelConfig(pipeline=2, data=2, tensor=2, microbatches=2, schedule="1f1b"),
        train=TrainConfig(seq_len=16, global_batch_size=8, steps=2, init_from=str(FIXTURE),
                          **train_kw),
        optim=OptimConfig(warmup_steps=1),
        data=DataConfig(kind="tokens", path=str(corpus / "corpus.bin")),
        eval=EvalConfig(every=2, batches=1, sample_prompt=PROMPT, sample_tokens=SAMPLE_TOKENS),
        checkpoint=CheckpointConfig(async_save=False),
        logging=LoggingConfig(every=1, progress=False, wandb=WandbConfig(mode="offline")),
        devices=DevicesConfig(platform="cpu", local_device_count=8))


@pytest.fixture(scope="module")
def trained(corpus, tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("run")
    cfg = run_config(corpus)
    summary = train.run(cfg, run_dir, {}, model_given={"dtype"})
    assert summary["status"] == "completed" and summary["init_from"] == str(FIXTURE)
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return cfg, run_dir, records


def test_a_recipe_value_that_contradicts_config_json_is_one_line(corpus, tmp_path):
    cfg = run_config(corpus)
    cfg = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, d_model=128))
    with pytest.raises(ConfigError) as err:
        train.run(cfg, tmp_path, {}, model_given={"d_model", "dtype"})
    assert str(err.value).startswith(f"model.d_model=128 but {FIXTURE}/config.json has "
                                     f"hidden_size=32")
    with pytest.raises(ConfigError, match="set one"):
        train.run(run_config(corpus, resume_from=str(tmp_path)), tmp_path, {})


def test_first_loss_at_2_2_2_equals_the_imported_model_at_1_1_1(trained):
    cfg, _, records = trained
    model = hf.model_config(hf.read_config(FIXTURE))
    eng = engine(1, 1, 1, 1, model=model, train=cfg.train)
    params = hf.load_params(FIXTURE, model, eng.layout.canonical_shardings["params"])
    batch = data.make_dataset(cfg.data, cfg.train, model.vocab_size).train_batch(0)
    loss = float(eng.loss_and_grads_fn()(eng.shard_params(params), eng.shard_batch(batch))[0])
    assert records[0]["step"] == 1
    assert abs(records[0]["train/loss"] - loss) <= 1e-6 * loss, (records[0]["train/loss"], loss)


def test_samples_reach_metrics_wandb_and_match_framework_generate(trained):
    _, run_dir, records = trained
    sample = records[-1]["eval/sample"]
    assert records[-1]["step"] == 2 and len(sample.split()) == SAMPLE_TOKENS
    assert all(w in WORDS or w.startswith("w") for w in sample.split())  # the run's tokenizer
    assert list(run_dir.glob("wandb/offline-run-*/files/media/table/eval/sample_*.table.json"))
    assert (run_dir / "tokenizer.json").is_file()
    out = generate.run(generate.parse_args([
        f"checkpoint={run_dir}", f"prompt={PROMPT}", f"max_new_tokens={SAMPLE_TOKENS}",
        "temperature=0", "stop_at_eos=false"]), devices=jax.devices())
    assert out["text"] == sample  # one device, from the checkpoint == on (2, 2, 2), in training
    from framework.io import weights as artifacts
    found = [artifacts.open_source(str(p)) for p in (run_dir, run_dir / "checkpoints",
                                                 run_dir / "checkpoints" / "2")]
    assert {(s.path, s.step, s.tokenizer) for s in found} == {
        (str(run_dir / "checkpoints"), 2, str(run_dir / "tokenizer.json"))}


def test_export_from_2_2_2_equals_export_after_resuming_at_1_1_1(trained, tmp_path):
    cfg, run_dir, _ = trained
    exporter = load_tool("export_hf")
    exporter.export(str(run_dir), str(tmp_path / "a"))
    # The same run resumed at (1, 1, 1): restore the (2, 2, 2) checkpoint there, save it.
    model = hf.model_config(hf.read_config(FIXTURE))
    eng = engine(1, 1, 1, 1, model=model, train=cfg.train)
    source = Checkpointer(str(run_dir / "checkpoints"), read_only=True)
    state, meta = source.restore(eng.layout), source.metadata()
    source.close()
    again = Checkpointer(str(tmp_path / "resumed" / "checkpoints"), async_save=False)
    again.save(int(state["step"]), eng.layout, state, {k: v for k, v in meta.items()
                                               if k not in ("step", "parallel", "model")})
    again.close()
    exporter.export(str(tmp_path / "resumed"), str(tmp_path / "b"))
    a, b = Tensors(tmp_path / "a"), Tensors(tmp_path / "b")
    assert sorted(a.where) == sorted(b.where) == sorted(hf.expected_tensors(model))
    for name in a.where:
        assert a.read(name).tobytes() == b.read(name).tobytes(), name
    read = lambda path: path.read_bytes()
    assert read(tmp_path / "a" / "config.json") == read(tmp_path / "b" / "config.json")
    assert read(tmp_path / "a" / "tokenizer.json") == read(run_dir / "tokenizer.json")
    trained_from = Tensors(FIXTURE).read("lm_head.weight")
    assert not np.array_equal(a.read("lm_head.weight"), trained_from)  # two steps trained


def test_which_model_settings_count_as_given():
    """With train.init_from the default model group does not count; a group picked on
    the command line or by a recipe, and model.X= values, do."""
    from framework.run.cli import given_model_settings

    assert given_model_settings([], None) == set()
    assert given_model_settings(["model.dtype=bfloat16", "train.steps=3"], None) == {"dtype"}
    from_recipe = given_model_settings([], "llama_1b_8gpu")  # override /model: llama_1b
    assert {"vocab_size", "rope_scaling", "tie_embeddings", "dtype"} <= from_recipe
    assert "d_model" in given_model_settings(["model=llama_small"], None)
