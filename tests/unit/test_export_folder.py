"""Export and generation that cannot mislead: where tools/export_hf.py may write (never a
run folder, a non-export folder only with --overwrite), a re-export replacing the
previous one whole, a failed export leaving it as it was, and a run folder holding an
old export read as its checkpoints (framework/io/hf/export_folder.py,
framework/io/weights.py). In process, on the small fixtures: nothing is compiled."""

import json
import os
import shutil

import numpy as np
import pytest

from framework.config import TrainConfig
from framework.errors import ConfigError
from framework.io import weights
from framework.io.checkpoint.manager import Checkpointer
from framework.io.hf import export_folder, llama as hf
from framework.io.hf.safetensors import Tensors
from tests.helpers import FIXTURES, engine, load_tool

SHARDED = FIXTURES / "hf" / "llama3_bf16_sharded"  # 3 shards, bfloat16
UNTIED, TIED = FIXTURES / "hf" / "untied_gqa", FIXTURES / "hf" / "tied_gqa"
ONE_FILE = ["config.json", "export_hf.json", "generation_config.json", "model.safetensors"]


@pytest.fixture(scope="module")
def exporter():
    return load_tool("export_hf")


@pytest.fixture(scope="module")
def run_with_stale_export(tmp_path_factory):
    """A run folder whose newest checkpoint (step 5) holds untied_gqa's weights, with an
    export of another model (tied_gqa) written into the folder itself, as older
    versions of the export let a user do."""
    run = tmp_path_factory.mktemp("run")
    model = hf.model_config(hf.read_config(UNTIED))
    eng = engine(1, 1, 1, 1, model=model, train=TrainConfig(seq_len=16, global_batch_size=1))
    params = hf.load_params(UNTIED, model, eng.layout.canonical_shardings["params"])
    ckpt = Checkpointer(str(run / "checkpoints"), async_save=False)
    ckpt.save(5, eng.layout, eng.init_state(params), {"seq_len": 16, "data": "markov"})
    ckpt.close()
    for name in ("config.json", "model.safetensors"):
        shutil.copy(TIED / name, run / name)
    return run


def contents(folder) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(folder.iterdir()) if p.is_file()}


def test_a_run_folder_is_read_as_its_checkpoints_even_with_an_export_in_it(
        run_with_stale_export, exporter, tmp_path):
    run = run_with_stale_export
    source = weights.open_source(str(run))
    assert (source.kind, source.step, source.path) == ("checkpoint", 5, str(run / "checkpoints"))
    assert not source.model.tie_embeddings  # the checkpoint's model, not the tied export's
    assert source.positions() == (16, "the run's train.seq_len")
    # Export reads it the same way: the checkpoint's untied head, not the stale export.
    exporter.export(str(run), str(tmp_path / "out"))
    got = Tensors(tmp_path / "out").read("lm_head.weight")
    np.testing.assert_array_equal(got, Tensors(UNTIED).read("lm_head.weight"))
    assert json.loads((tmp_path / "out" / "export_hf.json").read_text())["step"] == 5
    # A folder holding only a Hugging Face export is still read as one.
    alone = weights.open_source(str(TIED))
    assert alone.kind == "hf" and alone.positions() == (
        128, "max_position_embeddings in its config.json")


def test_export_never_writes_into_a_folder_holding_checkpoints(run_with_stale_export, exporter):
    run = run_with_stale_export
    for out, what in ((run, "a run folder"), (run / "checkpoints", "a checkpoint folder"),
                      (run / "checkpoints" / "5", "a checkpoint step folder")):
        before = contents(out)
        for overwrite in (False, True):
            with pytest.raises(ConfigError) as err:
                exporter.export(str(UNTIED), str(out), overwrite=overwrite)
            assert str(err.value).startswith(f"the output folder {out} is {what}")
            assert "--overwrite never replaces one" in str(err.value)
            assert "\n" not in str(err.value)
        assert contents(out) == before


