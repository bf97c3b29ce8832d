"""Issue 46, the hang, the tracebacks and the unclear messages (items 14, 17-19, 21-24):
each reproduction ends in its exit status and one `error:` line naming the file or the
setting, with the files as they were. In process (a worker pool where the item is
about one)."""

import errno
import json

import numpy as np
import pytest

from framework.config import DataConfig, TrainConfig
from framework.errors import ConfigError
from framework.io import corpus, data
from tests.helpers import load_tool
from tests.unit.test_outputs import refused, snapshot

TRAIN = TrainConfig(seq_len=8, global_batch_size=4)


def corpus_data(folder, **kw) -> DataConfig:
    return DataConfig(kind="corpus", path=str(folder), **{"holdout_fraction": 0.0, **kw})


@pytest.fixture
def inputs(tmp_path):
    (tmp_path / "a.txt").write_text("a plain text document\n" * 20)
    (tmp_path / "good.jsonl").write_text('{"text": "one"}\n{"text": "two"}\n')
    (tmp_path / "nofield.jsonl").write_text('{"text": "ok"}\n{"body": "b"}\n')
    (tmp_path / "badjson.jsonl").write_text('{"text": "ok"}\n{"text": \n')
    (tmp_path / "number.jsonl").write_text('{"text": 5}\n')
    (tmp_path / "latin1.txt").write_bytes(b"caf\xe9 au lait\n")
    (tmp_path / "empty.txt").write_text("")
    (tmp_path / "broken_tok.json").write_text('{"model": ')
    return tmp_path


def test_14_a_bad_line_in_a_worker_ends_the_command_instead_of_hanging(inputs, capsys):
    line = refused("prepare_data", [inputs / "c", inputs / "a.txt", inputs / "nofield.jsonl",
                                    "--processes", "2"], capsys)
    assert "nofield.jsonl:2: no 'text' field" in line
    assert not list((inputs / "c").glob(".partial-*"))


@pytest.mark.parametrize("case,says", [
    ("latin1.txt", "latin1.txt is not UTF-8 text"),
    ("number.jsonl", "number.jsonl:1: the 'text' field is int, not text"),
    ("badjson.jsonl", "badjson.jsonl:2: not a JSON object"),
    ("empty.txt", "hold no text"),
    ("--tokenizer broken_tok.json", "broken_tok.json is not a readable tokenizer.json"),
    ("--tokenizer c/tok.json", "lies inside the output folder"),
    ("--shard-tokens 0", "--shard-tokens 0 must be >= 1"),
    ("--shard-tokens -5", "--shard-tokens -5 must be >= 1"),
    ("--processes 0", "--processes 0 must be >= 1"),
    ("--eos-id 999", "--eos-id 999 is outside the vocabulary of 256")])
def test_17_bad_inputs_to_prepare_data_are_one_line(inputs, capsys, case, says):
    if "c/tok.json" in case:
        (inputs / "c").mkdir()
        (inputs / "c" / "tok.json").write_text("{}")
    args = [inputs / a if a.endswith((".txt", ".jsonl", ".json")) else a for a in case.split()]
    if not case.startswith("--"):
        args = [args[0]]
    elif "--tokenizer" not in case and "--eos-id" not in case:
        args = [inputs / "a.txt", *args]
    else:
        args = [inputs / "good.jsonl", *args]
    before = snapshot(inputs)
    line = refused("prepare_data", [inputs / "c", *args, "--processes", "1"]
                   if "--processes" not in case else [inputs / "c", *args], capsys)
    assert says in line, line
    assert {k: v for k, v in snapshot(inputs).items() if k in before} == before


def test_17_a_bin_output_refuses_the_same_inputs(inputs, capsys):
    for name, says in [("latin1.txt", "not UTF-8"), ("empty.txt", "hold no text")]:
        tok = ["--tokenizer", inputs / "broken_tok.json"] if name == "latin1.txt" else []
        line = refused("prepare_data", [inputs / "out.bin", inputs / name, *tok], capsys)
        assert ("broken_tok.json is not a readable" if tok else says) in line
    assert not (inputs / "out.bin").exists()


def test_17_a_full_disk_and_ctrl_c_are_one_line_with_no_partial_file(inputs, capsys,
                                                                     monkeypatch):
    real = corpus.write_shard

    def full(folder, *args):
        real(folder, *args)  # one shard is written, then the disk is full
        raise OSError(errno.ENOSPC, "No space left on device", str(inputs / "c" / "x"))

    monkeypatch.setattr(corpus, "write_shard", full)
    line = refused("prepare_data", [inputs / "c", inputs / "a.txt", "--processes", "1"],
                   capsys, status=4)
    assert line.startswith("error: no space left writing") and \
        not list((inputs / "c").glob(".partial-*"))

    def interrupted(folder, *args):
        raise KeyboardInterrupt

    monkeypatch.setattr(corpus, "write_shard", interrupted)
    line = refused("prepare_data", [inputs / "c", inputs / "a.txt", "--processes", "1"],
                   capsys, status=130)
    assert line.startswith("error: interrupted")


@pytest.mark.parametrize("argv,says", [
    (["tok.json", "nofield.jsonl"], "nofield.jsonl:2: no 'text' field"),
    (["tok.json", "badjson.jsonl"], "badjson.jsonl:2: not a JSON object"),
    (["tok.json", "latin1.txt"], "latin1.txt is not UTF-8 text"),
    (["missing/tok.json", "a.txt"], "its folder"),
    (["folder", "a.txt"], "is a folder: name the file"),
    (["tok.json"], "the following arguments are required: inputs")])
