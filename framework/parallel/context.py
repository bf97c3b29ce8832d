"""Context parallelism: the sequence split over the `context` mesh axis (the load-
balanced layout of Megatron-LM's context parallelism and of Llama 3's training,
Dubey et al. 2024, sec. 3.3.2), for ring attention across it (Liu et al. 2023).

Layout. A sequence of n tokens is cut into 2c chunks of h = n / 2c; device i of the
`c` context devices holds chunks i and 2c - 1 - i, [b, 2h, ...]. Under a causal mask
chunk a attends to chunks <= a, so a device holding an early and a late chunk does the
same attention work as every other one (a plain split would leave device 0 one block
and device c - 1 c of them). Every token-wise part of the model (norms, MLP, the head
and the loss) runs on the local tokens as it is; RoPE reads their global positions
(`positions`); only attention mixes tokens across devices.

Ring attention runs in the model (framework/model/ring_attention.py), driven by this
object, which the model is handed inside its tensor-parallel plan and which knows the
mesh for it: the chunks a device holds, whose keys it holds at each ring step
(`holder`) and the shift to the next device (`shift`; on CPU devices an all-gather
and a pick, `ring_shift`).

`ContextParallel()` (no axis) is the single-device reference: positions 0..n-1, and
the model runs its own attention kernel. Generation (the KV cache) does not split
the sequence.
"""

from __future__ import annotations

from dataclasses import dataclass

import jax
import jax.numpy as jnp


@dataclass(frozen=True)
class ContextParallel:
    axis: str | None = None  # the mesh axis, inside a shard_map that is manual over it
    size: int = 1  # devices along it
    permute: bool = True  # the ring's shift by collective-permute (False: CPU, above)

    def _index(self):
        return jax.lax.axis_index(self.axis) if self.size > 1 else 0

    def chunks(self):
        """The global chunk indices this device holds, (i, 2c - 1 - i) (traced)."""
        i = self._index()
        return i, 2 * self.size - 1 - i

    def split(self, x, axis: int = -1):
        """The whole sequence [..., n, ...] -> this device's two chunks [..., 2h, ...]."""
        if self.size == 1:
            return x
        axis = axis % x.ndim
        n = x.shape[axis]
        h = n // (2 * self.size)
        return jnp.concatenate([jax.lax.dynamic_slice_in_dim(x, c * h, h, axis=axis)
                                for c in self.chunks()], axis=axis)

    def positions(self, n_local: int):
        """[n_local] int32: the global positions of this device's tokens."""
        if self.size == 1:
            return jnp.arange(n_local, dtype=jnp.int32)
        h = n_local // 2
        return jnp.concatenate([c * h + jnp.arange(h, dtype=jnp.int32)
                                for c in self.chunks()])

    def holder(self, step: int):
        """The device whose keys and values this one holds at ring step `step`, i - step."""
        return (self._index() - step) % self.size

    def shift(self, x):
        """x of device i, received by device i + 1 (mod size)."""
        return ring_shift(x, self.axis, self.size, 1, self.permute)


def ring_shift(x, axis: str, size: int, by: int, permute: bool):
    """A pytree x of device i, received by device i + by (mod size) along `axis`: a
    `collective-permute`, or with `permute=False` (CPU devices) an all-gather and a
    pick, the same values. The CPU runtime meets every collective-permute across all the
    devices of its pairs, so a permute inside a pipeline cell, which only some pipeline
    ranks run at a tick, waits for ranks that run it at another tick (measured: wrong
    gradients at pipeline 2, or a hang). The rings of the collective matmul
    (framework/parallel/tensor.py) and of ring attention shift through here."""
    if permute:
        return jax.lax.ppermute(x, axis, [(j, (j + by) % size) for j in range(size)])
    source = (jax.lax.axis_index(axis) - by) % size
    return jax.tree.map(lambda a: jax.lax.all_gather(a, axis)[source], x)

