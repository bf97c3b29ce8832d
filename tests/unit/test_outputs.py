"""Issue 46, data lost (items 1-5): the tools never write into an input, never into
another tool's folder, and write every output whole or not at all
(framework/io/outputs.py). Each reproduction as the issue gives it: the exit status,
one `error:` line on stderr, and every file as it was. In process: no JAX program."""

import json
import os
from pathlib import Path

import numpy as np
import pytest

from framework.config import DataConfig, TrainConfig
from framework.errors import ConfigError, FolderBusy
from framework.io import data, outputs
from framework.runtime import runlock
from tests.helpers import load_tool


def snapshot(folder: Path) -> dict[str, tuple[bytes, int]]:
    """Every file under `folder`: its bytes and modification time."""
    return {str(p.relative_to(folder)): (p.read_bytes(), p.stat().st_mtime_ns)
            for p in sorted(folder.rglob("*")) if p.is_file()}


def refused(tool: str, argv: list[str], capsys, status: int = 2) -> str:
    """Runs tools/<tool>.py's command line in process; asserts the exit status and a
    single `error:` line on stderr, which it returns."""
    assert load_tool(tool).main([str(a) for a in argv]) == status
    lines = [ln for ln in capsys.readouterr().err.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: "), lines
    return lines[0]


def test_1_a_bin_output_that_is_its_own_input_is_refused_untouched(tmp_path, capsys):
    x = tmp_path / "x.bin"
    x.write_bytes(b"hello world\n")
    before = snapshot(tmp_path)
    line = refused("prepare_data", [x, x], capsys)
    assert "is the output" in line and snapshot(tmp_path) == before
    link = tmp_path / "link.bin"  # the same file under another name
    os.link(x, link)
    assert "is the output" in refused("prepare_data", [link, x], capsys)
    assert snapshot(tmp_path) == {**before, "link.bin": before["x.bin"]}


def test_2_a_forgotten_tokenizer_output_never_replaces_a_data_file(tmp_path, capsys):
    notes, first = tmp_path / "notes.jsonl", tmp_path / "first.jsonl"
    notes.write_text('{"text": "my notes"}\n')
    first.write_text('{"text": "first"}\n')
    before = snapshot(tmp_path)
    line = refused("train_tokenizer", [notes, first], capsys)
    assert "notes.jsonl exists and is not a tokenizer.json" in line and "--overwrite" in line
    assert snapshot(tmp_path) == before
    assert "is the output" in refused("train_tokenizer", [notes, notes], capsys)
    assert snapshot(tmp_path) == before


def hf_export(folder: Path) -> Path:
    folder.mkdir()
    for name in ("config.json", "tokenizer.json", "export_hf.json"):
        (folder / name).write_text(json.dumps({"name": name}))
    (folder / "model.safetensors").write_bytes(b"\0" * 64)
    return folder


def run_folder(folder: Path) -> Path:
    (folder / "checkpoints").mkdir(parents=True)
    (folder / "summary.json").write_text(json.dumps({"status": "completed"}))
    (folder / "tokenizer.json").write_text("{}")
    return folder


@pytest.mark.parametrize("make", [hf_export, run_folder])
def test_3_preparing_into_an_export_or_a_run_folder_is_refused_even_with_overwrite(
        tmp_path, capsys, make):
    target = make(tmp_path / "target")
    (tmp_path / "val.jsonl").write_text('{"text": "held out"}\n')
    (tmp_path / "other.json").write_text("{}")
    before = snapshot(tmp_path)
    for extra in ([], ["--overwrite"]):
        line = refused("prepare_data", [f"{target}/", tmp_path / "val.jsonl", "--tokenizer",
                                        tmp_path / "other.json", *extra], capsys)
        assert "another tool's output" in line and "--overwrite never" in line
    assert snapshot(tmp_path) == before


def test_a_folder_of_other_files_needs_overwrite_and_an_input_inside_is_refused(
        tmp_path, capsys):
    docs = tmp_path / "docs"
    docs.mkdir()
    (docs / "notes.txt").write_text("mine")
    before = snapshot(tmp_path)
    line = refused("prepare_data", [docs, docs / "notes.txt"], capsys)
    assert "lies inside the output folder" in line
    (tmp_path / "a.txt").write_text("text")
    before = snapshot(tmp_path)
    line = refused("prepare_data", [docs, tmp_path / "a.txt"], capsys)
    assert "holds files that are not a prepared corpus" in line and "--overwrite" in line
    assert snapshot(tmp_path) == before
    assert "is a file, not a folder" in refused("prepare_data", [tmp_path / "a.txt",
                                                                 docs / "notes.txt"], capsys)


def test_4_a_compile_never_writes_into_a_training_runs_folder_and_honours_its_lock(tmp_path):
    from framework.compile.cli import hold_folder

    run = run_folder(tmp_path / "run")
    (run / "metrics.jsonl").write_text('{"step": 1}\n')
    before = snapshot(run)
    with pytest.raises(ConfigError, match="is a training run's folder: a compile writes "
                                          "summary.json"):
        hold_folder(run)
    assert snapshot(run) == before
    live = tmp_path / "live"  # a training run that has just taken its folder
    held = runlock.acquire(live)
    try:
        with pytest.raises(FolderBusy, match="in use by another run"):
            hold_folder(live)
    finally:
        held.release()
    lock = hold_folder(tmp_path / "new")  # a new folder: held while compiling
    assert (tmp_path / "new" / runlock.LOCK_FILE).exists()
    lock.release()


def test_5_an_interrupted_bin_rewrite_leaves_the_old_file_and_sidecar(tmp_path, monkeypatch):
    tool = load_tool("prepare_data")
    (tmp_path / "a.txt").write_text("first version of the text\n")
    out = tmp_path / "out.bin"
    tool.build([str(out), str(tmp_path / "a.txt")])
    before = snapshot(tmp_path)
    (tmp_path / "b.txt").write_text("a second input\n")
    before["b.txt"] = snapshot(tmp_path)["b.txt"]

    def interrupted(path, encode):
        yield np.frombuffer(b"partial", np.uint8)
        raise KeyboardInterrupt

    monkeypatch.setattr(tool, "file_tokens", interrupted)
    with pytest.raises(KeyboardInterrupt):
        tool.build([str(out), str(tmp_path / "a.txt"), str(tmp_path / "b.txt")])
    assert snapshot(tmp_path) == before  # no partial file left either


def test_5_a_bin_file_that_disagrees_with_its_sidecar_is_refused(tmp_path):
    (tmp_path / "a.txt").write_text("some text to train on, long enough for a window\n" * 4)
    out = tmp_path / "out.bin"
    load_tool("prepare_data").build([str(out), str(tmp_path / "a.txt")])
    cfg = DataConfig(kind="tokens", path=str(out), token_dtype="uint16")
    train = TrainConfig(seq_len=8, global_batch_size=2)
    data.make_dataset(cfg, train, 256)  # as prepared: fine
    raw = out.read_bytes()
    out.write_bytes(raw[:len(raw) // 2])  # a partial file beside the old sidecar
    with pytest.raises(ConfigError, match="bytes but .* records .* tokens .*partial"):
        data.make_dataset(cfg, train, 256)
    out.write_bytes(raw[:-2] + b"x\0")  # the same size, other ids
    with pytest.raises(ConfigError, match="does not match the SHA-256"):
        data.make_dataset(cfg, train, 256)


def test_a_write_is_whole_or_not_at_all(tmp_path):
    target = tmp_path / "f.json"
    outputs.write_json(target, {"a": 1})
    with pytest.raises(RuntimeError):
        with outputs.replacing(target, "w") as f:
            f.write("half")
            raise RuntimeError
    assert json.loads(target.read_text()) == {"a": 1} and os.listdir(tmp_path) == ["f.json"]
