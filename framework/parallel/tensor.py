"""Tensor parallelism, derived from one plan: the logical-axis rules of
`framework/parallel/rules.py`. The model declares every weight with its *global* shape and
logical axes; this object turns that into the device's local shape and decides which
collectives a block needs, so the shard_map specs (built from the same rules) and the
model cannot disagree.

Megatron-LM (Shoeybi et al. 2019) splits each block into a column-parallel matmul
(weights sharded on their output dim: q/k/v, gate/up) followed by a row-parallel one
(sharded on their input dim: attention output, down projection). Each device then
holds partial sums, and two conjugate operators close the block:

    f = `enter`: before the column-parallel matmul. Forward: identity. Backward:
        all-reduce of the input gradient (JAX inserts it: the input is the same on
        every `tensor` device, the weights are not).
    g = `exit`: after the row-parallel matmul. Forward: all-reduce. Backward: identity.

A block names the logical axis it splits (`kv_heads`/`heads` for attention, `mlp`,
`vocab`); f and g are placed only when the rules map that axis to this mesh axis. A
block whose axis is not split runs replicated and needs neither.

With sequence parallelism (Korthikanti et al. 2022) the activations between blocks
(norms, residuals, the pipeline's messages) stay sharded along the sequence, so
f becomes an all-gather along the sequence and g a reduce-scatter: the same bytes as
one all-reduce, with 1/tensor of the activation memory outside the matmuls. An
unsplit block that mixes tokens (attention, the embedding lookup) gathers the sequence
and keeps its own slice of the result; an unsplit token-wise block (the MLP) runs on
its slice as it is.

A collective matmul (Wang et al. 2023, "Overlap communication with dependent
computation via decomposition"; Megatron-LM's `--tp-comm-overlap`) hides those
collectives behind the matmul they feed or follow, which a layer's sequential work
otherwise leaves nothing to hide behind. With `collective_matmul` (sequence parallelism
only) f + matmul becomes a ring of `tensor` steps: each device multiplies the sequence
block it holds while passing it on to the next device (`ppermute`), so every block
meets every device's weights; matmul + g becomes a ring of partial sums: each step
adds this device's product for one block to the sum passed in and passes it on, and
after `tensor` steps each device holds the full sum of its own block. The same bytes as
the all-gather and the reduce-scatter they replace, sent in `tensor - 1` pieces beside
`tensor` matmuls of a block each; autodiff turns each ring into the other for the
backward. Under a remat policy that keeps the matmuls' outputs but not the blocks a
gathering ring passed (`regather`: save_dots), the backward gathers them again itself
in one ring with dx's partial sums, beside both gradients' block matmuls
(`gather_ring_grads`), instead of a recompute that would send them with no matmul
beside them. The zero-bubble split backward's passes (which record or replay each weight
op's input and output whole) keep the plain collectives. On CPU devices the ring's
shift is an all-gather and a pick (`permute=False`; why: `context.ring_shift`).

The vocabulary-parallel embedding and loss need a sum, a max and this device's
offset into the vocabulary. `TensorParallel()` (no axis) is the single-device
reference: every operator is the identity. The model receives this object, never a
mesh; the engine builds it for the `tensor` mesh axis. It also carries the sequence's
other split, over `context` (`context`, framework/parallel/context.py): the positions
RoPE reads and the ring attention runs on; and the MoE experts' split over `expert`
(`expert`, framework/parallel/expert.py).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import partial

import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name

from framework.config import TENSOR_SPLITTABLE
from framework.errors import PlanError
from framework.parallel.context import ContextParallel, ring_shift
from framework.parallel.expert import ExpertParallel
from framework.parallel import vma
from framework.parallel.mesh import TENSOR
from framework.parallel.rules import param_rules

SEQ = 1  # activations are [batch, seq, ...]
# g's total (`exit`, the ring of partial sums `scatter_ring`), by name: a remat policy
# that saves the weight matmuls' outputs saves this too (framework/model/stack.py),
# else it keeps the partial products ([b, s, d], or the ring's `tensor` blocks of
# [b, s/tensor, d]) and sums them over the devices again in the backward.
EXITED = "tensor_exit"
# f's gathered sequence (`enter`'s all-gather, each block a gathering ring multiplies,
# `gather_ring`), by name: `save_dots_gathered` saves it too, so the backward's
# recompute does not gather the inputs of the weight gradients' matmuls again.
GATHERED = "tensor_gathered"
# A gathering ring's products in sequence order (`gather_matmul`'s output), by name: a
# policy that keeps the weight matmuls' outputs keeps this too, so the backward's
# recompute need not run the ring's steps again to put the kept products in order.
GATHERED_PRODUCT = "tensor_gathered_product"
# Pairs of logical axes that must be split together (attention's fused q/k/v weight
# and its output projection).
SPLIT_TOGETHER = (("heads", "kv_heads"),)


def _varied(v, axes: tuple) -> tuple:
    """The mesh axes of `axes` that the value v varies over (inside a shard_map)."""
    varying = jax.typeof(v).manual_axis_type.varying
    return tuple(a for a in axes if a in varying)


@dataclass(frozen=True)
class TensorParallel:
    axis: str | None = None  # the mesh axis, inside a shard_map that is manual over it
    size: int = 1  # devices along it
    sequence_parallel: bool = False
    rules: tuple = field(default_factory=param_rules)  # logical -> mesh axis
    collective_matmul: bool = False  # rings instead of f and g (sequence parallel only)
    permute: bool = True  # the rings' shift by collective-permute (False: CPU, above)
    context: ContextParallel = ContextParallel()  # the sequence's split over `context`
    expert: ExpertParallel = ExpertParallel()  # the MoE experts' split over `expert`
    # The mesh axes one microbatch's tensors are split over (a whole-tensor statistic,
    # e.g. FP8's absolute maximum, reduces over them: `whole_max`).
    stat_axes: tuple = ()
    # The groups a step's batch is cut into for such statistics: data replicas x
    # microbatches (a per-group loss, MoE's load balance, is averaged over them).
    groups: int = 1
    # A gathering ring's backward gathers x's blocks again beside the weight gradient's
    # block matmuls (`_regathering`) instead of reading the blocks the forward passed:
    # for a remat policy that keeps the matmuls' outputs but not the blocks, whose
    # recompute would otherwise run the ring's sends again with no matmul beside them.
    regather: bool = False

    def __post_init__(self):
        split = {name for name, mesh_axis in self.rules if mesh_axis == TENSOR}
        unknown = sorted(split - set(TENSOR_SPLITTABLE))
        if unknown:
            raise PlanError(f"sharding rules map {', '.join(unknown)} to {TENSOR}, "
                            f"but the model can only split {', '.join(TENSOR_SPLITTABLE)} over it")
        for group in SPLIT_TOGETHER:
            if 0 < len(split & set(group)) < len(group):
                raise PlanError(f"sharding rules must map {' and '.join(group)} to the same "
                                f"mesh axis (attention's q/k/v and output projections)")
        if self.sequence_parallel and "vocab" not in split and self.size > 1:
            raise PlanError("sequence parallelism needs the vocabulary split over "
                            f"{TENSOR} (the loss is summed over whole sequences)")

    def whole_max(self, v):
        """A per-device maximum (a scalar) as the whole tensor's: the max over the
        `stat_axes` the value varies over (a tensor replicated over one is the same
        on each device, and the max changes nothing)."""
        axes = _varied(v, self.stat_axes)
        return jax.lax.pmax(v, axes) if axes else v

    def weight_max(self, v):
        """A per-device maximum of a weight (a scalar, or one per stacked layer) as the
        whole matrix's: as `whole_max`, and over `expert` too where the value varies
        over it (a MoE's experts, split over the expert devices, take one scale for all
        of them, as on one device; a dense weight is the same on each expert device)."""
        own = (self.expert.axis,) if self.expert.runs else ()
        axes = _varied(v, self.stat_axes + own)
        return jax.lax.pmax(v, axes) if axes else v

    def whole_sum(self, v):
        """A per-device sum as the whole microbatch's: summed over the `stat_axes` the
        value varies over (where it is replicated, each device already has the whole)."""
        axes = _varied(v, self.stat_axes)
        return jax.lax.psum(v, axes) if axes else v

    def splits(self, logical: str) -> bool:
        """Whether this logical axis is split over the mesh axis this object runs on."""
        return self.axis is not None and dict(self.rules).get(logical) == self.axis

    def local_shape(self, shape, logical_axes) -> tuple:
        """The device's shard of a weight of global `shape` with these logical axes."""
        out = []
        for n, name in zip(shape, logical_axes):
            if self.expert.runs and dict(self.rules).get(name) == self.expert.axis:
                n = self.expert.local_experts(n)
            elif self.splits(name):
                if n % self.size:
                    raise PlanError(f"{name} of size {n} cannot be split {self.size} ways")
                n //= self.size
            out.append(n)
        return tuple(out)

    def _gather_sequence(self) -> bool:
        return self.axis is not None and self.sequence_parallel

    def enter(self, x, split: str, whole_sequence: bool = False):
        """f before the block that splits `split`: x [b, s (/tensor with SP), d] ->
        [b, s, d]. An unsplit block gathers the sequence only if it needs every token."""
        if self._gather_sequence() and (self.splits(split) or whole_sequence):
            return checkpoint_name(jax.lax.all_gather(x, self.axis, axis=SEQ, tiled=True),
                                   GATHERED)
        return x

    def exit(self, y, split: str, whole_sequence: bool = False):
        """g after the block that splits `split`: partial sums [b, s, d] -> their total
        ([b, s / tensor, d] with SP). Unsplit: y is complete; with SP a block that saw
        the whole sequence keeps this device's slice of it."""
        if self.splits(split):
            if self.sequence_parallel:
                return checkpoint_name(jax.lax.psum_scatter(
                    y, self.axis, scatter_dimension=SEQ, tiled=True), EXITED)
            return checkpoint_name(jax.lax.psum(y, self.axis), EXITED)
        if self._gather_sequence() and whole_sequence:
            n = y.shape[SEQ] // self.size
            start = jax.lax.axis_index(self.axis) * n
            return jax.lax.dynamic_slice_in_dim(y, start, n, axis=SEQ)
        return y

    def varies(self, x, split: str):
        """x, replicated over `tensor`, typed as varying over it before a block that
        splits `split`: the backward's all-reduce of its gradient (f's) then runs on x
        itself rather than where autodiff would place it, on the first larger tensor
        derived from x that meets the split weights (MoE: the dispatched copies)."""
        return vma.cast(x, (self.axis,)) if self.splits(split) else x

    def fuses(self, split: str) -> bool:
        """Whether f/g around a block that splits `split` run as collective matmuls."""
        return self.collective_matmul and self._gather_sequence() and self.splits(split)

    def gather_matmul(self, eq: str, x, w):
        """einsum(eq, enter(x), w) as a ring (module docstring): x [b, s/tensor, d] ->
        y [b, s, ...]."""
        if self.regather:
            return checkpoint_name(_regathering(eq, self, x, w), GATHERED_PRODUCT)
        return checkpoint_name(self.gather_ring(x, w, _einsum(eq)), GATHERED_PRODUCT)

    def matmul_scatter(self, eq: str, x, w):
        """exit(einsum(eq, x, w)) as a ring of partial sums: x [b, s, f] -> [b, s/tensor,
        d]."""
        return self.scatter_ring(x, w, _einsum(eq))

    def gather_ring(self, x, w, product):
        """product(block, w) of every sequence block of x, in sequence order: x [b,
        s/tensor, ...] -> product's leaves [b, s, ...]. Step k multiplies the block of
        device i - k while the block travels on to i + 1. (FP8's rings pass E4M3 blocks
        and return them too: framework/model/fp8.py.)"""
        t, i = self.size, jax.lax.axis_index(self.axis)
        block, ys = x, []
        for _ in range(t - 1):
            sent = ring_shift(block, self.axis, t, 1, self.permute)
            block, y = _beside(sent, lambda b=block: product(checkpoint_name(b, GATHERED), w))
            ys.append(y)
        ys.append(product(checkpoint_name(block, GATHERED), w))
        return jax.tree.map(lambda *blocks: _in_sequence(blocks, i, t), *ys)

    def scatter_ring(self, x, w, product):
        """The sum over the tensor devices of product(x's block i, w) for this device's
        sequence block i: x [b, s, ...] -> [b, s/tensor, ...]. Step k adds this device's
        product for block i + k + 1 to the sum arriving from device i + 1 and passes it
        to i - 1; the last step's block is i's own."""
        t, i = self.size, jax.lax.axis_index(self.axis)
        n = x.shape[SEQ] // t
        block = lambda k: jax.lax.dynamic_slice_in_dim(x, ((i + k + 1) % t) * n, n, axis=SEQ)
        total = product(block(0), w)
        for k in range(1, t):
            sent = ring_shift(total, self.axis, t, -1, self.permute)
            arriving, part = _beside(sent, lambda k=k, total=total: _product_after(
                product, block(k), w, total))
            total = arriving + part
        return checkpoint_name(total, EXITED)

    def gather_ring_grads(self, x, w, dy, for_x, for_w=None):
        """(dx, dw) of `gather_ring(x, w, product)` from dy [b, s, ...], having kept only
        x [b, s/tensor, ...]: for_x(rows, w) and for_w(block, rows) are product's
        transposes. One ring of `tensor` steps, both directions' bytes beside the
        matmuls: step k sends on the x block it holds (device i + k's, arriving from i +
        1) and dx's partial sum for block i + k (`scatter_ring`'s), while it adds its
        weight gradient for the block it holds and its dx product for block i + k + 1.
        Each of dy's blocks is sliced once for both of its matmuls. Without for_w:
        (dx, x gathered [b, s, ...]), each block written in place as it passes, for one
        weight gradient over the whole sequence after the ring (FP8's: its blocks'
        float32 partial sums would cost more traffic than its E4M3 input gathered)."""
        t, i = self.size, jax.lax.axis_index(self.axis)
        n = x.shape[SEQ]
        rows = lambda k: jax.lax.dynamic_slice_in_dim(dy, ((i + k) % t) * n, n, axis=SEQ)
        own, held, total, dw, r_held, blocks = rows(0), x, None, None, None, []
        for k in range(t):
            r_held = own if k == 0 else r_held  # dy's rows of the block held (i + k)
            r_next = own if k == t - 1 else rows(k + 1)
            sends = (ring_shift(held, self.axis, t, -1, self.permute) if k < t - 1 else None,
                     ring_shift(total, self.axis, t, -1, self.permute) if k else None)
            if k:  # the step's matmuls wait for the sum they add to (`_product_after`'s
                held, r_held, r_next, w, _ = jax.lax.optimization_barrier(  # reason)
                    (held, r_held, r_next, w, total))
            blocks.append(held)
            parts = (for_x(r_next, w),) + (() if for_w is None else (for_w(held, r_held),))
            sends, parts = jax.lax.optimization_barrier((sends, parts))
            if for_w is not None:
                dw = parts[1] if dw is None else dw + parts[1]
            total = parts[0] if total is None else sends[1] + parts[0]
            held, r_held = sends[0], r_next
        return total, (_in_sequence(blocks, i, t, 1) if for_w is None else dw)

    def vocab_offset(self, local_size: int):
        """Index of this device's first vocabulary entry (vocabulary-parallel layers)."""
        return jax.lax.axis_index(self.axis) * local_size if self.splits("vocab") else 0

    def vocab_sum(self, x):
        return jax.lax.psum(x, self.axis) if self.splits("vocab") else x

    def vocab_max(self, x):
        return jax.lax.pmax(x, self.axis) if self.splits("vocab") else x


