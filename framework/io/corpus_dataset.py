"""Datasets of sharded corpora (framework/io/corpus.py's format): `data.kind=corpus`
(`CorpusDataset`: packed sequences, each once per epoch), weighted mixtures of corpora
(`data.mixture`, `MixtureDataset`) and named validation sets (`eval.sets`,
`eval_sets`). Row r of step s stays a pure function of (seed, step, row), as for every
dataset of framework/io/data.py.
"""

from __future__ import annotations

import os
import re

import numpy as np

from framework.config import DataConfig, EvalConfig, TrainConfig
from framework.errors import ConfigError, DataError
from framework.io import corpus
from framework.io.dataset import TRAIN, Dataset, Rows, row_indices
from framework.io.tokenizer import BYTES, fingerprint


class CorpusDataset(Dataset):
    """Packed sequences of a sharded corpus, each once per epoch (framework/io/corpus.py):
    training sample g = step x batch + row is sequence permute(g mod n) of epoch g // n;
    the last holdout_fraction of the sequences are the held-out ones, in order."""

    def __init__(self, train: TrainConfig, vocab_size: int, cfg: DataConfig,
                 least: int | None = None, setting: str = "data.path"):
        """`least`: the fewest training and held-out sequences it must hold (default one
        batch; a mixture's corpus needs only one: a batch draws from every corpus).
        `setting`: what names this corpus in messages (data.mixture[1].path, ...)."""
        super().__init__(train, vocab_size)
        least = self.global_batch if least is None else least
        self.shards, self.manifest = corpus.open_corpus(os.path.expanduser(cfg.path),
                                                        vocab_size, cfg.verify, setting)
        self.separator, self.path, self.setting = self.manifest.get("eos_id"), cfg.path, setting
        total = self.shards[-1].start + len(self.shards[-1].tokens)
        n = (total - 1) // self.seq_len  # windows of seq_len + 1, stride seq_len
        held = int(n * cfg.holdout_fraction)  # 1: a validation set (`eval_sets`)
        self.n_train, self.n_eval, self.has_eval = n - held, held, held > 0
        need = f"one batch of train.global_batch_size={least}" if least > 1 else "one"
        where = f"{setting}={cfg.path} holds {n} sequences of train.seq_len={self.seq_len} " \
                f"({total} tokens)"
        if cfg.holdout_fraction >= 1 and held < least:  # a validation set
            raise ConfigError(f"{where}, fewer than {need}: a validation set needs at "
                              f"least that many")
        if cfg.holdout_fraction < 1 and self.n_train < least:
            raise ConfigError(f"{where}, {self.n_train} of them for training (data."
                              f"holdout_fraction={cfg.holdout_fraction}), fewer than {need}")
        if 0 < cfg.holdout_fraction < 1 and held < least:
            lowest = min(1.0, least / max(n, 1))
            raise ConfigError(f"{where}: data.holdout_fraction={cfg.holdout_fraction} holds "
                              f"out {held} of them, fewer than {need}: set it to at least "
                              f"{lowest:.3g}, or 0 (no eval/loss)")

    def _batch(self, split: int, index: int, rows: Rows) -> np.ndarray:
        return self.samples(split, index * self.global_batch + row_indices(rows, self.global_batch))

    def samples(self, split: int, g: np.ndarray) -> np.ndarray:
        """The [len(g), seq_len + 1] rows of samples g (training: step x batch + row)."""
        if split == TRAIN:
            epochs, within = g // self.n_train, g % self.n_train
            seqs = np.empty_like(g)
            for e in np.unique(epochs):  # one permutation per epoch the samples touch
                mine = epochs == e
                seqs[mine] = corpus.permute(within[mine], self.n_train, (self.seed, int(e)))
        else:  # the held-out sequences after the training ones, cycled
            seqs = self.n_train + g % self.n_eval
        checked: set = set()  # shards whose size this batch has checked
        rows = np.stack([corpus.read_window(self.shards, int(i) * self.seq_len,
                                            self.seq_len + 1, checked)
                         for i in seqs]).astype(np.int32)
        if rows.size and rows.max() >= self.vocab_size:  # a shard rewritten mid-run
            raise DataError(f"{self.setting}={self.path} now holds token id {rows.max()} (model."
                            f"vocab_size={self.vocab_size}): the corpus changed during the run")
        return rows


