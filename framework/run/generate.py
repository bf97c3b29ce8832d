"""Generate text from a run folder, a checkpoint (folder or step) or a Hugging Face folder:

    python -m framework.generate checkpoint=runs/a prompt="Once upon a time" \\
        max_new_tokens=64 temperature=0.8 top_k=50 top_p=0.95 seed=0 print_ids=true

Settings are `key=value` (framework.config.GenerateConfig: temperature 0 = greedy,
`tensor=N` decodes with N-way tensor parallelism, `step=` picks a checkpoint step,
`prompt_ids=1,2,3` gives ids instead of text). The continuation goes to stdout, decoded
with the tokenizer the run's data was prepared with (byte-level runs: UTF-8 with
replacement; see framework/io/weights.py for the lookup); a line on stderr says what
was loaded and how fast the tokens came. Bad input: `error: ...` on one line, exit 2.

Settings are checked in two places, both before anything is compiled or loaded:
`check_settings` (each value against its range, as soon as the arguments are read)
and `check_length` (the prompt and the continuation against the model's positions,
once the folder's model is known; it bounds max_new_tokens, and with it the KV cache).
"""

from __future__ import annotations

import dataclasses
import math
import os
import sys
import time
import typing

from framework.config import (CHOICES, DevicesConfig, GenerateConfig, ParallelConfig,
                              TrainConfig)
from framework.errors import ConfigError
from framework.runtime import faults
from framework.engine.validate import check

TRUE, FALSE = ("true", "1", "yes", "on"), ("false", "0", "no", "off")
# The decoding step takes the seed as a uint32 and top_k as an int32
# (framework/engine/decode.py, Decoder.generate): larger values cannot reach it.
SEED_MAX, TOP_K_MAX = 2**32 - 1, 2**31 - 1
# Beyond this temperature sampling is uniform to float32 precision (logits / T of any
# model round to nearly 0); 1e300 overflowed to an infinite temperature.
TEMPERATURE_MAX = 100.0


def parse_args(argv: list[str]) -> GenerateConfig:
    """key=value arguments -> GenerateConfig, type-checked; ConfigError on bad input."""
    fields = {f.name: f for f in dataclasses.fields(GenerateConfig)}
    hints = typing.get_type_hints(GenerateConfig)
    values = {}
    for arg in argv:
        key, eq, raw = arg.partition("=")
        if not eq:
            raise ConfigError(f"{arg!r} is not key=value (keys: {', '.join(fields)})")
        if key not in fields:
            raise ConfigError(f"unknown setting {key!r} (valid: {', '.join(fields)})")
        values[key] = _convert(key, raw, hints[key])
    cfg = GenerateConfig(**values)
    errs = check_settings(cfg)
    if errs:
        raise ConfigError("; ".join(errs))
    return cfg


def check_settings(cfg: GenerateConfig) -> list[str]:
    """One line per setting outside its range (what the model allows, e.g. the length,
    is `check_length`'s)."""
    errs = []
    if not cfg.checkpoint:
        errs.append("checkpoint=<run folder | checkpoint folder | Hugging Face folder> is required")
    for key, ok, want in (
            ("max_new_tokens", cfg.max_new_tokens >= 1,
             ">= 1 (and fit the model's positions with the prompt)"),
            ("temperature", math.isfinite(cfg.temperature)
             and 0 <= cfg.temperature <= TEMPERATURE_MAX,
             f"in [0, {TEMPERATURE_MAX:g}] (0: greedy; higher is uniform sampling)"),
            ("top_k", 0 <= cfg.top_k <= TOP_K_MAX, f"in [0, {TOP_K_MAX}] (0: off)"),
            ("top_p", 0 < cfg.top_p <= 1, "in (0, 1] (1: off)"),
            ("seed", 0 <= cfg.seed <= SEED_MAX, f"in [0, {SEED_MAX}] (a uint32)"),
            ("tensor", cfg.tensor >= 1, ">= 1"),
            ("step", cfg.step is None or cfg.step >= 0, ">= 0")):
        if not ok:
            errs.append(f"{key}={getattr(cfg, key)} must be {want}")
    if cfg.prompt and cfg.prompt_ids is not None:
        errs.append("prompt and prompt_ids both give the prompt: give one of them")
    dtypes = CHOICES["model.dtype"]
    if cfg.dtype is not None and cfg.dtype not in dtypes:
        errs.append(f"dtype={cfg.dtype!r} is not one of {', '.join(dtypes)}")
    return errs


def check_length(prompt_len: int, max_new_tokens: int, positions: int, origin: str) -> None:
    """ConfigError unless the prompt and its continuation fit the model's positions
    (`origin`: where that number comes from, framework/io/weights.py Source.positions).
    The KV cache holds prompt_len + max_new_tokens positions: this bound is what keeps
    a huge max_new_tokens from asking for more memory than any device has."""
    if prompt_len >= positions:
        raise ConfigError(f"the prompt is {prompt_len} tokens but the model has {positions} "
                          f"positions ({origin}): give at most {positions - 1}, so that a "
                          f"new token fits")
    if prompt_len + max_new_tokens > positions:
        raise ConfigError(f"max_new_tokens={max_new_tokens} after a {prompt_len}-token prompt "
                          f"needs {prompt_len + max_new_tokens} positions but the model has "
                          f"{positions} ({origin}): max_new_tokens must be <= "
                          f"{positions - prompt_len}")


