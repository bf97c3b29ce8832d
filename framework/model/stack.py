"""A stack of decoder layers as a pipeline stage runs it: under `scan` (compile time
independent of depth), each layer under its remat policy (Chen et al. 2016's gradient
checkpointing: `full` keeps each layer's input only; `save_dots` keeps the weight
matmuls' outputs, `save_dots_gathered` their sequence-parallel inputs as gathered too),
padding layers passed over (uneven stages), and the decode path with a KV cache per
layer. The layer itself is `framework/model/llama.py`'s `Block`.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Callable

import jax
import jax.numpy as jnp

from framework.config import ModelConfig
from framework.model import fp8, loss
from framework.model.blockwise import ATTENDED
from framework.model.documents import Documents
from framework.model.layers import NO_TP, layer_windows, split_windows
from framework.model.llama import Block, KVCache
from framework.model.prefix import unit_layers
from framework.parallel import tensor
from framework.parallel.tensor import TensorParallel


def _weight_dots(prim, *avals, **params) -> bool:
    """JAX's `dots_with_no_batch_dims_saveable` (the weight matmuls' outputs), except a
    product of FP8 operands: its float32 result would be kept at twice the compute
    dtype's bytes (llama3_8b with model.fp8: 86.2 GiB compiled, 61.8 without FP8); the
    FP8 matmul's scaled output is kept by name instead (`fp8.PRODUCT`)."""
    if prim is jax.lax.dot_general_p and any(
            jnp.issubdtype(a.dtype, jnp.floating) and a.dtype.itemsize == 1 for a in avals):
        return False
    return jax.checkpoint_policies.dots_with_no_batch_dims_saveable(prim, *avals, **params)


_DOTS_NAMES = (fp8.PRODUCT, loss.GRADS, tensor.EXITED,  # saved beside the weight matmuls
               tensor.GATHERED_PRODUCT, ATTENDED)
REMAT_POLICIES = {
    "full": None,  # save only each layer's input; recompute the rest in the backward
    "save_dots": jax.checkpoint_policies.save_from_both_policies(  # keep weight matmuls
        _weight_dots, jax.checkpoint_policies.save_only_these_names(*_DOTS_NAMES)),
    # ... and the sequence-parallel inputs of the column-parallel matmuls as gathered
    # (`tensor.GATHERED`): the recompute runs no gathering ring (f) again
    "save_dots_gathered": jax.checkpoint_policies.save_from_both_policies(
        _weight_dots, jax.checkpoint_policies.save_only_these_names(
            *_DOTS_NAMES, tensor.GATHERED)),
}

# The policies that keep a gathering ring's products but not the blocks it passed: their
# backward gathers the blocks again beside the weight gradient's matmuls
# (`TensorParallel.regather`) rather than recompute the ring's sends alone.
REGATHERING = ("save_dots",)


def checkpointed(layer, remat: str, gather):
    """`layer(x, params, ...)` under the remat policy `remat`, with `gather` (one layer's
    stored params -> those it runs with: FSDP's gather, which the engine hands over)
    applied first. Gathered weights should never be saved for the backward: the caller
    picks the policy (`Layout.layer_remat`: with a gather, no remat runs as save_dots)."""
    if gather is not None:
        inner = layer
        layer = lambda x, params, *rest: inner(x, gather(params), *rest)
    return layer if remat == "none" else jax.checkpoint(layer, policy=REMAT_POLICIES[remat])


def one_layer(layer, n: int, n_real=None, skip=None, has_aux: bool = False, extra: tuple = (),
              windows=None):
    """One step of `scan_layers`'s loop over n layers: (one(h, params, scanned_l) -> h'
    (or (h', aux)), scanned: what is scanned beside the params, [n, ...] leaves)."""
    if n_real is None:
        return (lambda h, params, s: layer(h, params, *extra, s[0])), (windows,)
    one = lambda h, params, s: skip(s[1] < n_real, lambda p, h, *e: layer(h, p, *e), params,
                                    h, *extra, s[0], has_aux=has_aux)
    return one, (windows, jnp.arange(n))


def scan_layers(layer, x, layers, n_real=None, skip=None, has_aux: bool = False,
                extra: tuple = (), windows=None):
    """scan of `layer(x, params, *extra, window) -> y` (or (y, aux)) over params stacked
    on axis 0 (`extra`: the same for every layer, e.g. document masks; `windows`: each
    layer's sliding window [n], scanned with them, else window None). With `n_real`
    (traced) the layers from index n_real on are padding (uneven stages): `skip(real,
    fn, params, x, *extra, window, has_aux=...)` (`pipeline/stage.py`'s `skip_unless`,
    a custom VJP: traced values as arguments, never closed over) runs a layer only
    where it is real."""
    one, scanned = one_layer(layer, jax.tree.leaves(layers)[0].shape[0], n_real, skip,
                             has_aux, extra, windows)
    body = lambda h, ps: one(h, ps[0], ps[1]) if has_aux else (one(h, ps[0], ps[1]), None)
    return jax.lax.scan(body, x, (layers, scanned))


