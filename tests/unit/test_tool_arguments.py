"""Issue 46, a property per tool: random (mostly bad) command lines never change a file
the tool did not create, and always end in exit 0 or one `error:` line. The arguments
are drawn from a workspace of inputs and other tools' outputs (a Hugging Face folder, a
run folder, a folder of notes), flags with odd values, and junk; never --overwrite."""

import shutil
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

from tests.helpers import FIXTURES, load_tool
from tests.unit.test_outputs import snapshot

QUICK = settings(max_examples=20, deadline=None, derandomize=True,
                 suppress_health_check=[HealthCheck.function_scoped_fixture])


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
    return root


def paths(root: Path, *names: str) -> st.SearchStrategy[str]:
    return st.sampled_from([str(root / n) for n in names])


JUNK = st.text(alphabet="-=abc./0123456789x", min_size=0, max_size=8)
NUMBER = st.sampled_from(["0", "-1", "1", "300", "70000", "x", "1e3", ""])


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
    before = snapshot(root)
    anything = paths(root, "data.txt", "notes.jsonl", "bad.jsonl", "latin1.txt",
                     "not_tokenizer.json", "model_hf", "run", "docs", "docs/page.md",
                     "missing.txt", "new_corpus", "new.bin", "old.bin")
    flag = st.one_of(st.tuples(st.sampled_from(["--eos-id", "--shard-tokens", "--processes"]),
                               NUMBER),
                     st.tuples(st.just("--tokenizer"), anything),
                     st.tuples(st.just("--text-field"), st.sampled_from(["text", "body", ""])),
                     st.tuples(JUNK))

    @QUICK
    @given(st.lists(anything, min_size=0, max_size=3), st.lists(flag, max_size=3))
    def run(positional, flags):
        argv = positional + [a for f in flags for a in f]
        if "--processes" not in argv:
            argv += ["--processes", "1"]
        check("prepare_data", argv, root, before, capsys)

    run()


def test_train_tokenizer_never_changes_a_file_it_did_not_create(root, capsys):
    before = snapshot(root)
    anything = paths(root, "data.txt", "notes.jsonl", "bad.jsonl", "latin1.txt",
                     "not_tokenizer.json", "model_hf", "model_hf/config.json", "docs",
                     "missing.txt", "new_tok.json", "nowhere/tok.json")
    flag = st.one_of(st.tuples(st.just("--vocab-size"), NUMBER),
                     st.tuples(st.just("--text-field"), st.sampled_from(["text", "body"])),
                     st.tuples(JUNK))

    @QUICK
    @given(st.lists(anything, max_size=3), st.lists(flag, max_size=2))
    def run(positional, flags):
        check("train_tokenizer", positional + [a for f in flags for a in f], root, before,
              capsys)

    run()


def test_export_hf_never_changes_a_file_it_did_not_create(root, capsys):
    before = snapshot(root)
    anything = paths(root, "model_hf", "run", "docs", "data.txt", "missing", "new_export",
                     "model_hf/config.json")
    flag = st.one_of(st.tuples(st.just("--step"), NUMBER),
                     st.tuples(st.just("--dtype"), st.sampled_from(["float32", "int8"])),
                     st.tuples(st.just("--max-shard-size"), st.sampled_from(["5GB", "0", "x"])),
                     st.tuples(JUNK))

    @settings(QUICK, max_examples=12)
    @given(st.lists(anything, max_size=3), st.lists(flag, max_size=2))
    def run(positional, flags):
        check("export_hf", positional + [a for f in flags for a in f], root, before, capsys)

    run()
