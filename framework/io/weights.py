"""What a path given to `framework.generate` or `tools/export_hf.py` holds: a Hugging
Face folder (config.json + safetensors), a run folder (`<run>/checkpoints/`), a
checkpoint folder (Orbax steps) or one step folder of it; the model it describes, its
tokenizer and how to load its parameters onto given shardings.

Tokenizer lookup for a checkpoint: "bytes" when its metadata says so; else the run
folder's own copy `<run folder>/tokenizer.json`, else the path the metadata records,
each only when its SHA-256 is the one the metadata records (`tokenizer_sha256`: a
copied or archived run never decodes with whatever now sits at an old path); else
byte-level when the run trained on bytes (`data` text/markov/synthetic with a
vocabulary of at most 256), else unknown (ids only). For a HF folder: its
tokenizer.json if present, else byte-level when its vocabulary is 256 (what
tools/export_hf.py writes for a byte-level run), else unknown.

Which wins when a folder is both: a folder holding checkpoints (a run folder, a
checkpoint folder or a step folder: `paths.holds_checkpoints`) is read as checkpoints,
even with a Hugging Face config.json in it. The checkpoints are what the run trains;
an export lying beside them (older versions of tools/export_hf.py wrote into any
folder) is a copy of one past step, so reading it would give an older model without a
word. A folder holding only a Hugging Face export is read as one.

The model's positions (`Source.positions`): config.json's max_position_embeddings (the
HF folder's, or that of the folder the run was initialised from), else the run's
train.seq_len. Generation refuses a prompt and continuation longer than that (it sizes
the KV cache), and export writes it as max_position_embeddings.
"""

from __future__ import annotations

import dataclasses
import os
import sys
from dataclasses import dataclass
from pathlib import Path

import jax

from framework.io.hf import llama as hf
from framework.io.checkpoint.integrity import short_reason
from framework.io.checkpoint.manager import Checkpointer
from framework.io.checkpoint.paths import holds_checkpoints, locate
from framework.errors import ConfigError, DamagedCheckpoint
from framework.config import ModelConfig, MoeConfig, RopeScaling
from framework.io.tokenizer import BYTES, fingerprint

BYTE_LEVEL_DATA = ("text", "markov", "synthetic")
# Positions of a checkpoint that records neither max_position_embeddings nor seq_len
# (none written by this version: train.py records seq_len in every checkpoint).
DEFAULT_POSITIONS = 2048


@dataclass
class Source:
    kind: str  # "hf" | "checkpoint"
    path: str  # the HF folder, or the checkpoint folder
    step: int | None  # checkpoint step
    model: ModelConfig
    tokenizer: str | None  # "bytes", a tokenizer.json path, or None (unknown)
    hf_config: dict | None  # the config.json the weights came from (token ids, context)
    metadata: dict  # the checkpoint's metadata ({} for a HF folder)
    named: bool = False  # the step was named (step=, or a step folder): no fallback
    stored_dtype: str = "float32"  # the parameters' as saved (known once `load` read them)

    @property
    def eos_ids(self) -> tuple[int, ...]:
        eos = (self.hf_config or {}).get("eos_token_id")
        return tuple(eos) if isinstance(eos, list) else (() if eos is None else (int(eos),))

    def positions(self) -> tuple[int, str]:
        """(positions the model was made for, where that number comes from, in words)."""
        given = (self.hf_config or {}).get("max_position_embeddings")
        if isinstance(given, int) and not isinstance(given, bool) and given >= 1:
            return given, ("max_position_embeddings in its config.json" if self.kind == "hf"
                           else "max_position_embeddings of the folder it was initialised from")
        seq_len = self.metadata.get("seq_len")
        if isinstance(seq_len, int) and seq_len >= 1:
            return seq_len, "the run's train.seq_len"
        return DEFAULT_POSITIONS, ("assumed: the folder records neither max_position_embeddings "
                                   "nor train.seq_len")

    def describe(self) -> str:
        if self.kind == "hf":
            return f"Hugging Face folder {self.path}"
        return f"checkpoint of step {self.step} in {self.path}"

    def load(self, shardings):
        """Canonical float32 parameters placed with `shardings` (each process reads only
        its devices' blocks, from safetensors or from the Orbax checkpoint). A damaged
        checkpoint (fingerprints, unreadable files) is never used: the newest older intact
        step is, with a warning line on stderr; a named step is refused in one line."""
        if self.kind == "hf":
            return hf.load_params(self.path, self.model, shardings)
        shapes = hf.canonical_shapes(self.model)
        abstract = jax.tree.map(lambda s, sh: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sh),
                                shapes, shardings)
        ckpt = Checkpointer(self.path, read_only=True)
        try:
            while True:
                try:
                    params = ckpt.restore_params(self.step, abstract)
                    self.stored_dtype = ckpt.saved_dtypes(self.step)["params/embed/table"]
                    return params
                except DamagedCheckpoint as err:
                    self.step = older_step(ckpt, err, self.named)
        finally:
            ckpt.close()