def test_18_bad_inputs_to_train_tokenizer_are_one_line(inputs, capsys, argv, says):
    (inputs / "folder").mkdir()
    before = snapshot(inputs)
    line = refused("train_tokenizer", [inputs / a for a in argv], capsys)
    assert says in line and "usage" not in line
    assert snapshot(inputs) == before


@pytest.mark.parametrize("edit,says", [
    (lambda m: m.update(dtype="float32"), "dtype 'float32' is not one of uint16, uint32"),
    (lambda m: m.pop("shards"), "lists no shards"),
    (lambda m: m["shards"][0].pop("file_sha256"), "shard 0 lacks file_sha256"),
    (lambda m: m.update(eos_id=7), "was edited after the corpus was prepared"),
    (lambda m: m.update(vocab_size="big"), "vocab_size 'big' is not a whole number")])
def test_19_12_an_edited_manifest_is_one_line(inputs, edit, says):
    folder = inputs / "c"
    load_tool("prepare_data").build([str(folder), str(inputs / "a.txt"), "--processes", "1"])
    manifest = json.loads((folder / corpus.MANIFEST).read_text())
    edit(manifest)
    (folder / corpus.MANIFEST).write_text(json.dumps(manifest))
    with pytest.raises(ConfigError) as err:
        data.make_dataset(corpus_data(folder), TRAIN, 256)
    assert says in str(err.value) and "\n" not in str(err.value)


def test_12_a_shard_rewritten_mid_run_with_in_vocabulary_ids_is_caught(inputs):
    folder = inputs / "c"
    load_tool("prepare_data").build([str(folder), str(inputs / "a.txt"), "--processes", "1"])
    ds = data.make_dataset(corpus_data(folder), TRAIN, 256)
    ds.train_batch(0)
    shard = next(folder.glob("shard-*.bin"))
    ids = np.fromfile(shard, np.uint16)
    (ids[::-1]).tofile(shard)  # the same size, the same vocabulary, other text
    with pytest.raises(Exception, match="rewritten during the run"):
        ds.train_batch(1)


def test_21_24_too_small_eval_sets_and_holdouts_are_refused_naming_their_setting(inputs):
    from framework.config import EvalConfig
    from framework.io import corpus_dataset

    folder = inputs / "c"  # 21 lines of text: 441 tokens, 55 sequences of 8
    load_tool("prepare_data").build([str(folder), str(inputs / "a.txt"), "--processes", "1"])
    big = TrainConfig(seq_len=8, global_batch_size=64)
    with pytest.raises(ConfigError, match=r"eval.sets.val=.* fewer than one batch of "
                                          r"train.global_batch_size=64"):
        corpus_dataset.eval_sets(EvalConfig(every=1, sets={"val": str(folder)}),
                                 DataConfig(), big, 256)
    with pytest.raises(ConfigError, match=r"data.holdout_fraction=0.001 holds out 0 of them.*"
                                          r"set it to at least 0.074"):
        data.make_dataset(corpus_data(folder, holdout_fraction=0.001), TRAIN, 256)
    mix = [{"path": str(folder)}, {"path": str(inputs / "none")}]
    with pytest.raises(ConfigError, match=r"^data.mixture\[1\].path=.*none is not a corpus"):
        data.make_dataset(DataConfig(kind="corpus", mixture=mix), TRAIN, 256)


def test_22_preparing_again_mends_a_damaged_shard(inputs, capsys):
    folder = inputs / "c"
    prepare = load_tool("prepare_data").build
    prepare([str(folder), str(inputs / "a.txt"), str(inputs / "good.jsonl"), "--processes", "1"])
    whole = snapshot(folder)
    shard = folder / "shard-00001-000.bin"
    raw = bytearray(shard.read_bytes())
    raw[0] ^= 1
    shard.write_bytes(bytes(raw))
    with pytest.raises(ConfigError, match="prepare the corpus again with the same command"):
        data.make_dataset(corpus_data(folder), TRAIN, 256)
    prepare([str(folder), str(inputs / "a.txt"), str(inputs / "good.jsonl"), "--processes", "1"])
    assert "good.jsonl: its shard shard-00001-000.bin is missing or damaged: preparing it " \
           "again" in capsys.readouterr().out
    assert {k: v[0] for k, v in snapshot(folder).items()} == {k: v[0] for k, v in whole.items()}
    data.make_dataset(corpus_data(folder), TRAIN, 256)


def test_23_argument_errors_are_one_line_without_the_usage_block(capsys):
    for tool, argv in [("prepare_data", []), ("prepare_data", ["o", "i", "--eos-id", "x"]),
                       ("export_hf", ["only-one"]), ("train_tokenizer", ["--what"])]:
        line = refused(tool, argv, capsys)
        assert "usage:" not in line and "--help" in line


def test_24_plan_names_a_bad_choice_and_a_non_finite_memory():
    plan = load_tool("plan")
    from framework.config import RunConfig, ParallelConfig

    with pytest.raises(ConfigError, match="parallel.remat='some' is not one of none, full"):
        plan.check_choices(RunConfig(parallel=ParallelConfig(remat="some")))
    for value in (float("nan"), float("inf")):
        with pytest.raises(ConfigError, match="device_memory_gb=.* is not a finite number"):
            plan.check_settings({"devices": 8, "device_memory_gb": value})
