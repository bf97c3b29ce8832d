"""Compile targets by name (framework/compile/targets.py)."""

import pytest

from framework.compile import targets
from framework.errors import ConfigError


@pytest.mark.parametrize("name, platform, n, topology, gib", [
    ("tpu:v5p-8", "tpu", 4, "v5p:2x2x1", 96),
    ("tpu:v5p-256", "tpu", 128, "v5p:4x4x8", 96),
    ("tpu:v5e-16", "tpu", 16, "v5e:4x4", 16),
    ("tpu:v6e-64", "tpu", 64, "v6e:8x8", 32),
    ("gpu:h100x8", "gpu", 8, "1x1x8", 80),
    ("gpu:h100x64", "gpu", 64, "1x8x8", 80),
    ("gpu:a100x4", "gpu", 4, "1x1x4", 80),
    ("gpu:h200x8", "gpu", 8, "1x1x8", 141),
])
def test_targets_by_name(name, platform, n, topology, gib):
    t = targets.parse(name)
    assert (t.platform, t.n_devices, t.topology) == (platform, n, topology)
    assert round(t.device_bytes / 2**30) == gib


def test_every_gpu_file_names_its_device_and_memory():
    for model in targets.gpu_models():
        t = targets.parse(f"gpu:{model}x8")
        assert 'device_description_str: "NVIDIA' in t.config_text and t.device_bytes > 2**34


@pytest.mark.parametrize("name, says", [
    ("gpu:h100x12", "a multiple of 8"),
    ("gpu:v100x8", "a model of a100, b200, h100, h200"),
    ("tpu:v5p-6", "a v5p slice has one of these sizes: 8, 16, 32"),
    ("tpu:v9-8", "TPU versions are v5p, v5e, v6e"),
    ("cuda:8", "is not a compile target: use local, tpu:v5p-"),
])
def test_a_wrong_target_is_one_line_naming_what_is_valid(name, says):
    with pytest.raises(ConfigError) as err:
        targets.parse(name)
    assert says in str(err.value) and "\n" not in str(err.value)


def test_a_missing_compiler_names_the_pip_command():
    with pytest.raises(ConfigError) as err:
        targets._require(("no_such_module.plugin",), "NVIDIA GPUs")
    assert "pip install -e '.[aot]'" in str(err.value)


SCALE = {"llama3_8b": "gpu:h100x8", "llama3_8b_v5p": "tpu:v5p-32",
         "llama3_70b": "gpu:h100x64", "llama3_70b_v5p": "tpu:v5p-128",
         "llama3_405b": "gpu:h100x1024", "llama3_8b_128k": "gpu:h100x64",
         "llama3_8b_128k_v5p": "tpu:v5p-128", "qwen3_30b_a3b": "gpu:h100x8",
         "mixtral_8x7b": "gpu:h100x16"}


@pytest.mark.parametrize("recipe", sorted(SCALE))
def test_the_scale_recipes_are_valid_on_their_targets(recipe):
    """Each recipe's layout is valid on the target its comment names (docs/compile.md
    has what the compilers said of them)."""
    from framework.engine.validate import validate
    from tests.helpers import REPO, compose_recipe

    cfg = compose_recipe(recipe)
    target = targets.parse(SCALE[recipe])
    assert f"target={SCALE[recipe]}" in (REPO / "recipes" / f"{recipe}.yaml").read_text()
    parallel = validate(cfg.model, cfg.parallel, cfg.train, target.n_devices)
    assert parallel.n_devices == target.n_devices
    assert cfg.devices.platform == target.platform
