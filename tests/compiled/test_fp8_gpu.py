"""FP8 on the GPU compiler, without a GPU (framework/compile): the 8B recipe's layers'
matmuls compiled as FP8 GEMMs (`flops/fp8_share_of_layer_matmuls`, read from the
optimized program: framework/analysis/gemms.py), the head kept in bfloat16."""

import importlib.util

import pytest

from framework.compile import program, targets
from tests.helpers import compose_recipe

pytestmark = [pytest.mark.slow, pytest.mark.skipif(
    not importlib.util.find_spec("jax_plugins"), reason="needs pip install -e '.[aot]'")]
# under full remat, as these figures were read (with save_dots, the recipe's since
# 2026-11-30, the backward gathers the matmuls' inputs again outside the rings)
SMALLER = ("model.n_layers=4", "train.global_batch_size=8", "target=gpu:h100x8",
           "parallel.remat=full")


def _report(*overrides):
    cfg = compose_recipe("llama3_8b", *SMALLER, *overrides, config="compile")
    return program.compile_report(cfg, targets.parse(cfg.target))


def test_the_8b_layers_run_fp8_gemms_on_the_gpu_compiler():
    """As the recipe ships, collective matmuls included: every ring's block product an
    FP8 GEMM, the gathering rings' blocks E4M3 (2026-11-29: `tensor` 3,456.4 against
    4,608.4 MiB a step, still 92% overlapped against 94%)."""
    from framework.analysis import comm_model

    fp8 = _report("model.fp8=tensorwise")
    bf16 = _report()
    for got, fmt in ((fp8, "tensorwise"), (bf16, "none")):  # the rings' bytes, predicted
        cfg = compose_recipe("llama3_8b", *SMALLER, f"model.fp8={fmt}", config="compile")
        expected = comm_model.expected_bytes(cfg.model, cfg.parallel, cfg.train)["tensor"]
        assert abs(got["comm/bytes_per_step/tensor"] / expected - 1) < 0.01, (fmt, expected)
    assert fp8["flops/fp8_share_of_layer_matmuls"] >= 0.9
    assert bf16["flops/fp8_share_of_layer_matmuls"] == 0.0
    assert fp8["attention"] == bf16["attention"] == "cudnn"
    tensor = "comm/bytes_per_step/tensor"
    assert fp8[tensor] < 0.8 * bf16[tensor]
    assert fp8["comm/overlapped_fraction/tensor"] > 0.85
    # FP8's own kernels: casts, absolute maxima, the whole-tensor maxima's scalar
    # all-reduces over `tensor` (none in bfloat16; framework/analysis/kernels.py)
    for kind in ("fp8_cast", "amax", "scalar_all_reduce"):
        assert fp8[f"kernels/{kind}_per_step"] > 0 and bf16[f"kernels/{kind}_per_step"] == 0, kind
    assert fp8["kernels/gemm_per_step"] > 0 and bf16["kernels/gemm_per_step"] > 0
    # the quantization's temporaries cost a little memory (4 layers, full remat: +4%)
    assert fp8["memory/compiled_bytes_per_device"] < 1.1 * bf16["memory/compiled_bytes_per_device"]


def test_delayed_scaling_casts_without_a_maximum_or_an_all_reduce_on_the_gpu_compiler():
    """model.fp8=delayed: the layers' matmuls still FP8 GEMMs, the scalar all-reduces
    of the whole-tensor maxima gone (the one left: the step's loss; with current
    scaling, the test above, hundreds) and most absolute maxima with them (2026-11-30,
    the full 8B recipe: 1,283 -> 1 all-reduces, 1,768 -> 168 maxima, 2,562 -> 2,385 GiB
    read and written a step; here, 4 layers under full remat, 237.1 -> 229.7 GB)."""
    delayed = _report("model.fp8=delayed", "model.fp8_stats=false")
    assert delayed["flops/fp8_share_of_layer_matmuls"] >= 0.9
    assert delayed["kernels/scalar_all_reduce_per_step"] <= 1
    assert delayed["kernels/amax_per_step"] < 0.2 * delayed["kernels/fp8_cast_per_step"]