@dataclass(frozen=True)
class Stack:
    """How a stage runs its layers, the same for every call of one engine: `remat` the
    policy (`Layout.layer_remat`), `tp` the tensor-parallel plan, `skip` what passes
    over padding layers (uneven stages: `pipeline/stage.py`'s `skip_unless`), `gather`
    one layer's stored params -> the params it runs with (FSDP's gather), None: as
    stored."""

    remat: str = "none"
    tp: TensorParallel = NO_TP
    skip: Callable | None = None
    gather: Callable | None = None


def apply_layers(cfg: ModelConfig, layers, x, stack: Stack = Stack(), n_real=None,
                 docs: Documents | None = None, first=None, scan=None):
    """Runs a stack of decoder layers under `scan` (compile time independent of depth).
    layers: params stacked on axis 0 ([n, ...]); x: [batch, seq, embed]; n_real: how
    many of the n are real (uneven pipeline stages pad the rest; `scan_layers`), None:
    all. `docs`: document masks, or None. `first`: the index in the stack of the first
    layer (a pipeline stage's, maybe traced; None: 0; a MoE model's dense prefix comes
    before the stack: layers.layer_windows adds it), which says which layers slide. `scan(one, x, layers, scanned) -> y`: what runs the loop
    over the layers instead of `scan_layers`'s `lax.scan` (`one(h, params, scanned_l)
    -> h'` is one layer, `one_layer`; the pipeline's stash writes each layer's residuals
    in place with it: `pipeline/stash.py`'s `scan_into`)."""
    tp = dataclasses.replace(stack.tp, regather=stack.remat in REGATHERING)
    fixed, windows = split_windows(layer_windows(cfg, jax.tree.leaves(layers)[0].shape[0],
                                                 first), x)

    def layer(x, layer_params, docs, window):
        return Block(cfg, tp).apply(fp8.variables(layer_params), x, docs=docs,
                                    window=fixed if window is None else window)

    run = checkpointed(layer, stack.remat, stack.gather)
    if scan is None:
        return scan_layers(run, x, layers, n_real, stack.skip, extra=(docs,),
                           windows=windows)[0]
    one, scanned = one_layer(run, jax.tree.leaves(layers)[0].shape[0], n_real, stack.skip,
                             extra=(docs,), windows=windows)
    return scan(one, x, layers, scanned)


def apply_layers_cached(cfg: ModelConfig, layers, x, caches: KVCache, start,
                        tp: TensorParallel = NO_TP, first: int = 0):
    """The decode path of `apply_layers`: the same layers, each reading and extending its
    KV cache. layers: [n, ...]; x: [batch, seq, embed] at positions start..start+seq-1;
    caches: the model's whole KVCache, [n_layers, batch, max_len, kv_heads@tensor,
    head_dim] each, these layers' rows from `first` on (a unit's model.moe.every layers,
    prefix.py, k rows each). The caches ride the layer loop as its carry, each layer's
    rows read out and written back in place (as scanned inputs and outputs they were
    rewritten whole every token: a CPU decode step of a 6-layer model wrote 1.0x its
    cache back and moved 6.9x of it without computing; so, 0.002x and 4.4x, the rest
    the attention kernel's own block slices and transposes). The sliding windows mask the cached keys older than
    each layer's window."""
    n, k = jax.tree.leaves(layers)[0].shape[0], unit_layers(cfg)
    fixed, windows = split_windows(layer_windows(cfg, n), x)

    def layer(carry, scanned):
        x, whole = carry
        layer_params, window, l = scanned
        row = first + l * k
        mine = [jax.lax.dynamic_slice_in_dim(a, row, k) for a in whole]  # [k, b, len, ..]
        mine = KVCache(*(a[0] for a in mine) if k == 1 else mine)
        s = x.shape[1]
        x, mine = Block(cfg, tp).apply({"params": layer_params}, x, mine, start,
                                       window=fixed if window is None else window)
        # back into the carry: only the s positions written ([k, b, s, kv, hd])
        new = [jax.lax.dynamic_slice_in_dim(m[None] if k == 1 else m, start, s, axis=2)
               for m in mine]
        whole = tuple(jax.lax.dynamic_update_slice(a, m, (row, 0, start, 0, 0))
                      for a, m in zip(whole, new))
        return (x, whole), None

    (x, caches), _ = jax.lax.scan(layer, (x, tuple(caches)), (layers, windows, jnp.arange(n)))
    return x, KVCache(*caches)