def test_a_re_export_replaces_a_sharded_export_whole(exporter, tmp_path):
    out = tmp_path / "hf"
    sharded = exporter.export(str(SHARDED), str(out), max_shard_size="12KB")
    assert len([f for f in sharded if f.endswith(".safetensors")]) > 1
    files = exporter.export(str(SHARDED), str(out))  # no flag needed: it is an export
    assert sorted(files) == sorted(os.listdir(out)) == ONE_FILE  # no shard left behind
    again, original = Tensors(out), Tensors(SHARDED)
    assert sorted(again.where) == sorted(original.where)
    for name in original.where:
        assert again.read(name).tobytes() == original.read(name).tobytes(), name


def test_a_folder_that_is_not_an_export_needs_overwrite_and_is_then_replaced_whole(
        exporter, tmp_path):
    out = tmp_path / "mine"
    out.mkdir()
    (out / "notes.txt").write_text("mine")
    with pytest.raises(ConfigError) as err:
        exporter.export(str(UNTIED), str(out))
    assert str(err.value) == (
        f"the output folder {out} holds files that no export of tools/export_hf.py listed "
        f"in its export_hf.json (notes.txt): choose a new or empty folder, or pass "
        f"--overwrite to replace its contents whole")
    assert contents(out) == {"notes.txt": b"mine"}
    # An older export's files without a manifest are not taken for an export either: a
    # downloaded model looks the same.
    legacy = tmp_path / "legacy"
    shutil.copytree(SHARDED, legacy)
    with pytest.raises(ConfigError, match="pass --overwrite"):
        exporter.export(str(UNTIED), str(legacy))
    assert exporter.export(str(UNTIED), str(out), overwrite=True)
    assert sorted(os.listdir(out)) == ONE_FILE  # notes.txt went with the rest
    (out / "sub").mkdir()
    with pytest.raises(ConfigError, match=r"holds folders \(sub\): --overwrite replaces only"):
        exporter.export(str(UNTIED), str(out), overwrite=True)


def test_a_failed_export_leaves_the_previous_one_as_it_was(exporter, tmp_path, monkeypatch):
    out = tmp_path / "hf"
    exporter.export(str(SHARDED), str(out), max_shard_size="12KB")
    before = contents(out)
    real = hf.export

    def full_disk(folder, *args, **kwargs):  # every file written, then the disk is full
        real(folder, *args, **kwargs)
        raise ConfigError(f"could not write {folder}/model.safetensors: No space left on device")

    monkeypatch.setattr(hf, "export", full_disk)
    with pytest.raises(ConfigError, match="No space left on device"):
        exporter.export(str(UNTIED), str(out))
    assert contents(out) == before and sorted(os.listdir(out)) == sorted(before)
    fresh = tmp_path / "fresh"
    with pytest.raises(ConfigError):
        exporter.export(str(UNTIED), str(fresh))
    assert not fresh.exists()  # a folder the export created goes with it
    # What an interrupted export leaves (its staging folder) does not make a folder
    # non-empty: the next export goes ahead.
    monkeypatch.setattr(hf, "export", real)
    (tmp_path / "left" / export_folder.STAGING).mkdir(parents=True)
    assert sorted(exporter.export(str(UNTIED), str(tmp_path / "left"))) == ONE_FILE
    assert sorted(os.listdir(tmp_path / "left")) == ONE_FILE


def test_the_models_positions_and_where_they_come_from():
    """One number bounds generation and becomes the export's max_position_embeddings."""
    model = hf.model_config(hf.read_config(UNTIED))
    source = lambda kind, hf_config, meta: weights.Source(kind, "x", None, model, None,
                                                          hf_config, meta)
    assert source("checkpoint", {"max_position_embeddings": 131072}, {"seq_len": 2048}
                  ).positions() == (131072, "max_position_embeddings of the folder it was "
                                            "initialised from")
    assert source("checkpoint", None, {"seq_len": 32}).positions() == (
        32, "the run's train.seq_len")
    assert source("hf", {"max_position_embeddings": "many"}, {}).positions()[0] == 2048
