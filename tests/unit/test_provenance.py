"""Issue 46, silently wrong (items 6, 8-11, 13): outputs know what made them and readers
refuse what they do not understand, each in one line naming the setting or file. In
process; nothing is compiled."""

import json
import shutil

import pytest

from framework.config import DataConfig, EvalConfig, GenerateConfig, RunConfig, TrainConfig
from framework.errors import ConfigError
from framework.io import corpus_dataset, data, tokenizer, weights
from framework.io.hf import llama as hf
from framework.io.hf.safetensors import Tensors
from tests.helpers import FIXTURES, load_tool

TRAIN = TrainConfig(seq_len=8, global_batch_size=4)


def word_tokenizer(path, words):
    from tokenizers import Tokenizer, models, pre_tokenizers

    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate([*words, "[UNK]"])},
                                     unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.save(str(path))
    return path


@pytest.fixture
def texts(tmp_path):
    (tmp_path / "a.txt").write_text("red blue green " * 40)
    (tmp_path / "b.txt").write_text("blue green red " * 30)
    word_tokenizer(tmp_path / "t1.json", ["red", "blue", "green"])
    word_tokenizer(tmp_path / "t2.json", ["green", "red", "blue"])
    return tmp_path


def prepare(out, *args):
    return load_tool("prepare_data").build([str(out), *map(str, args), "--processes", "1"])


def test_6_preparing_again_with_other_inputs_or_settings_never_mixes(texts, capsys):
    out = texts / "c"
    first = prepare(out, texts / "a.txt", "--tokenizer", texts / "t1.json", "--eos-id", "3")
    assert first["inputs"][0]["path"] == str(texts / "a.txt")
    assert first["tokenizer_sha256"] == tokenizer.fingerprint(str(texts / "t1.json"))
    for args, why in [((texts / "b.txt", "--tokenizer", texts / "t1.json", "--eos-id", "3"),
                       "is not the one prepared before"),
                      ((texts / "b.txt", "--tokenizer", texts / "t2.json", "--eos-id", "3"),
                       "the tokenizer, --eos-id"),
                      ((texts / "b.txt", "--tokenizer", texts / "t2.json", "--eos-id", "0"),
                       "the tokenizer, --eos-id")]:
        manifest = prepare(out, *args)
        assert why in capsys.readouterr().out
        ds = data.make_dataset(DataConfig(kind="corpus", path=str(out), holdout_fraction=0),
                               TRAIN, 8)
        assert manifest["eos_id"] == int(args[-1]) and ds.separator == int(args[-1])
    # the last corpus is b.txt with t2 (green=0 red=1 blue=2) and eos 0 after it
    tokens = [int(t) for s in ds.shards for t in s.tokens]
    assert tokens[:4] == [2, 0, 1, 2] and tokens[-1] == 0 and len(tokens) == 91
    assert sorted(p.name for p in out.iterdir()) == [
        "input-00000.done", "manifest.json", "shard-00000-000.bin", "shard-00000-000.idx",
        "tokenizer.json"]