def _einsum(eq: str):
    return lambda block, w: jnp.einsum(eq, block, w)


@partial(jax.custom_vjp, nondiff_argnums=(0, 1))
def _regathering(eq: str, tp: TensorParallel, x, w):
    """tp.gather_ring(x, w, einsum(eq)), whose backward keeps only x (`regather`): dx is a
    ring of partial sums of dy's blocks times w, dw the sum of each block's weight
    gradient as x's blocks travel the ring again: one ring (`gather_ring_grads`)."""
    return tp.gather_ring(x, w, _einsum(eq))


def _regathering_forward(eq, tp, x, w):
    return _regathering(eq, tp, x, w), (x, w)


def _regathering_backward(eq, tp, inputs, dy):  # dy [b, s, ...]
    x, w = inputs
    for_x = lambda rows, w: jax.linear_transpose(lambda b: _einsum(eq)(b, w), x)(rows)[0]
    for_w = lambda block, rows: jax.linear_transpose(
        lambda v: _einsum(eq)(block, v), w)(rows)[0]
    return tp.gather_ring_grads(x, w, dy, for_x, for_w)


_regathering.defvjp(_regathering_forward, _regathering_backward)


@partial(jax.custom_vjp, nondiff_argnums=(0,))
def _product_after(product, x, w, after):
    """product(x, w), its matmul made to wait for `after` (a scattering ring's last sum),
    so that XLA cannot merge the steps' matmuls (all of x is at hand) into one before
    the ring. Its backward is product's at (x, w): it does not read `after`, so a
    remat policy that keeps weight matmuls' outputs (`save_dots`) need not keep the
    ring's per-step products to rebuild the chain of sums the wait ties in (it did:
    t - 1 blocks of [b, s/t, d] a ring, which the tick executor's stash carried;
    docs/performance.md, "A scattering ring's parts")."""
    x, w, _ = jax.lax.optimization_barrier((x, w, after))
    return product(x, w)