def _convert(key: str, raw: str, hint):
    optional = type(None) in typing.get_args(hint)
    kind = next((t for t in typing.get_args(hint) if t is not type(None)), hint)
    if optional and raw.lower() in ("null", "none", ""):
        return None
    try:
        if kind is bool:
            if raw.lower() not in TRUE + FALSE:
                raise ValueError
            return raw.lower() in TRUE
        return kind(raw)
    except ValueError:
        raise ConfigError(f"{key}={raw!r} is not a valid {kind.__name__}") from None


def prompt_tokens(cfg: GenerateConfig, codec) -> list[int]:
    if cfg.prompt_ids is not None:
        try:
            return [int(t) for t in cfg.prompt_ids.replace(" ", "").split(",") if t]
        except ValueError:
            raise ConfigError(f"prompt_ids={cfg.prompt_ids!r} is not comma-separated "
                              f"integers") from None
    if codec is None:
        raise ConfigError("no tokenizer is known for this checkpoint: give prompt_ids=1,2,3 "
                          "(or put its tokenizer.json in the run folder)")
    return codec.encode(cfg.prompt)


def run(cfg: GenerateConfig, out=sys.stdout, err=sys.stderr, devices=None) -> dict:
    """Loads, generates, prints; returns {"prompt_ids", "ids", "text", "tokens_per_s"}.
    devices: JAX devices to use when this process has started JAX already (the first
    `tensor` of them); by default the platform's, simulated on CPU as needed."""
    from framework.io import weights as artifacts
    from framework.runtime import devices as devices_lib
    from framework.io import tokenizer as tokenizer_lib

    parallel = ParallelConfig(tensor=cfg.tensor)
    if devices is None:  # before anything (Orbax included) starts JAX's backend
        devset = devices_lib.start(DevicesConfig(platform=cfg.platform), parallel)
        devices, simulated = devset.devices, devset.simulated
    else:
        simulated = devices[0].platform == "cpu"
    source = artifacts.with_dtype(artifacts.open_source(cfg.checkpoint, cfg.step), cfg.dtype)
    model = source.model
    errs = check(model, parallel, TrainConfig(global_batch_size=1), None)
    if errs:
        raise ConfigError("; ".join(e.replace("parallel.tensor", "tensor") for e in errs))
    codec = tokenizer_lib.load(source.tokenizer, model.vocab_size)
    ids = prompt_tokens(cfg, codec)
    if not ids or max(ids) >= model.vocab_size or min(ids) < 0:
        raise ConfigError(f"the prompt must be 1 or more token ids in [0, {model.vocab_size})"
                          f" (got {ids[:8]}{'...' if len(ids) > 8 else ''})")
    check_length(len(ids), cfg.max_new_tokens, *source.positions())
    from framework.engine.decode import Decoder, Sampling
    from framework.parallel.mesh import describe, make_mesh

    mesh = make_mesh(parallel, devices)
    decoder = Decoder(model, mesh)
    params = source.load(decoder.param_shardings)
    times = []
    started = time.perf_counter()
    sampling = Sampling(cfg.temperature, cfg.top_k, cfg.top_p, cfg.seed)
    new = decoder.generate(params, [ids], cfg.max_new_tokens, sampling,
                           source.eos_ids if cfg.stop_at_eos else (),
                           on_token=lambda _: times.append(time.perf_counter()))[0]
    # The first two calls compile (prefill, then one step): steady speed from the third.
    steady = (len(times) - 2) / (times[-1] - times[1]) if len(times) > 2 else None
    text = codec.decode(new.tolist()) if codec is not None else None
    if cfg.print_ids:
        print(f"prompt ids: {ids}", file=out)
        print(f"ids: {new.tolist()}", file=out)
    if text is not None:
        print(text, file=out, flush=True)
    speed = f"{steady:,.1f} tokens/s after compilation" if steady else "too few tokens to time"
    print(f"{source.describe()} | {describe(mesh, simulated)} | {model.dtype} | "
          f"{len(ids)} prompt + {len(new)} new tokens in {time.perf_counter() - started:.2f} s "
          f"({speed}) | tokenizer: {codec.name if codec else 'unknown (ids only)'}",
          file=err, flush=True)
    return {"prompt_ids": ids, "ids": new.tolist(), "text": text, "tokens_per_s": steady}


def usage() -> str:
    """The docstring above and every setting with its default (for --help)."""
    rows = [f"  {f.name}={f.default if f.default is not dataclasses.MISSING else '<required>'}"
            for f in dataclasses.fields(GenerateConfig)]
    return __doc__.strip() + "\n\nSettings (docs/configuration.md):\n" + "\n".join(rows)


def main(argv: list[str] | None = None) -> int:
    import logging

    argv = sys.argv[1:] if argv is None else argv
    if any(a in ("-h", "--help") for a in argv):
        print(usage())
        return 0
    logging.getLogger("absl").setLevel(logging.ERROR)  # Orbax's notes on read-only folders
    # Background threads' noise (an abandoned restore of a damaged step) goes nowhere.
    faults.LibraryOutput(os.devnull).install()
    try:
        run(parse_args(argv))
    except ConfigError as error:
        print(f"error: {error}", file=sys.stderr, flush=True)
        return 2
    except KeyboardInterrupt:
        print("error: interrupted", file=sys.stderr, flush=True)
        return 130
    return 0

