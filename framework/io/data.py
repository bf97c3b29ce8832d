"""Token datasets. Every row of every batch is a pure function of (seed, split, index, row).

Kinds (`data.kind`):
    synthetic  uniform random tokens over the model's vocabulary (throughput runs)
    markov     a fixed, seeded first-order Markov chain over the vocabulary; its entropy
               rate is the lowest loss any model can reach (`entropy_floor`)
    text       any UTF-8 file read as bytes: vocabulary 256, no tokenizer, no downloads
    tokens     a flat binary file of uint16/uint32 token ids, memory-mapped
               (`tools/prepare_data.py` builds one)
    corpus     a folder of token shards with a manifest (`tools/prepare_data.py <folder>`):
               packed sequences in epochs without replacement (framework/io/corpus.py)

Row r of training step s comes from its own generator seeded with (seed, TRAIN, s, r),
so a resumed run sees exactly the batches an uninterrupted run saw, on any mesh, and a
process builds only the rows its own devices hold (`process_rows`, `sharded_batch`).
Held-out data for `eval/loss`: the last `holdout_fraction` of a file, or a separate
seed stream (EVAL) for the generated kinds.
"""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Callable

import jax
import numpy as np

from framework.errors import ConfigError
from framework.config import CHOICES, DataConfig, TrainConfig, not_one_of
from framework.io import corpus
from framework.io.dataset import CHAIN, EVAL, TRAIN, Dataset
from framework.model.documents import DocumentMask

KINDS = CHOICES["data.kind"]
VERIFY = CHOICES["data.verify"]
MAX_MARKOV_VOCAB = 4096  # the chain is a dense [vocab, vocab] float64 matrix


class SyntheticDataset(Dataset):
    """Uniform random tokens: no structure to learn (loss floor log(vocab))."""

    def _rows(self, rngs, split):
        return np.stack([g.integers(0, self.vocab_size, self.seq_len + 1) for g in rngs])


class MarkovDataset(Dataset):
    """Tokens from a first-order Markov chain whose transition rows P[i] ~ Dirichlet(alpha).

    Each row starts from the stationary distribution pi, so every position of every row
    is distributed as pi and the best achievable next-token loss is the entropy rate
    H = -sum_i pi_i sum_j P_ij log P_ij (Cover & Thomas, Elements of Information
    Theory, Thm 4.2.4), reported as `data/entropy_floor`.
    """

    def __init__(self, train: TrainConfig, vocab_size: int, concentration: float):
        super().__init__(train, vocab_size)
        rng = np.random.default_rng([self.seed, CHAIN])
        self.transition = rng.dirichlet(np.full(vocab_size, concentration), size=vocab_size)
        self.stationary = stationary_distribution(self.transition)
        self.entropy_floor = entropy_rate(self.transition, self.stationary)
        # Row i of the cumulative matrix shifted by i: one sorted [V * V] array, so one
        # searchsorted samples the next token of many rows in different states at once.
        cum = np.cumsum(self.transition, axis=1)
        cum[:, -1] = 1.0
        self._shifted_cum = (cum + np.arange(vocab_size)[:, None]).reshape(-1)
        self._start_cum = np.cumsum(self.stationary)
        self._start_cum[-1] = 1.0

    def _rows(self, rngs, split):
        u = np.stack([g.random(self.seq_len + 1) for g in rngs])  # [rows, seq_len + 1]
        out = np.empty(u.shape, np.int64)
        out[:, 0] = np.searchsorted(self._start_cum, u[:, 0], side="right")
        for t in range(1, u.shape[1]):
            prev = out[:, t - 1]
            flat = np.searchsorted(self._shifted_cum, prev + u[:, t], side="right")
            out[:, t] = flat - prev * self.vocab_size
        return np.minimum(out, self.vocab_size - 1)  # guards u within 1 ulp of 1.0


def stationary_distribution(transition: np.ndarray, tol: float = 1e-14) -> np.ndarray:
    """pi with pi = pi P, by power iteration (P [V, V] row-stochastic, irreducible)."""
    pi = np.full(transition.shape[0], 1.0 / transition.shape[0])
    for _ in range(100_000):
        nxt = pi @ transition
        nxt /= nxt.sum()
        if np.max(np.abs(nxt - pi)) < tol:
            return nxt
        pi = nxt
    raise RuntimeError("the Markov chain's stationary distribution did not converge")