def _product_after_forward(product, x, w, after):
    return _product_after(product, x, w, after), (x, w)


def _product_after_backward(product, inputs, dy):
    """product's VJP, and `after`'s zero gradient (the shape of the sum: dy's) tied to
    it as the forward's wait's transpose tied them: the backward's ring then runs each
    step's matmuls beside its shift (left untied, the GPU compiler overlapped 60% of
    llama3_8b's tensor bytes at 4 layers instead of 81%)."""
    dx, dw = jax.vjp(product, *inputs)[1](dy)
    return jax.lax.optimization_barrier((dx, dw, jnp.zeros_like(dy)))


_product_after.defvjp(_product_after_forward, _product_after_backward)


def _beside(sent, matmul):
    """(sent, matmul()) with neither usable before both are done: the scheduler then
    runs the block's matmul while the block travels (each ring step in turn). Without
    it the GPU compiler sent a ring's blocks back to back and, as XLA's dot merger
    joined the matmuls sharing a weight, ran one big matmul after the last arrived."""
    return jax.lax.optimization_barrier((sent, matmul()))


def _in_sequence(blocks, i, t: int, step: int = -1):
    """A ring's products in sequence order: blocks[k] [b, s/t, ...] is sequence block
    (i + step * k) mod t of [b, s, ...], each written in place at its offset. (Stacking them
    and indexing the stack by that order was a gather, whose transpose in the backward
    scatter-added every layer's output gradient into a zeroed stack: llama3_8b's
    gate_up, 333 GiB a step of the GPU program's traffic; here the backward slices the
    gradient, docs/performance.md.)"""
    first = blocks[0]
    n = first.shape[SEQ]
    shape = first.shape[:SEQ] + (t * n,) + first.shape[SEQ + 1:]
    out = vma.like(jnp.zeros(shape, first.dtype), first)
    for k, block in enumerate(blocks):
        out = jax.lax.dynamic_update_slice_in_dim(out, block, ((i + step * k) % t) * n,
                                                  axis=SEQ)
    return out
