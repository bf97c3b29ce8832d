"""A sharded corpus (framework/io/corpus.py, `data.kind=corpus`) and its preparation
(`tools/prepare_data.py <folder>`, framework/io/prepare.py): documents in, shards and a
manifest out, a restart that skips finished inputs; sequences in epochs without
replacement, a pure function of (seed, step, row); bad shards as one line."""

import json
import os

import numpy as np
import pytest

from framework.config import DataConfig, TrainConfig
from framework.errors import ConfigError
from framework.io import corpus, corpus_dataset, data
from tests.helpers import load_tool

TRAIN = TrainConfig(seq_len=8, global_batch_size=4, seed=5)


@pytest.mark.parametrize("n", [1, 2, 3, 17, 1000, 4097])
def test_the_permutation_is_a_bijection_of_its_range_and_depends_on_its_key(n):
    got = corpus.permute(np.arange(n), n, (1, 2))
    assert sorted(got.tolist()) == list(range(n))
    if n >= 17:
        assert got.tolist() != corpus.permute(np.arange(n), n, (1, 3)).tolist()


def numbered_corpus(folder, n_tokens: int, shard_tokens: int):
    """A corpus whose token at stream position t is t (uint16): a row names its window."""
    stream = np.arange(n_tokens, dtype=np.uint16)
    docs = np.split(stream, range(5, n_tokens, 5))  # documents of 5 tokens
    shards, per = [], max(1, shard_tokens // 5)
    for part, lo in enumerate(range(0, len(docs), per)):
        shards.append(corpus.write_shard(str(folder), corpus.shard_name(0, part),
                                         docs[lo:lo + per], "uint16"))
    corpus.write_manifest(str(folder), shards, tokenizer="bytes", vocab_size=2**16,
                          dtype="uint16", eos_id=None)
    return folder


def dataset(folder, holdout=0.0, verify="checksum", train=TRAIN, vocab=2**16):
    cfg = DataConfig(kind="corpus", path=str(folder), holdout_fraction=holdout, verify=verify)
    return data.make_dataset(cfg, train, vocab)


def test_every_sequence_once_per_epoch_in_a_new_order_each_epoch(tmp_path):
    ds = dataset(numbered_corpus(tmp_path, 8 * 24 + 1, 40))  # 24 sequences, 7 shards
    assert ds.n_train == 24
    steps = ds.n_train // TRAIN.global_batch_size  # one epoch
    first = lambda step: (ds.train_batch(step)[:, 0] // TRAIN.seq_len).tolist()
    epoch0 = [s for step in range(steps) for s in first(step)]
    epoch1 = [s for step in range(steps, 2 * steps) for s in first(step)]
    assert sorted(epoch0) == sorted(epoch1) == list(range(24)) and epoch0 != epoch1
    batch = ds.train_batch(3)  # windows of seq_len + 1 consecutive tokens, across shards
    assert (np.diff(batch, axis=1) == 1).all() and batch.shape == (4, 9)
    again = dataset(tmp_path)  # a resumed run, any rows of it
    assert (again.train_batch(3, rows=[1, 3]) == batch[[1, 3]]).all()


def test_held_out_sequences_are_never_trained_on(tmp_path):
    ds = dataset(numbered_corpus(tmp_path, 8 * 40 + 1, 1000), holdout=0.2)
    assert (ds.n_train, ds.n_eval) == (32, 8)
    trained = {int(s) for step in range(16) for s in ds.train_batch(step)[:, 0] // 8}
    held = {int(s) for i in range(2) for s in ds.eval_batch(i)[:, 0] // 8}
    assert trained == set(range(32)) and held == set(range(32, 40))


def damage(folder, how: str):
    manifest = json.loads((folder / corpus.MANIFEST).read_text())
    path = folder / manifest["shards"][1]["file"]
    if how == "missing":
        path.unlink()
    elif how == "truncated":
        path.write_bytes(path.read_bytes()[:-2])
    else:  # the same size, one byte changed
        raw = bytearray(path.read_bytes())
        raw[3] ^= 0xFF
        path.write_bytes(bytes(raw))
    return path


@pytest.mark.parametrize("how,says", [("missing", "is missing"),
                                      ("truncated", "is truncated or was replaced"),
                                      ("corrupted", "does not match its manifest's SHA-256")])
def test_a_damaged_shard_is_one_line_before_training(tmp_path, how, says):
    path = damage(numbered_corpus(tmp_path, 8 * 24 + 1, 40), how)
    with pytest.raises(ConfigError) as err:
        dataset(tmp_path)
    assert says in str(err.value) and str(path) in str(err.value)
    assert "\n" not in str(err.value)
    if how == "corrupted":  # data.verify=size reads no bytes: it cannot see this one
        dataset(tmp_path, verify="size")


@pytest.mark.parametrize("case,says", [
    ("vocab", "model.vocab_size=1000"), ("small", "fewer than one batch"),
    ("no manifest", "holds no manifest.json"), ("verify", "data.verify='all'")])
def test_bad_corpora_and_settings_are_one_line(tmp_path, case, says):
    (tmp_path / "c").mkdir()
    folder = numbered_corpus(tmp_path / "c", 8 * 24 + 1, 40)
    with pytest.raises(ConfigError) as err:
        if case == "vocab":
            dataset(folder, vocab=1000)
        elif case == "small":
            dataset(folder, train=TrainConfig(seq_len=8, global_batch_size=32))
        elif case == "no manifest":
            dataset(tmp_path)
        else:
            dataset(folder, verify="all")
    assert says in str(err.value) and "\n" not in str(err.value)


def test_prepare_shards_from_text_and_json_lines_and_resume(tmp_path):
    docs = [f"document {i}: " + "words " * (i % 7) for i in range(50)]
    (tmp_path / "a.jsonl").write_text("".join(json.dumps({"body": d}) + "\n" for d in docs[:40]))
    (tmp_path / "b.txt").write_text(docs[40])
    inputs = [str(tmp_path / "a.jsonl"), str(tmp_path / "b.txt")]
    out = tmp_path / "corpus"
    args = [str(out), *inputs, "--processes", "2", "--shard-tokens", "200",
            "--text-field", "body"]
    manifest = load_tool("prepare_data").build(args)
    assert manifest["documents"] == 41 and len(manifest["shards"]) > 2
    shards, _ = corpus.open_corpus(str(out), 256)
    stream = np.concatenate([np.asarray(s.tokens) for s in shards])
    assert bytes(stream.astype(np.uint8)) == "".join(docs[:41]).encode()
    index = np.fromfile(out / manifest["shards"][0]["index"], dtype=np.uint64)
    assert index[0] == 0 and index[-1] == manifest["shards"][0]["tokens"]
    # a restart redoes only the input whose record is gone, and ends with the same corpus
    os.remove(out / "input-00001.done")
    stamp = os.path.getmtime(out / manifest["shards"][0]["file"])
    assert load_tool("prepare_data").build(args) == manifest
    assert os.path.getmtime(out / manifest["shards"][0]["file"]) == stamp


def test_named_validation_sets_are_whole_corpora_checked_before_training(tmp_path):
    from framework.config import EvalConfig

    folder = numbered_corpus(tmp_path, 8 * 24 + 1, 40)
    cfg = DataConfig()
    sets = corpus_dataset.eval_sets(EvalConfig(every=5, sets={"wiki": str(folder)}), cfg,
                                    TRAIN, 2**16)
    held = sets["wiki"]
    assert held.n_eval == 24 and held.n_train == 0
    assert sorted(held.eval_batch(0)[:, 0] // 8) == [0, 1, 2, 3]
    for sets_, every, says in [({"wiki": str(tmp_path / "none")}, 5, "eval.sets.wiki="),
                               ({"a b": str(folder)}, 5, "not a plain name"),
                               ({"wiki": str(folder)}, 0, "needs eval.every > 0"),
                               ("wiki", 5, "is not a mapping")]:
        with pytest.raises(ConfigError) as err:
            corpus_dataset.eval_sets(EvalConfig(every=every, sets=sets_), cfg, TRAIN, 2**16)
        assert says in str(err.value) and "\n" not in str(err.value)


def test_the_loader_benchmark_reads_a_corpus(tmp_path, capsys):
    folder = numbered_corpus(tmp_path, 8 * 24 + 1, 40)
    bench = load_tool("bench_loader").main
    assert bench([str(folder), "--seq-len", "8", "--batch", "4", "--steps", "3",
                  "--step-time", "1"]) == 0
    assert "tokens/s" in capsys.readouterr().out
    assert bench([str(tmp_path / "none")]) == 2


def test_a_mixture_takes_each_corpus_in_its_share_each_in_its_own_epochs(tmp_path):
    (tmp_path / "a").mkdir(), (tmp_path / "b").mkdir()
    a = numbered_corpus(tmp_path / "a", 8 * 300 + 1, 400)  # tokens 0..2400
    b = numbered_corpus(tmp_path / "b", 8 * 300 + 1, 400)
    # b's tokens shifted up by 10,000: a row says which corpus it came from
    for shard in (b).glob("*.bin"):
        (np.fromfile(shard, np.uint16) + 10_000).astype(np.uint16).tofile(shard)
    manifest = json.loads((b / corpus.MANIFEST).read_text())
    for entry in manifest["shards"]:
        entry["file_sha256"] = corpus.sha256(str(b / entry["file"]))
    manifest["seal"] = corpus.seal(manifest)  # edited on purpose: sealed again
    (b / corpus.MANIFEST).write_text(json.dumps(manifest))
    mix = [{"path": str(a), "weight": 3}, {"path": str(b), "weight": 1}]
    train = TrainConfig(seq_len=8, global_batch_size=64, seed=2)
    ds = data.make_dataset(DataConfig(kind="corpus", mixture=mix, holdout_fraction=0.0),
                           train, 2**16)
    firsts = np.concatenate([ds.train_batch(s)[:, 0] for s in range(64)])  # one block
    from_b = firsts >= 10_000
    assert from_b.mean() == pytest.approx(0.25, abs=0.002)  # 1024 of 4096, to rounding
    # the block's 3,072 samples of a are its samples 0..3071: 10.24 epochs of its 300
    # sequences, so each sequence 10 or 11 times
    seen = np.bincount(firsts[~from_b] // 8, minlength=300)
    assert len(seen) == 300 and set(seen.tolist()) == {10, 11} and seen.sum() == 3072
    again = data.make_dataset(DataConfig(kind="corpus", mixture=mix, holdout_fraction=0.0),
                              train, 2**16)
    assert (again.train_batch(5, rows=[3, 60]) == ds.train_batch(5)[[3, 60]]).all()
    (tmp_path / "small").mkdir()  # 10 sequences, fewer than a batch: a small share is fine
    small = numbered_corpus(tmp_path / "small", 8 * 10 + 1, 400)
    few = data.make_dataset(DataConfig(kind="corpus", holdout_fraction=0.0, mixture=[
        {"path": str(a), "weight": 0.99}, {"path": str(small), "weight": 0.01}]), train, 2**16)
    assert few.train_batch(0).shape == (64, 9)
    for bad, says in [([{"path": str(a), "weight": -1}], "must be a number >= 0"),
                      ([{"weight": 1}], "names no corpus"), ("web/", "is not a list"),
                      ([{"path": str(a), "weight": 0}], "add up to 0")]:
        with pytest.raises(ConfigError) as err:
            data.make_dataset(DataConfig(kind="corpus", mixture=bad), train, 2**16)
        assert says in str(err.value) and "\n" not in str(err.value)


def test_a_prepared_folder_as_data_path_of_tokens_reads_as_a_corpus(tmp_path):
    folder = numbered_corpus(tmp_path, 8 * 24 + 1, 40)
    ds = data.make_dataset(DataConfig(kind="tokens", path=str(folder), holdout_fraction=0.0),
                           TRAIN, 2**16)
    assert ds.n_train == 24 and (np.diff(ds.train_batch(0), axis=1) == 1).all()


def test_a_trained_tokenizer_ends_documents_with_id_0_and_masks_by_it(tmp_path):
    """tools/train_tokenizer.py, then prepare_data --eos-id 0: text round-trips through
    the byte-level BPE, and the corpus's separator is what data.document_mask uses."""
    from tokenizers import Tokenizer

    docs = [{"text": f"document {i}: the pipeline sends its activations on.\n"}
            for i in range(300)]
    (tmp_path / "d.jsonl").write_text("".join(json.dumps(d) + "\n" for d in docs))
    tool = load_tool("train_tokenizer").main
    assert tool([str(tmp_path / "tok.json"), str(tmp_path / "d.jsonl"), "--vocab-size", "300"]) == 0
    tok = Tokenizer.from_file(str(tmp_path / "tok.json"))
    assert tok.token_to_id("<|endoftext|>") == 0
    text = "Grüße: the pipeline"
    assert tok.decode(tok.encode(text).ids) == text
    assert tool([str(tmp_path / "x.json"), str(tmp_path / "nothing.txt")]) == 2
    load_tool("prepare_data").build([str(tmp_path / "c"), str(tmp_path / "d.jsonl"),
                                    "--tokenizer", str(tmp_path / "tok.json"), "--eos-id", "0"])
    train = TrainConfig(seq_len=16, global_batch_size=2)
    dataset = data.make_dataset(DataConfig(kind="corpus", path=str(tmp_path / "c")), train, 512)
    cfg = DataConfig(kind="corpus", document_mask=True)
    assert data.document_mask(cfg, dataset, {}).separator == 0
    assert (dataset.train_batch(0) == 0).any()  # documents end inside the rows
    load_tool("prepare_data").build([str(tmp_path / "b"), str(tmp_path / "d.jsonl")])  # bytes
    mix = [{"path": str(tmp_path / "c"), "weight": 1}, {"path": str(tmp_path / "b"), "weight": 1}]
    with pytest.raises(ConfigError, match="different tokenizers"):
        data.make_dataset(DataConfig(kind="corpus", mixture=mix), train, 512)
    from framework.io import tokenizer  # a run on the corpus decodes with its tokenizer
    copy = str(tmp_path / "c" / "tokenizer.json")
    assert tokenizer.for_run("corpus", str(tmp_path / "c"), 512, None) == copy
    assert tokenizer.for_run("corpus", None, 512, None, [{"path": str(tmp_path / "c")}]) == copy


def test_a_flat_token_file_records_its_end_of_document_token(tmp_path):
    """prepare_data OUT.bin --eos-id: byte-level too, the id follows every file and the
    sidecar records it, so data=tokens can mask documents; without it, one line."""
    (tmp_path / "a.txt").write_text("one document")
    (tmp_path / "b.txt").write_text("another one")
    prepare = load_tool("prepare_data").main
    prepare([str(tmp_path / "t.bin"), str(tmp_path / "a.txt"), str(tmp_path / "b.txt"),
             "--eos-id", "0"])
    ids = np.fromfile(tmp_path / "t.bin", np.uint16)
    assert ids.tolist().count(0) == 2 and ids[-1] == 0 and ids[12] == 0
    cfg = DataConfig(kind="tokens", path=str(tmp_path / "t.bin"), holdout_fraction=0.0,
                     document_mask=True)
    train = TrainConfig(seq_len=4, global_batch_size=2)
    assert data.document_mask(cfg, data.make_dataset(cfg, train, 256), {}).separator == 0
    prepare([str(tmp_path / "u.bin"), str(tmp_path / "a.txt"), str(tmp_path / "b.txt")])
    cfg = DataConfig(kind="tokens", path=str(tmp_path / "u.bin"), document_mask=True,
                     holdout_fraction=0.0)
    with pytest.raises(ConfigError, match="has none"):
        data.document_mask(cfg, data.make_dataset(cfg, train, 256), {})