def entropy_rate(transition: np.ndarray, stationary: np.ndarray) -> float:
    """H = -sum_i pi_i sum_j P_ij log P_ij in nats/token (0 log 0 = 0)."""
    p = transition
    plogp = np.where(p > 0, p * np.log(np.where(p > 0, p, 1.0)), 0.0)  # [V, V]
    return float(-(stationary * plogp.sum(axis=1)).sum())


class FileDataset(Dataset):
    """Windows of seq_len + 1 consecutive tokens at random offsets of a token array:
    the first (1 - holdout_fraction) for training, the rest held out."""

    def __init__(self, train: TrainConfig, vocab_size: int, tokens: np.ndarray,
                 holdout_fraction: float, name: str):
        super().__init__(train, vocab_size)
        split = len(tokens) - int(len(tokens) * holdout_fraction)
        self.parts = {TRAIN: tokens[:split], EVAL: tokens[split:]}  # views, not copies
        self.has_eval = holdout_fraction > 0
        need = self.seq_len + 1
        for part, what in ((TRAIN, "training"), (EVAL, "held-out")):
            if (part == TRAIN or self.has_eval) and len(self.parts[part]) < need:
                raise ConfigError(
                    f"{name} has {len(self.parts[part])} {what} tokens (data.holdout_fraction="
                    f"{holdout_fraction}), fewer than train.seq_len+1={need}: use a longer "
                    f"file or a shorter train.seq_len")

    def _rows(self, rngs, split):
        part = self.parts[split]
        starts = [int(g.integers(0, len(part) - self.seq_len)) for g in rngs]
        return np.stack([np.asarray(part[s:s + self.seq_len + 1]) for s in starts])


def _check_path(cfg: DataConfig, what: str) -> str:
    if not cfg.path:
        raise ConfigError(f"data.kind={cfg.kind} needs data.path=<{what}>")
    path = os.path.expanduser(cfg.path)
    if not os.path.isfile(path):
        raise ConfigError(f"data.path={cfg.path} does not exist or is not a file "
                          f"(data.kind={cfg.kind} needs {what})")
    if os.path.getsize(path) == 0:
        raise ConfigError(f"data.path={cfg.path} is empty")
    return path


def open_text(cfg: DataConfig, vocab_size: int) -> np.ndarray:
    """Byte-level tokens of a text file: [n_bytes] uint8, memory-mapped."""
    path = _check_path(cfg, "a UTF-8 text file")
    if vocab_size < 256:
        raise ConfigError(f"data.kind=text uses byte tokens (vocabulary 256) but "
                          f"model.vocab_size={vocab_size}: set model.vocab_size >= 256")
    return np.memmap(path, dtype=np.uint8, mode="r")


def open_tokens(cfg: DataConfig, vocab_size: int) -> tuple[np.ndarray, dict]:
    """A flat binary file of token ids ([n_tokens] uint16/uint32, memory-mapped) and what
    its sidecar says ({} without one)."""
    path = _check_path(cfg, "a flat uint16/uint32 token file from tools/prepare_data.py")
    problem = not_one_of("data.token_dtype", cfg.token_dtype)
    if problem:
        raise ConfigError(problem)
    meta = _check_sidecar(path, cfg)
    itemsize = np.dtype(cfg.token_dtype).itemsize
    if os.path.getsize(path) % itemsize:
        raise ConfigError(f"data.path={cfg.path} is {os.path.getsize(path)} bytes, not a "
                          f"multiple of {itemsize}: is data.token_dtype={cfg.token_dtype} right?")
    tokens = np.memmap(path, dtype=cfg.token_dtype, mode="r")
    top = max_token(tokens)
    if top >= vocab_size:
        raise ConfigError(f"data.path={cfg.path} holds token id {top} but model.vocab_size="
                          f"{vocab_size}: {_vocab_hint(path, cfg, top, vocab_size)}")
    return tokens, meta


def _vocab_hint(path: str, cfg: DataConfig, top: int, vocab_size: int) -> str:
    """What to change: a uint16 file read as uint32 shows huge ids that fit as uint16."""
    if cfg.token_dtype == "uint32" and top >= 2**16:
        if max_token(np.memmap(path, dtype="uint16", mode="r")) < vocab_size:
            return ("the file looks like uint16 ids read as uint32: set "
                    "data.token_dtype=uint16 (tools/prepare_data.py writes uint16 for "
                    "vocabularies up to 65536)")
    return f"set model.vocab_size >= {top + 1}"


