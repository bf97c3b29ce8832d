"""Datasets: shapes, determinism, held-out splits, the Markov entropy floor, per-process
rows, bad input, and tools/prepare_data.py."""

import json

import jax
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

from framework.io import data
from framework.errors import ConfigError
from framework.config import DataConfig, ParallelConfig, TrainConfig
from tests.helpers import load_tool
from framework.parallel.mesh import make_mesh

TRAIN = TrainConfig(seq_len=16, global_batch_size=16, seed=3)
WORDS = "the quick brown fox jumps over a lazy dog while seven wizards box".split()
TEXT = "\n".join(" ".join(np.random.default_rng(i).choice(WORDS, 9)) for i in range(200))


def load_prepare_data():
    return load_tool("prepare_data")


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    """A text file, a uint32 token file with ids up to 999, and a corpus of 3 shards of
    ids up to 999 (framework/io/corpus.py)."""
    from framework.io import corpus

    folder = tmp_path_factory.mktemp("data")
    text = folder / "corpus.txt"
    text.write_text(TEXT)
    ids = np.random.default_rng(0).integers(0, 1000, 5000).astype(np.uint32)
    ids.tofile(folder / "ids.bin")
    docs = np.split(np.random.default_rng(1).integers(0, 1000, 20000), range(100, 20000, 100))
    (folder / "shards").mkdir()
    shards = [corpus.write_shard(str(folder / "shards"), corpus.shard_name(0, i),
                                 docs[i::3], "uint16") for i in range(3)]
    corpus.write_manifest(str(folder / "shards"), shards, tokenizer="bytes",
                          vocab_size=1000, dtype="uint16", eos_id=None)
    return {"text": str(text), "tokens": str(folder / "ids.bin"), "ids": ids,
            "corpus": str(folder / "shards")}


def config(kind, files, **kw):
    path = {"text": files["text"], "tokens": files["tokens"], "corpus": files["corpus"]}.get(kind)
    dtype = "uint32" if kind == "tokens" else "uint16"
    return DataConfig(kind=kind, path=path, token_dtype=dtype, **kw)


@pytest.mark.parametrize("kind", data.KINDS)
def test_batches_have_shape_dtype_range_and_depend_only_on_seed_and_step(kind, files):
    vocab = 1024
    ds = data.make_dataset(config(kind, files), TRAIN, vocab)
    again = data.make_dataset(config(kind, files), TRAIN, vocab)  # e.g. a resumed run
    batch = ds.train_batch(5)
    assert batch.shape == (16, 17) and batch.dtype == np.int32
    assert batch.min() >= 0 and batch.max() < vocab
    np.testing.assert_array_equal(batch, again.train_batch(5))
    assert not np.array_equal(batch, ds.train_batch(6))
    assert not np.array_equal(batch, ds.eval_batch(5))
    np.testing.assert_array_equal(ds.eval_batch(1), again.eval_batch(1))
    other_seed = TrainConfig(seq_len=16, global_batch_size=16, seed=4)
    assert not np.array_equal(batch, data.make_dataset(config(kind, files), other_seed,
                                                       vocab).train_batch(5))


@pytest.mark.parametrize("kind", ["text", "tokens"])
def test_file_rows_are_windows_of_the_train_part_and_eval_rows_of_the_held_out_part(kind, files):
    tokens = (np.frombuffer(TEXT.encode(), np.uint8) if kind == "text" else files["ids"])
    ds = data.make_dataset(config(kind, files, holdout_fraction=0.2), TRAIN, 1024)
    split = len(tokens) - int(len(tokens) * 0.2)
    windows = lambda part: {tuple(w) for w in np.lib.stride_tricks.sliding_window_view(
        part.astype(np.int64), 17)}
    train_windows, held_out_windows = windows(tokens[:split]), windows(tokens[split:])
    assert all(tuple(row) in train_windows for row in ds.train_batch(0))
    assert all(tuple(row) in held_out_windows for row in ds.eval_batch(0))


@pytest.mark.parametrize("kind", data.KINDS)
def test_a_slice_of_rows_is_exactly_those_rows_of_the_global_batch(kind, files):
    ds = data.make_dataset(config(kind, files), TRAIN, 1024)
    full = ds.train_batch(7)
    np.testing.assert_array_equal(ds.train_batch(7, slice(4, 12)), full[4:12])
    np.testing.assert_array_equal(ds.train_batch(7, [1, 9, 15]), full[[1, 9, 15]])
    np.testing.assert_array_equal(ds.eval_batch(0, slice(8, 16)), ds.eval_batch(0)[8:])