def test_8_a_copied_run_decodes_with_its_own_tokenizer_copy(texts, tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    shutil.copy(texts / "t1.json", run / "tokenizer.json")
    old_place = tmp_path / "elsewhere.json"
    shutil.copy(texts / "t2.json", old_place)  # what now sits at the recorded path
    meta = {"tokenizer": str(old_place),
            "tokenizer_sha256": tokenizer.fingerprint(str(texts / "t1.json"))}
    model = hf.model_config(hf.read_config(FIXTURES / "hf" / "tied_gqa"))
    assert weights._checkpoint_tokenizer(meta, run, model) == str(run / "tokenizer.json")
    (run / "tokenizer.json").unlink()  # its copy lost: the other one is never taken
    assert weights._checkpoint_tokenizer(meta, run, model) is None


@pytest.mark.parametrize("fixture,drops", [("qwen2_tied", "self_attn.k_proj.bias"),
                                           ("qwen3_head_dim", "self_attn.k_norm.weight")])
def test_9_init_from_refuses_tensors_its_family_would_drop(tmp_path, fixture, drops):
    folder = tmp_path / fixture
    shutil.copytree(FIXTURES / "hf" / fixture, folder)
    config = json.loads((folder / "config.json").read_text())
    config.update(model_type="llama", architectures=["LlamaForCausalLM"])
    (folder / "config.json").write_text(json.dumps(config))
    model = hf.model_config(hf.read_config(folder), str(folder))
    with pytest.raises(ConfigError, match=f"holds tensors that model.family=llama does not "
                                          f"use \\(model.layers.0.{drops}"):
        hf.check_tensors(Tensors(folder), model, str(folder))


def test_10_an_eval_set_of_another_tokenizer_is_refused(texts):
    prepare(texts / "val", texts / "b.txt", "--tokenizer", texts / "t2.json")
    sets = EvalConfig(every=1, sets={"val": str(texts / "val")})
    with pytest.raises(ConfigError, match="eval.sets.val=.* another tokenizer than the "
                                          "training data"):
        corpus_dataset.eval_sets(sets, DataConfig(), TRAIN, 8, str(texts / "t1.json"))
    assert corpus_dataset.eval_sets(sets, DataConfig(), TRAIN, 8, str(texts / "t2.json"))


def test_10_a_resume_on_another_tokenizer_is_refused():
    from framework.run.start import check_same_tokenizer

    with pytest.raises(ConfigError, match="trained on byte-level ids, this run's data is "
                                          "tokenizer abc"):
        check_same_tokenizer({"tokenizer_sha256": "bytes"}, {"tokenizer_sha256": "abc" * 20},
                             ("ckpt", 4))
    check_same_tokenizer({}, {"tokenizer_sha256": "bytes"}, ("ckpt", 4))  # unknown: allowed


@pytest.mark.parametrize("mixture,path,kind,says", [
    ([{"path": "a/", "weigth": 2}], None, "corpus", "has the key 'weigth'"),
    ([{"path": "a/", "weight": True}], None, "corpus", "weight=True must be a number"),
    ([{"path": 3}], None, "corpus", "path=3 is not a folder name"),
    ([{"path": "a/"}], "b/", "corpus", "data.mixture and data.path=b/ both say"),
    ([{"path": "a/"}], None, "tokens", "needs data.kind=corpus (not tokens)")])
def test_11_mixture_entries_are_typed_and_never_silently_dropped(mixture, path, kind, says):
    with pytest.raises(ConfigError, match=says.replace("(", r"\(").replace(")", r"\)")):
        data.make_dataset(DataConfig(kind=kind, path=path, mixture=mixture), TRAIN, 256)


def test_11_13_eval_sets_names_and_paths_are_checked():
    from framework.run.cli import check_duplicate_keys

    with pytest.raises(ConfigError, match="eval.sets names 'val' twice"):
        check_duplicate_keys(["eval.sets={val: a/, val: b/}"])
    check_duplicate_keys(["eval.sets={val: a/, other: {val: 1}}"])  # nested: not a duplicate
    with pytest.raises(ConfigError, match="eval.sets.val=3 is not a corpus folder's name"):
        corpus_dataset.eval_sets(EvalConfig(every=1, sets={"val": 3}), DataConfig(), TRAIN, 8)


def test_13_generation_values_accepted_before_without_a_word():
    from framework.run.generate import check_settings

    def problems(**kw):
        return check_settings(GenerateConfig(checkpoint="x", **kw))

    assert problems(temperature=1e300) == ["temperature=1e+300 must be in [0, 100] (0: "
                                           "greedy; higher is uniform sampling)"]
    assert problems(prompt="hi", prompt_ids="1,2") == [
        "prompt and prompt_ids both give the prompt: give one of them"]
    assert problems(prompt_ids="1,2") == [] and problems(temperature=100) == []


def test_13_optimizer_values_accepted_before_without_a_word():
    import jax

    from framework.config import ModelConfig, OptimConfig
    from framework.model.llama import init_params
    from framework.run.checks import check_no_decay, check_run

    for optim, says in [(OptimConfig(schedule="wsd", decay_steps=500),
                         "is more than train.steps=100"),
                        (OptimConfig(decay_steps=5), "set optim.schedule=wsd")]:
        with pytest.raises(ConfigError, match=says):
            check_run(RunConfig(optim=optim))
    params = jax.eval_shape(lambda: init_params(ModelConfig(), jax.random.key(0)))
    check_no_decay(("layers/attn/*",), params)
    with pytest.raises(ConfigError, match="pattern 'layer/attn/\\*' names no parameter: the "
                                          "names are embed/table, head/norm/scale"):
        check_no_decay(("layers/attn/*", "layer/attn/*"), params)