def _check_sidecar(path: str, cfg: DataConfig) -> dict:
    """tools/prepare_data.py writes <file>.json; when present, the file must be what it
    describes: its dtype, its size (n_tokens ids), its SHA-256 (data.verify=checksum),
    an eos_id inside its vocabulary. Returns what it says ({} without one)."""
    meta_path = path + ".json"
    if not os.path.isfile(meta_path):
        return {}
    again = "prepare it again with tools/prepare_data.py"
    try:
        with open(meta_path) as f:
            meta = json.load(f)
    except (OSError, ValueError) as err:
        raise ConfigError(f"{meta_path} (the sidecar of data.path={cfg.path}) is not "
                          f"readable JSON ({err}): {again}") from None
    if not isinstance(meta, dict):
        raise ConfigError(f"{meta_path} is not a sidecar of tools/prepare_data.py: {again}")
    if meta.get("dtype", cfg.token_dtype) != cfg.token_dtype:
        raise ConfigError(f"data.path={cfg.path} was written as {meta['dtype']} "
                          f"(see {meta_path}) but data.token_dtype={cfg.token_dtype}: "
                          f"set data.token_dtype={meta['dtype']}")
    n_tokens, eos = meta.get("n_tokens"), meta.get("eos_id")
    if n_tokens is not None:
        expected = n_tokens * np.dtype(cfg.token_dtype).itemsize if isinstance(
            n_tokens, int) else None
        if expected != os.path.getsize(path):
            raise ConfigError(f"data.path={cfg.path} is {os.path.getsize(path)} bytes but "
                              f"{meta_path} records {n_tokens!r} tokens ({expected} bytes): "
                              f"the file is partial or was replaced; {again}")
    if cfg.verify == "checksum" and meta.get("sha256") and \
            corpus.sha256(path) != meta["sha256"]:
        raise ConfigError(f"data.path={cfg.path} does not match the SHA-256 in {meta_path}: "
                          f"the file was changed or damaged; {again}")
    if eos is not None and (not isinstance(eos, int) or isinstance(eos, bool) or eos < 0):
        raise ConfigError(f"{meta_path}: eos_id {eos!r} is not a token id: {again}")
    return meta


def max_token(tokens: np.ndarray, chunk: int = 1 << 24) -> int:
    """Largest id in a (memory-mapped) token array, read in chunks of `chunk` tokens."""
    return max(int(tokens[i:i + chunk].max()) for i in range(0, len(tokens), chunk))


def make_dataset(cfg: DataConfig, train: TrainConfig, vocab_size: int) -> Dataset:
    """The dataset of `cfg.kind`; `vocab_size` is the model's. Raises ConfigError for
    bad input (unknown kind, missing or too short file, ids beyond the vocabulary)."""
    if not 0.0 <= cfg.holdout_fraction < 1.0:
        raise ConfigError(f"data.holdout_fraction={cfg.holdout_fraction} must be in [0, 1)")
    if cfg.kind == "tokens" and cfg.path and os.path.isdir(os.path.expanduser(cfg.path)):
        cfg = dataclasses.replace(cfg, kind="corpus")  # a prepared folder of shards
    if cfg.mixture is not None and cfg.kind != "corpus":
        raise ConfigError(f"data.mixture mixes corpora: it needs data.kind=corpus "
                          f"(not {cfg.kind})")
    if cfg.mixture is not None and cfg.path:
        raise ConfigError(f"data.mixture and data.path={cfg.path} both say what to train "
                          f"on: put the corpus into data.mixture, or drop data.mixture")
    if cfg.kind == "synthetic":
        return SyntheticDataset(train, vocab_size)
    if cfg.kind == "markov":
        if vocab_size > MAX_MARKOV_VOCAB:
            raise ConfigError(f"data.kind=markov stores a vocab x vocab transition matrix: "
                              f"model.vocab_size={vocab_size} > {MAX_MARKOV_VOCAB}; use a "
                              f"smaller vocabulary or data.kind=synthetic")
        if cfg.markov_concentration <= 0:
            raise ConfigError(f"data.markov_concentration={cfg.markov_concentration} must "
                              f"be > 0 (small: peaked transitions, low entropy floor)")
        return MarkovDataset(train, vocab_size, cfg.markov_concentration)
    if cfg.kind == "text":
        return FileDataset(train, vocab_size, open_text(cfg, vocab_size), cfg.holdout_fraction,
                           f"data.path={cfg.path}")
    if cfg.kind == "tokens":
        tokens, meta = open_tokens(cfg, vocab_size)
        dataset = FileDataset(train, vocab_size, tokens, cfg.holdout_fraction,
                              f"data.path={cfg.path}")
        dataset.separator = meta.get("eos_id")
        return dataset
    if cfg.kind == "corpus":
        if cfg.verify not in VERIFY:
            raise ConfigError(not_one_of("data.verify", cfg.verify))
        if cfg.mixture is not None:
            from framework.io.corpus_dataset import MixtureDataset

            return MixtureDataset(train, vocab_size, cfg)
        if not cfg.path:
            raise ConfigError("data.kind=corpus needs data.path=<a corpus folder from "
                              "tools/prepare_data.py <folder>> (or data.mixture)")
        from framework.io.corpus_dataset import CorpusDataset

        return CorpusDataset(train, vocab_size, cfg)
    raise ConfigError(not_one_of("data.kind", cfg.kind))


