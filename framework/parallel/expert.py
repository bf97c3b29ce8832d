"""Expert parallelism (`parallel.expert=E`): each MoE layer's E_total experts sharded over
the `expert` mesh axis, E_total / E per device, and every token copy sent to the device
that holds its expert and back.

The `expert` axis is carved out of the data devices (framework/parallel/mesh.py): each
device of an expert group holds different rows of the batch (the dense layers see
`expert` as one more data axis) and different experts. A MoE layer then, on each device:

  1. sorts its token copies (a token once per chosen expert) by expert id, so that the
     copies for device j = id // (E_total / E) form one run, the j-th;
  2. `dispatch`: all-to-all over `expert`, device j receiving every group member's run
     for it;
  3. runs its own experts on what it received, grouped (`jax.lax.ragged_dot` over the
     received rows sorted by local expert);
  4. `combine`: the all-to-all back, each output row to the device and place its token
     copy came from; the caller unsorts and sums the copies with the router's weights.

Autodiff transposes each all-to-all into the other, so an expert's weight gradient on a
device holds every group member's tokens; it is then summed over `data` only (the
devices holding a copy of that expert: framework/parallel/data.py), while the dense
parameters' gradients are summed over `data` and `expert`.

The buffers: XLA:CPU has no `ragged_all_to_all`, so this exchange is a dense
`all_to_all` of worst-case buffers: every destination gets room for all N = T k copies
of the sender ([E, N, d] sent per device) and the padding is marked with the local
expert id E_total / E (no expert: `ragged_dot` leaves rows past its groups at zero and
their gradients at zero). That is E times the bytes a ragged exchange moves. On a GPU
or TPU the same steps would use `jax.lax.ragged_all_to_all` with the per-destination
counts exchanged first (sizes only, one small all-to-all), sending exactly the copies;
the sort, the grouped matmuls and the unsort stay as they are.

With a capacity factor (framework/model/moe.py's `capacity_experts`) the buffers are
static and exact: every device's [E_total, rows x C, d] slots go out as one all-to-all
(`exchange`: device j gets every sender's slots of its experts, [E_total / E, E x rows
x C, d]) and come back the same way (`exchange_back`); no ids travel (a slot's place
says its expert and sender).

`ExpertParallel()` (no axis) is one device holding every expert: `runs` is False and the
MoE layer groups its copies locally (framework/model/moe.py). The model receives this
object inside its TensorParallel (`tp.expert`), never a mesh.
"""

from __future__ import annotations

from dataclasses import dataclass

import jax
import jax.numpy as jnp


@dataclass(frozen=True)
class ExpertParallel:
    axis: str | None = None  # the mesh axis, inside a shard_map manual over it
    size: int = 1  # devices along it

    @property
    def runs(self) -> bool:
        return self.axis is not None and self.size > 1

    def local_experts(self, experts: int) -> int:
        return experts // self.size if self.runs else experts

    def dispatch(self, rows, ids, local: int):
        """rows [N, d] (token copies), ids [N] their global expert ids, `local` experts
        per device -> (received rows [E N, d], sender-major, their local expert ids [E N]
        (padding: `local`, no expert), and the state `combine` needs). Each sender's
        block arrives sorted by local expert, padding last. A ragged exchange (GPU/TPU)
        would send counts[j] rows to device j instead of the whole [N, d] block."""
        n, e = ids.shape[0], self.size
        order = jnp.argsort(ids, stable=True)
        sorted_ids = ids[order]
        dest = sorted_ids // local  # [N]: non-decreasing
        counts = jnp.zeros((e,), jnp.int32).at[dest].add(1)
        starts = jnp.cumsum(counts) - counts
        slot = jnp.arange(n) - starts[dest]  # place in its destination's buffer
        send = jnp.zeros((e, n) + rows.shape[1:], rows.dtype).at[dest, slot].set(rows[order])
        send_ids = jnp.full((e, n), local, jnp.int32).at[dest, slot].set(sorted_ids % local)
        recv = jax.lax.all_to_all(send, self.axis, 0, 0, tiled=True)
        recv_ids = jax.lax.all_to_all(send_ids, self.axis, 0, 0, tiled=True)
        return recv.reshape((e * n,) + rows.shape[1:]), recv_ids.reshape(-1), (order, dest, slot)

    def combine(self, out, state):
        """out [E N, f] (the experts' rows, as received) -> [N, f] in the caller's copy
        order (each copy's row, from the device that ran its expert)."""
        order, dest, slot = state
        e, n = self.size, order.shape[0]
        back = jax.lax.all_to_all(out.reshape((e, n) + out.shape[1:]), self.axis, 0, 0,
                                  tiled=True)
        mine = back[dest, slot]  # [N, f] in sorted order
        return jnp.zeros_like(mine).at[order].set(mine)

    def exchange(self, buf):
        """Capacity slots buf [E_total, n, d] -> this device's experts' slots from every
        group member [E_total / E, E n, d] (sender-major within each expert)."""
        e, local = self.size, buf.shape[0] // self.size
        got = jax.lax.all_to_all(buf.reshape((e, local) + buf.shape[1:]), self.axis, 0, 0,
                                 tiled=True)  # [E senders, local, n, d]
        return jnp.swapaxes(got, 0, 1).reshape((local, -1) + buf.shape[2:])

    def exchange_back(self, out):
        """`exchange`'s inverse: [E_total / E, E n, f] -> [E_total, n, f] on the senders."""
        e, local = self.size, out.shape[0]
        mine = jnp.swapaxes(out.reshape((local, e, -1) + out.shape[2:]), 0, 1)
        back = jax.lax.all_to_all(mine, self.axis, 0, 0, tiled=True)  # [E, local, n, f]
        return back.reshape((e * local,) + back.shape[2:])