def older_step(ckpt: Checkpointer, err: DamagedCheckpoint, named: bool) -> int:
    """The step to read instead of a damaged one (said on stderr); ConfigError when the
    step was named or none is older."""
    if named:
        raise ConfigError(f"{err}: name another step, or the folder for its newest "
                          f"intact one") from None
    older = [s for s in ckpt.complete_steps() if s < err.step]
    if not older:
        raise ConfigError(f"{err}, and there is no older checkpoint there") from None
    print(f"warning: {err}; using step {older[-1]}", file=sys.stderr, flush=True)
    return older[-1]


def _metadata(ckpt: Checkpointer, step: int, named: bool) -> tuple[int, dict]:
    """(step, its metadata), falling back over steps whose metadata cannot be read."""
    while True:
        try:
            return step, ckpt.metadata(step)
        except Exception as err:  # what Orbax says about a damaged file
            damaged = DamagedCheckpoint(ckpt.directory, step, short_reason(err))
            step = older_step(ckpt, damaged, named)


def open_source(path: str, step: int | None = None, setting: str = "checkpoint") -> Source:
    """The model at `path` (see the module docstring). Raises ConfigError naming
    `setting` when there is none."""
    where = Path(os.path.expanduser(path)).absolute()
    if not where.exists():
        raise ConfigError(f"{setting}={path} does not exist")
    holder = holds_checkpoints(str(where))
    if hf.is_hf_folder(where) and holder is None:  # checkpoints win (module docstring)
        return _hf_source(where)
    found = locate(str(where))
    if found is not None and holder == "a run folder" and not os.path.isdir(found.folder):
        raise ConfigError(f"{setting}={path} is a run folder without checkpoints (no "
                          f"{found.folder}): name a run that has saved one")
    if found is None or not os.path.isdir(found.folder):
        raise ConfigError(f"{setting}={path} is neither a Hugging Face folder (config.json) "
                          f"nor a run or checkpoint folder")
    folder, run_dir = Path(found.folder), Path(found.run_dir or where.parent)
    ckpt = Checkpointer(str(folder), read_only=True)
    try:
        try:
            named = step is not None or found.step is not None
            step = ckpt.pick(step if step is not None else found.step)
        except FileNotFoundError as err:
            raise ConfigError(f"{setting}={path}: {err}") from None
        step, meta = _metadata(ckpt, step, named)
    finally:
        ckpt.close()
    if "model" not in meta:
        raise ConfigError(f"{setting}={path}: the checkpoint of step {step} has no model settings")
    model = model_config_from_dict(meta["model"])
    return Source("checkpoint", str(folder), step, model,
                  _checkpoint_tokenizer(meta, run_dir, model), meta.get("hf_config"), meta, named)


def _hf_source(where: Path) -> Source:
    config = hf.read_config(where)
    tok = where / hf.TOKENIZER_FILE
    model = hf.model_config(config, str(where / hf.CONFIG_FILE))
    tokenizer = str(tok) if tok.is_file() else BYTES if model.vocab_size == 256 else None
    return Source("hf", str(where), None, model, tokenizer, config, {})


def model_config_from_dict(values: dict) -> ModelConfig:
    """A ModelConfig from `dataclasses.asdict` output (checkpoint metadata); keys it
    does not know are ignored, missing ones take their defaults (older checkpoints)."""
    names = {f.name for f in dataclasses.fields(ModelConfig)}
    kept = {k: v for k, v in values.items() if k in names}
    scaling = kept.pop("rope_scaling", None)
    if isinstance(scaling, dict):
        kept["rope_scaling"] = RopeScaling(**scaling)
    if isinstance(kept.get("moe"), dict):  # model.moe (older checkpoints have none)
        known = {f.name for f in dataclasses.fields(MoeConfig)}
        kept["moe"] = MoeConfig(**{k: v for k, v in kept["moe"].items() if k in known})
    return ModelConfig(**kept)


def _checkpoint_tokenizer(meta: dict, run_dir: Path, model: ModelConfig) -> str | None:
    """The tokenizer of a checkpoint: the run folder's own copy first (a copied or
    archived run decodes with its own), else the recorded path; either only when its
    SHA-256 is the recorded one (when one is). Unknown (None) otherwise."""
    recorded, digest = meta.get("tokenizer"), meta.get("tokenizer_sha256")
    if recorded == BYTES:
        return BYTES
    for candidate in (str(run_dir / hf.TOKENIZER_FILE), recorded):
        if candidate and os.path.isfile(candidate) and digest in (None, fingerprint(candidate)):
            return candidate
    if meta.get("data") in BYTE_LEVEL_DATA and model.vocab_size <= 256 and not recorded:
        return BYTES
    return None


def with_dtype(source: Source, dtype: str | None) -> Source:
    return source if dtype is None else dataclasses.replace(
        source, model=dataclasses.replace(source.model, dtype=dtype))