@pytest.mark.parametrize("sharding,gathers", [
    (("parallel.zero1=false", "parallel.fsdp=true"), ("true", "false")),
    (("parallel.zero1=true", "parallel.fsdp=false"), ("true",))], ids=["fsdp", "zero1"])
def test_data_parallel_gathers_send_the_8b_layers_as_fp8_on_the_gpu_compiler(sharding,
                                                                              gathers):
    """FSDP per use and ZeRO-1 (gathering once a step, as FSDP with fsdp_regather=step)
    with FP8 gathers (model.fp8_gather): the measured `data` bytes of the optimized GPU
    program are the communication model's, each within 1%, for FP8 and plain gathers.
    2026-11-28, FSDP: 3,252.4 against 3,668.4 MiB a step (the layers' bfloat16 gathers
    halve); 2026-11-30, ZeRO-1: 1,396.9 against 1,500.9 (its bfloat16 gather of the
    layers' matrices halved; the float32 embedding and the reduce-scatters in float32
    are most of it at 4 layers; 1,522.1 against 1,834.1 when the plain gather sent the
    matrices as stored). The plain gather under FSDP only (until 2026-12-01 ZeRO-1's
    too, 24 s of the suite: the FP8 gather is what this file checks)."""
    from framework.analysis import comm_model

    fsdp = ("model.fp8=tensorwise", "parallel.collective_matmul=false", "parallel.pipeline=1",
            "parallel.data=2", "parallel.microbatches=2") + sharding
    got = {}
    for gather in gathers:
        cfg = compose_recipe("llama3_8b", *SMALLER, *fsdp, f"model.fp8_gather={gather}",
                             config="compile")
        measured = program.compile_report(cfg, targets.parse(cfg.target))
        expected = comm_model.expected_bytes(cfg.model, cfg.parallel, cfg.train,
                                             param_dtype=cfg.optim.param_dtype)["data"]
        got[gather] = measured["comm/bytes_per_step/data"]
        assert abs(got[gather] / expected - 1) < 0.01, (gather, got[gather], expected)
    if "false" in got:
        assert got["true"] < 0.95 * got["false"]
    if "parallel.zero1=true" in sharding:  # no more E4M3 casts than maxima: ZeRO-1's
        # gathered values are read as their bits, not converted back to bfloat16 and
        # quantized again at each use (180 casts for 132 maxima until 2026-12-02, 116
        # after; framework/engine/fp8_gathers.py `gather_layers_quantized`)
        assert measured["kernels/fp8_cast_per_step"] <= measured["kernels/amax_per_step"]


def test_save_dots_keeps_an_fp8_matmuls_output_in_the_compute_dtype():
    """save_dots keeps each weight matmul's output; for an FP8 matmul that is its scaled
    output, by name (`fp8.PRODUCT`), not the float32 product of its FP8 operands, which
    holds twice the bytes (the 8B recipe with model.fp8 on 2026-11-30: 86.2 GiB
    compiled, over the H100's 80, against 61.8 in bfloat16; 47.4 since). The memory
    model follows the program's residuals."""
    found = {}
    for fmt in ("none", "tensorwise"):
        cfg = compose_recipe("llama3_8b", *SMALLER[:-1], "parallel.remat=save_dots",
                             f"model.fp8={fmt}", config="compile")
        found[fmt] = program.compile_report(cfg, targets.parse(cfg.target))
    compiled = {f: r["memory/compiled_bytes_per_device"] for f, r in found.items()}
    assert compiled["tensorwise"] < compiled["none"], compiled
    ratio = found["tensorwise"]["memory/predicted_bytes_per_device"] / compiled["tensorwise"]
    assert 0.9 <= ratio <= 1.1, ratio
