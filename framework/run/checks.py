"""A run's settings checked before anything starts (`check_run`: everything that can
be checked without devices; the degrees against the device count come later, in
`framework/engine/validate.py`) and the one setting adjusted with a warning
(`clamp_warmup`). Each problem is one line naming the setting and what would work.
"""

from __future__ import annotations

import dataclasses
import os
from fnmatch import fnmatchcase

import jax

from framework.config import RunConfig, check_ranges, not_one_of
from framework.engine.validate import check
from framework.errors import ConfigError
from framework.runtime import distributed


def wandb_login_found() -> bool:
    """Whether W&B has credentials: WANDB_API_KEY, or the ~/.netrc entry `wandb login`
    writes for its host (WANDB_BASE_URL, default api.wandb.ai)."""
    import netrc
    from urllib.parse import urlparse

    if os.environ.get("WANDB_API_KEY"):
        return True
    host = urlparse(os.environ.get("WANDB_BASE_URL", "https://api.wandb.ai")).hostname
    try:
        return netrc.netrc(os.environ.get("NETRC")).authenticators(host) is not None
    except (OSError, netrc.NetrcParseError):
        return False


def check_run(cfg: RunConfig) -> None:
    """Everything that can be checked without devices (degrees against the device
    count come later, in `framework.engine.validate.validate`)."""
    errs = check_ranges(cfg)
    if errs:  # the checks below divide by some of these numbers
        raise ConfigError("; ".join(errs))
    errs = check(cfg.model, cfg.parallel, cfg.train, None)
    errs += [e for e in (not_one_of("train.resume", cfg.train.resume),
                         not_one_of("logging.wandb.mode", cfg.logging.wandb.mode),
                         not_one_of("devices.platform", cfg.devices.platform),
                         not_one_of("optim.schedule", cfg.optim.schedule),
                         not_one_of("optim.decay_shape", cfg.optim.decay_shape),
                         not_one_of("optim.mu_dtype", cfg.optim.mu_dtype),
                         not_one_of("optim.param_dtype", cfg.optim.param_dtype),
                         not_one_of("optim.name", cfg.optim.name)) if e]
    if cfg.logging.wandb.mode == "online" and not wandb_login_found():
        errs.append("logging.wandb.mode=online needs a W&B login: run `wandb login` (or set "
                    "WANDB_API_KEY), or log offline (logging=wandb_offline) and `wandb sync` "
                    "the run later")
    decay = cfg.optim.decay_steps
    if decay is not None and cfg.optim.schedule != "wsd":
        errs.append(f"optim.decay_steps={decay} is the length of wsd's final decay, and "
                    f"optim.schedule={cfg.optim.schedule}: set optim.schedule=wsd, or drop it")
    elif decay is not None and decay > cfg.train.steps:
        errs.append(f"optim.decay_steps={decay} is more than train.steps={cfg.train.steps}: "
                    f"the decay would not end by the last step; set it <= {cfg.train.steps}")
    if cfg.eval.sample_prompt is not None and not cfg.eval.every:
        errs.append("eval.sample_prompt is written at each evaluation: set eval.every > 0")
    try:
        distributed.plan(cfg.distributed)
    except ConfigError as err:
        errs.append(str(err))
    if errs:
        raise ConfigError("; ".join(errs))


def check_no_decay(patterns: tuple[str, ...], params) -> None:
    """ConfigError (one line) for an optim.no_decay pattern that names no parameter of
    the model (`params`: its tree, any layout; names as framework/engine/optim.py's
    `decay_mask` reads them, e.g. layers/attn/wqkv): a typo would decay everything."""
    if not patterns:
        return
    names = []
    for path, _ in jax.tree_util.tree_flatten_with_path(params)[0]:
        parts = [str(getattr(k, "key", k)) for k in path]
        names.append("/".join(["layers" if parts[0] == "stages" else parts[0]] + parts[1:]))
    for pattern in patterns:
        if not any(fnmatchcase(name, pattern) for name in names):
            raise ConfigError(f"optim.no_decay pattern {pattern!r} names no parameter: the "
                              f"names are {', '.join(sorted(set(names)))}")


def clamp_warmup(cfg: RunConfig) -> tuple[RunConfig, str | None]:
    """A warm-up longer than the run (a short trial of a recipe) becomes the whole run;
    returns the config and the warning to print (None when nothing changed)."""
    warmup, steps = cfg.optim.warmup_steps, cfg.train.steps
    if warmup <= steps:
        return cfg, None
    optim = dataclasses.replace(cfg.optim, warmup_steps=steps)
    return dataclasses.replace(cfg, optim=optim), (
        f"warning: optim.warmup_steps={warmup} is more than train.steps={steps}: the "
        f"learning rate warms up over all {steps} steps (it reaches optim.lr at the last)")


def check_sample(cfg: RunConfig, prompt_tokens: int, hf_config: dict | None) -> None:
    """The training-time sample fits the model's positions, as `framework.generate`
    requires (framework/run/generate.py, check_length): the initial folder's
    max_position_embeddings, else train.seq_len."""
    positions = (hf_config or {}).get("max_position_embeddings") or cfg.train.seq_len
    need = prompt_tokens + cfg.eval.sample_tokens
    if need > positions:
        fix = (f"set eval.sample_tokens <= {positions - prompt_tokens}"
               if prompt_tokens < positions else
               f"give a prompt shorter than {positions} tokens")
        raise ConfigError(f"eval.sample_prompt ({prompt_tokens} tokens) and eval.sample_tokens="
                          f"{cfg.eval.sample_tokens} need {need} positions but the model has "
                          f"{positions}: {fix}")


def sample_codec(cfg: RunConfig, tokenizer: str | None, hf_config: dict | None):
    """The codec of the training-time sample (eval.sample_prompt; None without one),
    checked: the data's tokenizer is known, and the sample fits the model's positions."""
    if cfg.eval.sample_prompt is None:
        return None
    from framework.io import tokenizer as tokenizer_lib

    codec = tokenizer_lib.load(tokenizer, cfg.model.vocab_size)
    if codec is None:
        raise ConfigError("eval.sample_prompt needs to know the data's tokenizer: prepare "
                          "data.kind=tokens with tools/prepare_data.py --tokenizer, or "
                          "unset eval.sample_prompt")
    check_sample(cfg, len(codec.encode(cfg.eval.sample_prompt)), hf_config)
    return codec
