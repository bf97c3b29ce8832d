"""The tools' command lines: `recipe=<name> key=value ...` composed exactly as
`python -m framework.run` composes them (same `conf/`, same recipes, same typed
schema), plus the tool's own `name=value` settings, from any working directory."""

from __future__ import annotations

import sys

from framework.errors import ConfigError
from framework.config import RunConfig


def split_settings(args: list[str], own: dict[str, type]) -> tuple[dict, list[str]]:
    """Splits `name=value` arguments into the tool's own settings (converted with the
    types in `own`) and the rest, which are Hydra overrides."""
    settings, overrides = {}, []
    for arg in args:
        name, eq, value = arg.partition("=")
        if eq and name in own:
            try:
                settings[name] = own[name](value)
            except ValueError:
                raise ConfigError(f"{name}={value!r} is not a valid {own[name].__name__}") from None
        else:
            overrides.append(arg)
    return settings, overrides


def compose(overrides: list[str]) -> RunConfig:
    """The typed RunConfig for these overrides (e.g. ['recipe=llama_small_3d',
    'parallel.tensor=2']). Raises ConfigError with one line on bad input."""
    from hydra import compose as hydra_compose, initialize_config_dir
    from hydra.errors import HydraException
    from omegaconf import OmegaConf
    from omegaconf.errors import OmegaConfBaseException

    from framework.run.cli import CONF_DIR, one_line, register_configs

    register_configs()
    try:
        with initialize_config_dir(config_dir=str(CONF_DIR), version_base=None):
            cfg = hydra_compose(config_name="config", overrides=list(overrides))
        return OmegaConf.to_object(cfg)
    except (HydraException, OmegaConfBaseException) as err:
        raise ConfigError(one_line(err)) from None


def user_error(err: Exception) -> int:
    print(f"error: {err}", file=sys.stderr, flush=True)
    return 2
