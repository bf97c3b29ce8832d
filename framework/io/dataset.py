"""What every token dataset is (framework/io/data.py's kinds, framework/io/corpus_dataset.py's
corpora): `Dataset`, whose batches are [rows, seq_len + 1] int32 tokens with row r of
batch i drawn from its own generator seeded with (seed, split, i, r); the seed streams
(TRAIN, EVAL, CHAIN); which rows a caller asks for (`Rows`, `row_indices`).
"""

from __future__ import annotations

from typing import Sequence

import numpy as np

from framework.config import TrainConfig
from framework.errors import ConfigError

TRAIN, EVAL, CHAIN = 0, 1, 2  # seed streams: training rows, held-out rows, the Markov chain
Rows = slice | Sequence[int] | np.ndarray | None


class Dataset:
    """Batches of [rows, seq_len + 1] int32 tokens (inputs and next-token targets)."""

    entropy_floor: float | None = None  # nats/token; known only for `markov`
    has_eval: bool = True  # False when there is no held-out split

    # The token that ends each packed document (a corpus's eos_id), or None: what
    # data.document_mask masks by (`document_mask`).
    separator: int | None = None

    def __init__(self, train: TrainConfig, vocab_size: int):
        self.seq_len = train.seq_len
        self.global_batch = train.global_batch_size
        self.seed = train.seed
        self.vocab_size = vocab_size  # ids are in [0, vocab_size)

    @property
    def global_shape(self) -> tuple[int, int]:
        return (self.global_batch, self.seq_len + 1)

    def train_batch(self, step: int, rows: Rows = None) -> np.ndarray:
        """Rows `rows` (default: all) of the global batch of training step `step`."""
        return self._batch(TRAIN, step, rows)

    def eval_batch(self, index: int, rows: Rows = None) -> np.ndarray:
        """Rows of held-out batch `index` (the same batches at every evaluation)."""
        if not self.has_eval:
            raise ConfigError(f"{type(self).__name__} has no held-out split: set "
                              f"data.holdout_fraction > 0 or eval.every=0")
        return self._batch(EVAL, index, rows)

    def _batch(self, split: int, index: int, rows: Rows) -> np.ndarray:
        ids = row_indices(rows, self.global_batch)
        rngs = [np.random.default_rng([self.seed, split, index, int(r)]) for r in ids]
        out = self._rows(rngs, split).astype(np.int32)  # [n_rows, seq_len + 1]
        assert out.shape == (len(ids), self.seq_len + 1), out.shape
        return out

    def _rows(self, rngs: list[np.random.Generator], split: int) -> np.ndarray:
        """One [seq_len + 1] row per generator, stacked."""
        raise NotImplementedError


def row_indices(rows: Rows, global_batch: int) -> np.ndarray:
    """`rows` (None, a slice or indices) as a sorted int array within [0, global_batch)."""
    if rows is None:
        return np.arange(global_batch)
    if isinstance(rows, slice):
        return np.arange(global_batch)[rows]
    ids = np.asarray(rows, dtype=np.int64).reshape(-1)
    if ids.size and (ids.min() < 0 or ids.max() >= global_batch):
        raise IndexError(f"rows {ids.min()}..{ids.max()} outside a batch of {global_batch}")
    return ids