# --- Which rows a process needs, and the global array built from them -----------------

def rows_for_devices(sharding: jax.sharding.Sharding, global_shape: tuple[int, ...],
                     devices) -> np.ndarray:
    """Sorted global row ids that `devices` hold under `sharding` (any layout: the rows
    of one process need not be contiguous, e.g. when `pipe` is the outer mesh axis)."""
    index_map = sharding.devices_indices_map(tuple(global_shape))
    rows: set[int] = set()
    for device in devices:
        rows.update(range(*index_map[device][0].indices(global_shape[0])))
    return np.array(sorted(rows), dtype=np.int64)


def process_rows(sharding: jax.sharding.Sharding, global_shape: tuple[int, ...]) -> np.ndarray:
    """The rows this process's own (addressable) devices hold: all it has to read."""
    return rows_for_devices(sharding, global_shape, sharding.addressable_devices)


def assemble(local: np.ndarray, rows: np.ndarray, sharding: jax.sharding.Sharding,
             global_shape: tuple[int, ...]) -> jax.Array:
    """A global jax.Array from this process's rows (local[i] is global row rows[i])."""
    position = {int(r): i for i, r in enumerate(rows)}

    def shard(index: tuple[slice, ...]) -> np.ndarray:
        wanted = [position[r] for r in range(*index[0].indices(global_shape[0]))]
        return local[wanted][(slice(None),) + tuple(index[1:])]

    return jax.make_array_from_callback(tuple(global_shape), sharding, shard)


def sharded_batch(fetch: Callable[[int, np.ndarray], np.ndarray], index: int,
                  sharding: jax.sharding.Sharding, global_shape: tuple[int, ...]) -> jax.Array:
    """`fetch(index, rows)` for this process's rows only, placed as one global array.
    E.g. sharded_batch(dataset.train_batch, step, engine.batch_sharding(),
    dataset.global_shape)."""
    rows = process_rows(sharding, global_shape)
    return assemble(fetch(index, rows), rows, sharding, global_shape)


def document_mask(cfg: DataConfig, dataset: Dataset, sets: dict) -> DocumentMask | None:
    """What `data.document_mask` masks by (None when off): the training data's end-of-
    document token, which every named validation set must share. ConfigError (one
    line) when the data has no such token or a setting can't apply."""
    if cfg.reset_positions and not cfg.document_mask:
        raise ConfigError("data.reset_positions=true restarts positions at document "
                          "boundaries: it needs data.document_mask=true")
    if not cfg.document_mask:
        return None
    if dataset.separator is None:
        source = (f"data.kind={cfg.kind}" if cfg.kind in ("synthetic", "markov", "text")
                  else f"data.path={cfg.path}" if cfg.mixture is None else "data.mixture")
        raise ConfigError(f"data.document_mask=true needs documents that end in an "
                          f"end-of-document token, and {source} has none (or its corpora "
                          f"disagree on it): prepare it with tools/prepare_data.py --eos-id")
    for name, held in sets.items():
        if held.separator != dataset.separator:
            raise ConfigError(f"eval.sets.{name} ends documents with token {held.separator}, "
                              f"the training data with {dataset.separator}: "
                              f"data.document_mask needs one end-of-document token")
    return DocumentMask(int(dataset.separator), cfg.reset_positions)