def test_markov_entropy_floor_matches_an_empirical_estimate():
    train = TrainConfig(seq_len=1024, global_batch_size=64, seed=0)
    ds = data.make_dataset(DataConfig(kind="markov", markov_concentration=0.1), train, 128)
    p, pi = ds.transition, ds.stationary  # [V, V], [V]
    np.testing.assert_allclose(p.sum(axis=1), 1.0, atol=1e-12)
    np.testing.assert_allclose(pi @ p, pi, atol=1e-12)
    assert 0.5 < ds.entropy_floor < np.log(128)
    tokens = ds.train_batch(0)  # 64 x 1024 transitions
    # Monte Carlo of H = E[-log P(x_t+1 | x_t)] along the sampled chain.
    nll = -np.log(p[tokens[:, :-1], tokens[:, 1:]])
    stderr = nll.std() / np.sqrt(nll.size)
    assert abs(nll.mean() - ds.entropy_floor) < 4 * stderr + 1e-3, (nll.mean(), ds.entropy_floor)
    # Every position is distributed as pi (the chain starts stationary).
    freq = np.bincount(tokens.reshape(-1), minlength=128) / tokens.size
    assert np.abs(freq - pi).sum() < 0.05
    # A peakier chain (smaller concentration) has a lower floor.
    peaky = data.make_dataset(DataConfig(kind="markov", markov_concentration=0.01), train, 128)
    assert peaky.entropy_floor < ds.entropy_floor


def test_synthetic_and_markov_have_no_known_floor_except_markov():
    assert data.make_dataset(DataConfig(kind="synthetic"), TRAIN, 64).entropy_floor is None
    assert data.make_dataset(DataConfig(kind="markov"), TRAIN, 64).entropy_floor > 0


def mesh(pipeline, dp, tensor, devices=None):
    return make_mesh(ParallelConfig(pipeline=pipeline, data=dp, tensor=tensor), devices)


@pytest.mark.parametrize("layout,process0_rows", [
    ((1, 8, 1), range(0, 8)),  # devices 0-3 hold data shards 0-3: the first half
    ((1, 2, 4), range(0, 8)),  # devices 0-3 are data shard 0 (x 4 tensor)
    ((2, 2, 2), range(0, 16)),  # devices 0-3 are pipe rank 0: every row
])
def test_rows_of_a_process_are_the_rows_its_devices_hold(layout, process0_rows):
    devices = jax.devices()
    sharding = NamedSharding(mesh(*layout), P("data"))
    rows = data.rows_for_devices(sharding, (16, 17), devices[:4])
    np.testing.assert_array_equal(rows, list(process0_rows))
    second = data.rows_for_devices(sharding, (16, 17), devices[4:])
    assert set(rows) | set(second) == set(range(16))


def test_non_contiguous_rows_and_the_global_array_built_from_them(files):
    # Devices ordered so that "process 0" (devices 0-3) holds data shards 0 and 2.
    devices = jax.devices()
    order = [devices[i] for i in (0, 1, 4, 5, 2, 3, 6, 7)]
    sharding = NamedSharding(mesh(1, 4, 2, order), P("data"))
    rows = data.rows_for_devices(sharding, (16, 17), devices[:4])
    np.testing.assert_array_equal(rows, [0, 1, 2, 3, 8, 9, 10, 11])
    ds = data.make_dataset(config("markov", files), TRAIN, 128)
    np.testing.assert_array_equal(ds.train_batch(2, rows), ds.train_batch(2)[rows])
    # One process here: it holds all rows, and the assembled array is the global batch.
    np.testing.assert_array_equal(data.process_rows(sharding, (16, 17)), np.arange(16))
    batch = data.sharded_batch(ds.train_batch, 2, sharding, ds.global_shape)
    assert batch.sharding == sharding and batch.dtype == np.int32
    np.testing.assert_array_equal(np.asarray(batch), ds.train_batch(2))


