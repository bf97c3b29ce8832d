"""The one hook every use of a layer weight goes through (`weight_op`), and its forms
around the tensor-parallel plan's collectives and for a bias.

Normally a weight op is just its einsum. The zero-bubble split backward
(framework/engine/split.py) runs a layer under Flax collections that make the same
call record its input (SAVED), add a zero tap whose gradient is dL/dy (TAPS), or, in
the weight-gradient pass, read the input back (GIVEN) and record the output
(PRODUCTS): dW then comes from each op's input and output gradient alone. A weight
used any other way would get a zero gradient there (`weights_outside_weight_op` in
framework/model/llama.py finds such weights).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

from framework.model import fp8, fp8_delayed, fp8_stats
from framework.parallel import vma

# Collections of the split backward (`framework/engine/split.py`), read only when present.
TAPS, SAVED, GIVEN, PRODUCTS = "taps", "matmul_inputs", "given_inputs", "matmul_outputs"


@dataclass(frozen=True)
class Fp8Use:
    """How a weight op's matmul takes part in `model.fp8` (`weight_op`).

    quantized  on FP8 operands (False: a MoE's router and shared-expert gate stay in
               the compute dtype);
    current    False where x's current scale would depend on the layout (a MoE's slots,
               which mix the data replicas' tokens under expert parallelism): where
               delayed scaling's filling step would scale x currently, x stays in the
               compute dtype (w as its FP8 matmuls take it: `fp8.fp8_weight`), its
               exponents counted (framework/model/fp8_delayed.py);
    matrix     the parameter whose FP8 state (history, probes, gathered scale) the op
               uses, where it is not the op's name (a MoE's slots in parts);
    seen       the tensor x's statistics and exponents are taken from, where x arrived
               cast to E4M3 at its delayed scale (`fp8_delayed.sent_in_e4m3`: a MoE's
               slots before their exchange); x itself where None."""
    quantized: bool = True
    current: bool = True
    matrix: str | None = None
    seen: Any = None


PLAIN, IN_COMPUTE_DTYPE = Fp8Use(), Fp8Use(quantized=False)


def weight_op(module: nn.Module, name: str, eq: str, x, w, use: Fp8Use = PLAIN):
    """y = einsum(eq, x, w) (or eq(x, w) where eq is a function, x then any pytree):
    every use of a layer weight goes through here. Normally just
    that; for the zero-bubble split backward (framework/engine/split.py) it records x
    (collection SAVED), adds a zero tap whose gradient is dL/dy (TAPS), or, in the
    weight-gradient pass, reads x back (GIVEN) and records y (PRODUCTS). With
    `model.fp8` a matmul runs on FP8 operands as `use` says (`Fp8Use`)."""
    if module.has_variable(GIVEN, name):
        x = module.get_variable(GIVEN, name)
    if module.is_mutable_collection(SAVED):
        module.sow(SAVED, name, x, init_fn=lambda: None, reduce_fn=lambda _, v: v)
    if callable(eq):  # another product, y = eq(x, w) (the experts' grouped matmul)
        y = eq(x, w)
    elif use.quantized and _fp8(module, eq, w):  # model.fp8
        matrix, seen = use.matrix or name, x if use.seen is None else use.seen
        given, (w_scale, bits) = _delayed(module, matrix), _arrived(module, matrix)
        if given is None and not use.current and module.cfg.fp8 == "delayed":  # filling:
            w = fp8.fp8_weight(w, module.tp.weight_max, w_scale, bits)
            y = _observe(module, matrix, seen, jnp.einsum(eq, x, w))  # x: compute dtype
        else:
            y = _observe(module, matrix, seen, fp8.fp8_einsum(
                eq, x, w, module.tp.whole_max, w_scale, given, module.tp.weight_max, bits),
                given)
    else:
        y = jnp.einsum(eq, x, w)
    if module.is_mutable_collection(PRODUCTS):
        module.sow(PRODUCTS, name, y, init_fn=lambda: None, reduce_fn=lambda _, v: v)
    return module.perturb(name, y, collection=TAPS)


def _fp8(module: nn.Module, eq, w) -> bool:
    """Whether this weight op is an FP8 matmul (model.fp8)."""
    return getattr(getattr(module, "cfg", None), "fp8", "none") != "none" and fp8.is_matmul(eq, w)


def _observe(module: nn.Module, name: str, x, y, given=None):
    """y, with the FP8 statistics of x and dy (at their scales: `given`, else their
    current ones) riding the probe's gradient where the train step handed one
    (framework/model/fp8_stats.py), and with `model.fp8=delayed` their exponents
    (framework/model/fp8_delayed.py)."""
    if module.has_variable(fp8_delayed.EXPONENTS, name):
        y = fp8_delayed.observed(x, y, module.get_variable(fp8_delayed.EXPONENTS, name))
    if not module.has_variable(fp8_stats.PROBES, name):
        return y
    return fp8_stats.observed(x, y, module.get_variable(fp8_stats.PROBES, name), module.tp,
                              given)


def _delayed(module: nn.Module, name: str):
    """With `model.fp8=delayed`: the scales [2] of this matmul's x and dy from its
    history parameter (created here: [2, fp8_history], zeros; read where another op of
    the same matrix made it), or None where the step scales currently (its first:
    collection CURRENT); None without delayed scaling."""
    cfg, key = module.cfg, fp8_delayed.history_name(name)
    if cfg.fp8 != "delayed":
        return None
    history = nn.meta.unbox(module.get_variable("params", key)) \
        if module.has_variable("params", key) else module.param(key, nn.with_logical_partitioning(
            nn.initializers.zeros, (None, None)), (2, cfg.fp8_history), jnp.float32)
    if module.has_variable(fp8_delayed.CURRENT, name):
        return None
    return fp8_delayed.scales(jax.lax.stop_gradient(history))


def sent_scale(module: nn.Module, matrix: str):
    """The scale x can travel at as E4M3 on its way to `matrix`'s matmul
    (`fp8_delayed.sent_in_e4m3`): its delayed scale, with `model.fp8=delayed` and
    `model.fp8_dispatch`, past the filling step; else None (x travels as it is)."""
    cfg = getattr(module, "cfg", None)
    if cfg is None or not fp8_delayed.sends_e4m3(cfg):
        return None
    given = _delayed(module, matrix)
    return None if given is None else given[0]


def _arrived(module: nn.Module, name: str) -> tuple:
    """(w's scale, its E4M3 values' bits) where w arrived quantized: (the scale, None)
    from FSDP's per-use FP8 gathers (w holds the values), (the scale, the bits) from
    ZeRO-1's once-a-step FP8 gather and the tick executor's once-a-step copy (w the
    values, or the matrix's cast, which only takes the gradient); else (None, None)."""
    get = lambda c: module.get_variable(c, name) if module.has_variable(c, name) else None
    return get(fp8.SCALES), get(fp8.VALUES)


def _recording(module: nn.Module, name: str) -> bool:
    """Whether a zero-bubble split backward's pass records or replays this weight op."""
    return module.has_variable(GIVEN, name) or any(
        module.is_mutable_collection(c) for c in (SAVED, TAPS, PRODUCTS))


def gathered_weight_op(module: nn.Module, name: str, eq: str, x, w, split: str,
                       whole_sequence: bool = False):
    """weight_op after the tensor-parallel plan's f (`enter`): one collective matmul
    where the plan fuses them (framework/parallel/tensor.py), outside the split
    backward's recording passes."""
    tp = module.tp
    if tp.fuses(split) and not _recording(module, name):
        if _fp8(module, eq, w):
            given, (w_scale, bits) = _delayed(module, name), _arrived(module, name)
            return _observe(module, name, x, fp8.fp8_gather_matmul(
                eq, x, w, tp, w_scale, given, bits), given)
        return tp.gather_matmul(eq, x, w)
    return weight_op(module, name, eq, tp.enter(x, split, whole_sequence), w)


def scattered_weight_op(module: nn.Module, name: str, eq: str, x, w, split: str,
                        whole_sequence: bool = False):
    """weight_op followed by the plan's g (`exit`), fused likewise."""
    tp = module.tp
    if tp.fuses(split) and not _recording(module, name):
        if _fp8(module, eq, w):
            given, (w_scale, bits) = _delayed(module, name), _arrived(module, name)
            return _observe(module, name, x, fp8.fp8_matmul_scatter(
                eq, x, w, tp, w_scale, given, bits), given)
        return tp.matmul_scatter(eq, x, w)
    return tp.exit(weight_op(module, name, eq, x, w), split, whole_sequence)



def bias_op(module: nn.Module, name: str, y, b):
    """y + b, b broadcast over y's leading [batch, seq]: y [b, s, *b.shape]. b's use is a
    weight op, einsum('bs,...->bs...', ones [b, s], b), so the split backward's weight
    pass gives dL/db = the sum of dL/dy over batch and sequence, as autodiff does. The
    ones vary over the mesh axes y varies over (inside a shard_map): the split backward
    stashes them beside y, and the pipeline's branches must agree on their types."""
    ones = vma.like(jnp.ones(y.shape[:2], y.dtype), y)
    return y + weight_op(module, name, "bs,...->bs...", ones, b.astype(y.dtype))
