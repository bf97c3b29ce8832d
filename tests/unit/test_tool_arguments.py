"""Issue 46, a property per tool: random (mostly bad) command lines never change a file
the tool did not create, and always end in exit 0 or one `error:` line. The arguments
are drawn (seeded) from a workspace of inputs and other tools' outputs (a Hugging Face
folder, a run folder, a folder of notes), flags with odd values, and junk; never
--overwrite."""

import random
import shutil
from pathlib import Path

import pytest

from tests.helpers import FIXTURES, load_tool
from tests.unit.test_outputs import snapshot

EXAMPLES = 30  # command lines drawn per tool (seeded: the same ones every run)


def workspace(root: Path) -> Path:
    root.mkdir()
    (root / "data.txt").write_text("plain text to read\n" * 3)
    (root / "notes.jsonl").write_text('{"text": "one"}\n{"text": "two"}\n')
    (root / "bad.jsonl").write_text('{"text": "ok"}\n{"body": 3}\n{nope\n')
    (root / "latin1.txt").write_bytes(b"caf\xe9\n")
    (root / "old.bin").write_bytes(b"not written by prepare_data")
    (root / "not_tokenizer.json").write_text('{"model": 1, "x": [}')
    shutil.copytree(FIXTURES / "hf" / "tied_gqa", root / "model_hf")
    (root / "run" / "checkpoints").mkdir(parents=True)
    (root / "run" / "summary.json").write_text('{"status": "completed"}')
    (root / "docs").mkdir()
    (root / "docs" / "page.md").write_text("# mine")
    from tests.unit.test_provenance import word_tokenizer

    word_tokenizer(root / "tok.json", ["plain", "text", "to", "read"])
    for folder in ("run", "model_hf"):  # what item 3's preparation replaced
        shutil.copy(root / "tok.json", root / folder / "tokenizer.json")
    return root


JUNK = ["-", "--", "=", "x", "-x", "--nope", "a=b", "..", "./", "0", ""]
NUMBERS = ["0", "-1", "1", "300", "70000", "x", "1e3", ""]


def draw(rng: random.Random, root: Path, names: list[str], flags: dict[str, list[str]],
         first: list[str] | None = None) -> list[str]:
    """A command line: mostly an output (drawn from `first`, default `names`) and one or
    two inputs of the workspace, then up to two flags (each with a drawn value), then
    maybe junk."""
    count = rng.choice([0, 1, 2, 2, 2, 3, 3])
    argv = [str(root / rng.choice(names if n or not first else first)) for n in range(count)]
    for flag in rng.sample(sorted(flags), k=min(len(flags), rng.randint(0, 2))):
        argv += [flag] + ([rng.choice(flags[flag])] if flags[flag] else [])
    if rng.random() < 0.15:
        argv.insert(rng.randint(0, len(argv)), rng.choice(JUNK))
    return argv


def check(tool: str, argv: list[str], root: Path, before: dict, capsys) -> None:
    status = load_tool(tool).main(argv)
    err = [ln for ln in capsys.readouterr().err.splitlines() if ln.strip()]
    if status != 0:
        assert len(err) == 1 and err[0].startswith("error: "), (argv, err)
    now = snapshot(root)
    assert {k: now.get(k) for k in before} == before, argv


@pytest.fixture
def root(tmp_path):
    return workspace(tmp_path / "w")


def test_prepare_data_never_changes_a_file_it_did_not_create(root, capsys):
    before, rng = snapshot(root), random.Random(46)
    names = ["data.txt", "notes.jsonl", "bad.jsonl", "latin1.txt", "not_tokenizer.json",
             "model_hf", "run", "docs", "docs/page.md", "missing.txt", "new_corpus",
             "new.bin", "old.bin"]
    flags = {"--eos-id": NUMBERS, "--shard-tokens": NUMBERS, "--processes": ["0", "-1", "x"],
             "--tokenizer": [str(root / n) for n in names], "--text-field": ["text", "body"],
             "--separator": ["", "|"]}
    outs = ["old.bin", "data.txt", "run", "model_hf", "docs", "new.bin", "new_corpus"]
    flags["--tokenizer"] += [str(root / "tok.json")] * 6
    for _ in range(EXAMPLES):
        argv = draw(rng, root, names, flags, first=outs)
        check("prepare_data", argv + ["--processes", "1"], root, before, capsys)


def test_train_tokenizer_never_changes_a_file_it_did_not_create(root, capsys):
    before, rng = snapshot(root), random.Random(46)
    names = ["data.txt", "notes.jsonl", "bad.jsonl", "latin1.txt", "not_tokenizer.json",
             "model_hf", "model_hf/config.json", "docs", "missing.txt", "new_tok.json",
             "nowhere/tok.json"]
    flags = {"--vocab-size": NUMBERS, "--text-field": ["text", "body"]}
    # (tok.json is this tool's own kind of output, which it replaces by design)
    outs = ["notes.jsonl", "data.txt", "not_tokenizer.json", "model_hf", "new_tok.json"]
    for _ in range(EXAMPLES):
        check("train_tokenizer", draw(rng, root, names, flags, first=outs), root, before,
              capsys)


def test_export_hf_never_changes_a_file_it_did_not_create(root, capsys):
    before, rng = snapshot(root), random.Random(46)
    names = ["model_hf", "run", "docs", "data.txt", "missing", "new_export",
             "model_hf/config.json"]
    flags = {"--step": NUMBERS, "--dtype": ["float32", "int8"],
             "--max-shard-size": ["5GB", "0", "x"]}
    for _ in range(EXAMPLES // 2):
        check("export_hf", draw(rng, root, names, flags, first=["model_hf"]), root, before,
              capsys)
