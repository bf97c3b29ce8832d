"""Tensor parallelism: the collectives a layer needs at its tensor-parallel boundaries.

Megatron-LM (Shoeybi et al. 2019) splits each block into a column-parallel matmul
(weights sharded on their output dim: q/k/v, gate/up) followed by a row-parallel one
(sharded on their input dim: attention output, down projection). Each device then
holds partial sums, and two conjugate operators close the block:

    f = `enter`: before the column-parallel matmul. Forward: identity. Backward:
        all-reduce of the input gradient (JAX inserts it: the input is the same on
        every `tensor` device, the weights are not).
    g = `exit`: after the row-parallel matmul. Forward: all-reduce. Backward: identity.

With sequence parallelism (Korthikanti et al. 2022) the activations between blocks
(norms, residuals, the pipeline's messages) stay sharded along the sequence, so
f becomes an all-gather along the sequence and g a reduce-scatter: the same bytes as
one all-reduce, with 1/tensor of the activation memory outside the matmuls.

The vocabulary-parallel embedding and loss need a sum, a max and this device's
offset into the vocabulary. `TensorParallel()` (no axis) is the single-device
reference: every operator is the identity. The model receives this object, never a
mesh; the engine builds it for the `tensor` mesh axis.
"""

from __future__ import annotations

from dataclasses import dataclass

import jax

SEQ = 1  # activations are [batch, seq, ...]


@dataclass(frozen=True)
class TensorParallel:
    axis: str | None = None  # the mesh axis, inside a shard_map that is manual over it
    size: int = 1  # devices along it: layers declare 1/size of each sharded dim
    sequence_parallel: bool = False

    def local(self, n: int) -> int:
        """This device's share of a dimension sharded over `tensor`."""
        return n // self.size

    def enter(self, x):
        """f: x [b, s (/tensor with SP), d] -> [b, s, d], the same on every device."""
        if self.axis is None or not self.sequence_parallel:
            return x
        return jax.lax.all_gather(x, self.axis, axis=SEQ, tiled=True)

    def exit(self, partial):
        """g: partial sums [b, s, d] -> their total ([b, s / tensor, d] with SP)."""
        if self.axis is None:
            return partial
        if self.sequence_parallel:
            return jax.lax.psum_scatter(partial, self.axis, scatter_dimension=SEQ, tiled=True)
        return jax.lax.psum(partial, self.axis)

    def vocab_offset(self, local_size: int):
        """Index of this device's first vocabulary entry (vocabulary-parallel layers)."""
        return 0 if self.axis is None else jax.lax.axis_index(self.axis) * local_size

    def vocab_sum(self, x):
        return x if self.axis is None else jax.lax.psum(x, self.axis)

    def vocab_max(self, x):
        return x if self.axis is None else jax.lax.pmax(x, self.axis)