def test_bad_input_raises_one_clear_line(files, tmp_path):
    short = tmp_path / "short.txt"
    short.write_text("too short")
    odd = tmp_path / "odd.bin"
    odd.write_bytes(b"\x01\x02\x03")
    cases = [
        (DataConfig(kind="parquet"), 256, "data.kind='parquet' is not one of"),
        (DataConfig(kind="text"), 256, "needs data.path="),
        (DataConfig(kind="text", path=str(tmp_path / "nope.txt")), 256, "does not exist"),
        (DataConfig(kind="text", path=files["text"]), 128, "set model.vocab_size >= 256"),
        (DataConfig(kind="text", path=str(short)), 256, "fewer than train.seq_len+1=17"),
        (DataConfig(kind="tokens", path=files["tokens"], token_dtype="uint32"), 512,
         "set model.vocab_size >= 1000"),
        (DataConfig(kind="tokens", path=str(odd), token_dtype="uint16"), 512,
         "not a multiple of 2"),
        (DataConfig(kind="tokens", path=files["tokens"], token_dtype="int8"), 512,
         "data.token_dtype='int8'"),
        (DataConfig(kind="markov"), 8192, "model.vocab_size=8192 > 4096"),
        (DataConfig(kind="synthetic", holdout_fraction=1.0), 256, "must be in [0, 1)"),
    ]
    for cfg, vocab, message in cases:
        with pytest.raises(ConfigError) as err:
            data.make_dataset(cfg, TRAIN, vocab)
        assert message in str(err.value) and "\n" not in str(err.value), (cfg, str(err.value))
    no_holdout = data.make_dataset(config("text", files, holdout_fraction=0.0), TRAIN, 256)
    with pytest.raises(ConfigError, match="data.holdout_fraction > 0"):
        no_holdout.eval_batch(0)


def test_prepare_data_round_trips_text_files(files, tmp_path):
    prepare_data = load_prepare_data()
    second = tmp_path / "second.txt"
    second.write_text("é and ü: UTF-8 survives byte-level tokens\n")
    out = tmp_path / "train.bin"
    meta = prepare_data.build([str(out), files["text"], str(second), "--separator", "\n"])
    ids = np.fromfile(out, dtype=np.uint16)
    assert meta["dtype"] == "uint16" and meta["n_tokens"] == ids.size
    assert json.loads((tmp_path / "train.bin.json").read_text())["vocab_size"] == 256
    assert ids.astype(np.uint8).tobytes().decode("utf-8") == TEXT + "\n" + second.read_text()
    # A token file of one text file gives exactly the batches data.kind=text gives.
    single = tmp_path / "single.bin"
    prepare_data.build([str(single), files["text"]])
    as_tokens = data.make_dataset(DataConfig(kind="tokens", path=str(single)), TRAIN, 256)
    as_text = data.make_dataset(DataConfig(kind="text", path=files["text"]), TRAIN, 256)
    np.testing.assert_array_equal(as_tokens.train_batch(3), as_text.train_batch(3))
    np.testing.assert_array_equal(as_tokens.eval_batch(0), as_text.eval_batch(0))
    # The sidecar catches a wrong data.token_dtype.
    with pytest.raises(ConfigError, match="set data.token_dtype=uint16"):
        data.make_dataset(DataConfig(kind="tokens", path=str(single), token_dtype="uint32"),
                          TRAIN, 256)


def test_prepare_data_with_a_local_tokenizer_or_a_clear_message_without_it(files, tmp_path):
    prepare_data = load_prepare_data()
    out = tmp_path / "tok.bin"
    try:
        import tokenizers
    except ImportError:
        with pytest.raises(ConfigError, match="tokenizers"):
            prepare_data.build([str(out), files["text"], "--tokenizer", "tokenizer.json"])
        return
    from tokenizers import Tokenizer, models, pre_tokenizers
    words = sorted(set(TEXT.split()))
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words + ["[UNK]"])},
                                     unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.save(str(tmp_path / "tokenizer.json"))
    meta = prepare_data.build([str(out), files["text"], "--tokenizer",
                              str(tmp_path / "tokenizer.json"), "--eos-id", str(len(words))])
    ids = np.fromfile(out, dtype=np.uint16)
    assert ids[-1] == len(words) and meta["vocab_size"] == len(words) + 1
    inverse = {i: w for i, w in enumerate(words)}
    assert " ".join(inverse[int(i)] for i in ids[:-1]) == " ".join(TEXT.split())
    assert tokenizers.__version__


def test_a_uint16_file_read_as_uint32_is_told_to_say_uint16(tmp_path):
    import numpy as np
    import pytest

    from framework.config import DataConfig
    from framework.errors import ConfigError
    from framework.io.data import open_tokens

    path = tmp_path / "tokens.bin"
    np.random.default_rng(0).integers(0, 250, 4096).astype(np.uint16).tofile(path)
    with pytest.raises(ConfigError, match="looks like uint16 ids read as uint32: set "
                                          "data.token_dtype=uint16"):
        open_tokens(DataConfig(kind="tokens", path=str(path), token_dtype="uint32"), 256)
    assert open_tokens(DataConfig(kind="tokens", path=str(path), token_dtype="uint16"),
                       256)[0].max() < 250