class MixtureDataset(Dataset):
    """Several corpora in fixed proportions (`data.mixture`): in every block of BLOCK
    consecutive samples, corpus k gives n_k of them (its weight's share of BLOCK,
    rounded by largest remainders), in an order drawn per block (a keyed permutation
    of the block's slots: slot s belongs to corpus k for s in [start_k, start_k + n_k));
    sample g of the mixture is then sample (g // BLOCK) n_k + (s - start_k) of corpus
    k, which runs its own epochs without replacement. A closed form: row r of step s
    is still a pure function of (seed, step, row)."""

    BLOCK = 4096

    def __init__(self, train: TrainConfig, vocab_size: int, cfg: DataConfig):
        super().__init__(train, vocab_size)
        paths, weights = _mixture(cfg.mixture)
        self.parts = [CorpusDataset(train, vocab_size, DataConfig(
            kind="corpus", path=p, holdout_fraction=cfg.holdout_fraction, verify=cfg.verify),
            least=1, setting=f"data.mixture[{n}].path") for n, p in enumerate(paths)]
        _one_tokenizer(paths, self.parts)
        share = np.asarray(weights) / sum(weights) * self.BLOCK
        counts = np.floor(share).astype(np.int64)
        counts[np.argsort(counts - share)[:self.BLOCK - counts.sum()]] += 1
        self.counts, self.starts = counts, np.concatenate([[0], np.cumsum(counts)[:-1]])
        self.has_eval = all(p.has_eval for p in self.parts)
        ends = {p.separator for p in self.parts}  # one end-of-document token, or none
        self.separator = ends.pop() if len(ends) == 1 else None

    def _batch(self, split: int, index: int, rows: Rows) -> np.ndarray:
        g = index * self.global_batch + row_indices(rows, self.global_batch)
        out = np.empty((len(g), self.seq_len + 1), np.int32)
        for block in np.unique(g // self.BLOCK):
            mine = g // self.BLOCK == block
            slot = corpus.permute(g[mine] % self.BLOCK, self.BLOCK, (self.seed, split, int(block)))
            part = np.searchsorted(self.starts, slot, side="right") - 1
            local = block * self.counts[part] + slot - self.starts[part]
            rows_out = np.empty((mine.sum(), self.seq_len + 1), np.int32)
            for k in np.unique(part):
                rows_out[part == k] = self.parts[k].samples(split, local[part == k])
            out[mine] = rows_out
        return out


MIXTURE_KEYS = {"path": str, "weight": (int, float)}


def _mixture(given) -> tuple[list[str], list[float]]:
    """(paths, weights) of `data.mixture`, a list of {path, weight}; one line if not:
    an entry with another key (a misspelt `weigth` would silently weigh 1), a path
    that is not text, a weight that is not a number >= 0 (true is not 1)."""
    example = "'data.mixture=[{path: web/, weight: 0.7}, {path: code/, weight: 0.3}]'"
    if not isinstance(given, (list, tuple)) or not given:
        raise ConfigError(f"data.mixture={given!r} is not a list of corpora with weights, "
                          f"e.g. {example}")
    paths, weights = [], []
    for n, entry in enumerate(given):
        if not isinstance(entry, dict) or not entry.get("path"):
            raise ConfigError(f"data.mixture[{n}]={entry!r} names no corpus: each entry is "
                              f"{{path: <corpus folder>, weight: <share>}}, e.g. {example}")
        unknown = sorted(set(map(str, entry)) - set(MIXTURE_KEYS))
        if unknown:
            raise ConfigError(f"data.mixture[{n}] has the key {unknown[0]!r}: an entry has "
                              f"only path and weight, e.g. {example}")
        weight = entry.get("weight", 1.0)
        if not isinstance(weight, (int, float)) or isinstance(weight, bool) or \
                not np.isfinite(weight) or weight < 0:
            raise ConfigError(f"data.mixture[{n}].weight={weight!r} must be a number >= 0")
        if not isinstance(entry["path"], str):
            raise ConfigError(f"data.mixture[{n}].path={entry['path']!r} is not a folder name")
        paths.append(entry["path"])
        weights.append(float(weight))
    if sum(weights) <= 0:
        raise ConfigError("data.mixture's weights add up to 0: give some corpus a weight > 0")
    return paths, weights


def tokenizer_of(part: CorpusDataset) -> str | None:
    """What a corpus's ids mean: "bytes", its tokenizer.json copy's SHA-256 (recorded
    in the manifest, else read), or None (unknown)."""
    name = part.manifest.get("tokenizer")
    if not name or name == BYTES:
        return name
    return part.manifest.get("tokenizer_sha256") or fingerprint(
        os.path.join(os.path.expanduser(part.path), name))


def _one_tokenizer(paths: list[str], parts: list[CorpusDataset]) -> None:
    """ConfigError unless every corpus of a mixture was prepared with one tokenizer
    (byte-level, or tokenizer.json copies with the same bytes): ids mean one thing."""
    seen = [tokenizer_of(part) for part in parts]
    for path, tok in zip(paths[1:], seen[1:]):
        if tok != seen[0]:
            raise ConfigError(f"data.mixture: {paths[0]} and {path} were prepared with "
                              f"different tokenizers (their ids mean different tokens): "
                              f"prepare them with one --tokenizer")


def eval_sets(evaluation: EvalConfig, cfg: DataConfig, train: TrainConfig,
              vocab_size: int, tokenizer: str | None = None) -> dict[str, Dataset]:
    """The named validation sets of `eval.sets` ({name: corpus folder}), each read whole
    as held-out sequences and logged as eval/<name>/loss; checked like `data.path`, and
    (`tokenizer`: the training data's, framework/io/tokenizer.py `for_run`) prepared
    with the training data's tokenizer, as a mixture's corpora are."""
    sets = evaluation.sets or {}
    if not isinstance(sets, dict):
        raise ConfigError(f"eval.sets={sets!r} is not a mapping of names to corpus folders, "
                          f"e.g. 'eval.sets={{wiki: wiki_val/, code: code_val/}}'")
    if sets and not evaluation.every:
        raise ConfigError("eval.sets needs eval.every > 0 (how often they are evaluated)")
    mine, out = fingerprint(tokenizer), {}
    for name, path in sets.items():
        if not re.fullmatch(r"[A-Za-z0-9_.-]+", str(name)):
            raise ConfigError(f"eval.sets name {name!r} is not a plain name (letters, "
                              f"digits, _ . -): it becomes the metric eval/<name>/loss")
        if str(name) in out:
            raise ConfigError(f"eval.sets names {name!r} twice: each set needs its own name")
        if not isinstance(path, str):
            raise ConfigError(f"eval.sets.{name}={path!r} is not a corpus folder's name, "
                              f"e.g. 'eval.sets={{{name}: {name}_val/}}'")
        one = DataConfig(kind="corpus", path=path, holdout_fraction=1.0, verify=cfg.verify)
        out[str(name)] = CorpusDataset(train, vocab_size, one, setting=f"eval.sets.{name}")
        theirs = tokenizer_of(out[str(name)])
        if mine and theirs and theirs != mine:
            raise ConfigError(f"eval.sets.{name}={path} was prepared with another tokenizer "
                              f"than the training data (its ids mean other text): prepare "
                              f"it with the training data's --tokenizer")
    return out
