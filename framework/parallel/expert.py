"""Expert parallelism (`parallel.expert=E`): each MoE layer's E_total experts sharded over
the `expert` mesh axis, E_total / E per device, and every token copy sent to the device
that holds its expert and back.

The `expert` axis is carved out of the data devices (framework/parallel/mesh.py): each
device of an expert group holds different rows of the batch (the dense layers see
`expert` as one more data axis) and different experts. A MoE layer then, on each device:

  1. sorts its token copies (a token once per chosen expert) by expert id, so that the
     copies for device j = id // (E_total / E) form one run, the j-th;
  2. `dispatch`: an all-to-all over `expert` (ragged or dense, below), device j
     receiving every group member's run for it;
  3. runs its own experts on what it received, grouped (`jax.lax.ragged_dot` over the
     received rows sorted by local expert);
  4. `combine`: the all-to-all back, each output row to the device and place its token
     copy came from; the caller unsorts and sums the copies with the router's weights.

Autodiff transposes each all-to-all into the other, so an expert's weight gradient on a
device holds every group member's tokens; it is then summed over `data` only (the
devices holding a copy of that expert: framework/parallel/data.py), while the dense
parameters' gradients are summed over `data` and `expert`.

The exchange (`parallel.expert_exchange`, resolved for the mesh's platform by
`exchange_for`):
  ragged    (TPU, NVIDIA GPU: their compilers have `ragged_all_to_all`) every device
            all-gathers the group's copies per expert [E, E_total] (int32, small), from
            which each knows every offset (`ragged_sends`); `jax.lax.ragged_all_to_all`
            then sends exactly the copies, into a receive buffer of the worst case, E N
            rows (all N = T k copies of every group member could pick this device's
            experts), written sender-major. The local expert ids are not sent: the
            receiver recomputes them from the counts (`received_ids`). `combine` is the
            same exchange with the counts matrix transposed; autodiff transposes each
            (JAX's transpose rule: the reverse exchange).
  emulated  the ragged exchange's bookkeeping through a dense all_to_all
            (`emulated_ragged_all_to_all`: every slice padded to a static bound), where
            the compiler lacks the op (XLA:CPU): what the tests run.
  dense     worst-case buffers (CPU's default): every destination gets room for all N
            copies of the sender ([E, N, d] sent per device, E times the ragged
            exchange's bytes) and the padding is marked with the local expert id
            E_total / E (no expert: `ragged_dot` leaves rows past its groups at zero
            and their gradients at zero); the ids travel beside ([E, N] int32).
The sort, the grouped matmuls and the unsort are the same for all three.

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

from framework.parallel import vma
from framework.parallel.mesh import EXPERT


EXCHANGES = ("auto", "dense", "ragged", "emulated")  # parallel.expert_exchange


def expert_parallel(degree: int, exchange: str, chunks: int = 1) -> "ExpertParallel":
    """The plan of `parallel.expert=degree` with the resolved `exchange` (`exchange_for`)
    and `parallel.expert_chunks`: the experts over the `expert` mesh axis, or none split
    at degree 1."""
    return ExpertParallel(EXPERT, degree, exchange, chunks) if degree > 1 else ExpertParallel()


@dataclass(frozen=True)
class ExpertParallel:
    axis: str | None = None  # the mesh axis, inside a shard_map manual over it
    size: int = 1  # devices along it
    dropless: str = "dense"  # its exchange: dense | ragged | emulated (`exchange_for`)
    # parts a capacity layer's slots are exchanged and multiplied in, so that one part's
    # all-to-all runs beside another's matmuls (framework/model/moe.py `_slot_experts`)
    chunks: int = 1  # parallel.expert_chunks

    def __post_init__(self):
        assert self.dropless in EXCHANGES[1:], f"unresolved exchange {self.dropless!r}"

    @property
    def runs(self) -> bool:
        return self.axis is not None and self.size > 1

    def local_experts(self, experts: int) -> int:
        return experts // self.size if self.runs else experts

    def dispatch(self, rows, ids, local: int):
        """rows [N, d] (token copies), ids [N] their global expert ids, `local` experts
        per device -> (received rows [E N, d], sender-major, their local expert ids [E N]
        (padding: `local`, no expert), and the state `combine` needs). Each sender's
        block arrives sorted by local expert; the dense exchange pads each sender's
        block to N rows, the ragged one packs them and pads the buffer's end."""
        if self.dropless == "dense":
            return self._dispatch_dense(rows, ids, local)
        return self._dispatch_ragged(rows, ids, local)

    def combine(self, out, state):
        """out [E N, f] (the experts' rows, as received) -> [N, f] in the caller's copy
        order (each copy's row, from the device that ran its expert)."""
        if self.dropless == "dense":
            return self._combine_dense(out, state)
        return self._combine_ragged(out, state)

    def _dispatch_dense(self, rows, ids, local: int):
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

    def _combine_dense(self, out, state):
        order, dest, slot = state
        e, n = self.size, order.shape[0]
        back = jax.lax.all_to_all(out.reshape((e, n) + out.shape[1:]), self.axis, 0, 0,
                                  tiled=True)
        mine = back[dest, slot]  # [N, f] in sorted order
        return jnp.zeros_like(mine).at[order].set(mine)

    def _dispatch_ragged(self, rows, ids, local: int):
        n, e = ids.shape[0], self.size
        order = jnp.argsort(ids, stable=True)  # copies by expert, so by destination
        per_expert = jnp.zeros((e * local,), jnp.int32).at[ids].add(1)  # [E_total]
        counts = jax.lax.all_gather(per_expert, self.axis)  # [E senders, E_total]
        matrix = counts.reshape(e, e, local).sum(-1)  # [E senders, E receivers]
        me = jax.lax.axis_index(self.axis)
        buf = _zeros_like_rows(rows, e * n)  # [E N, d]: the worst case
        got = self._ragged(rows[order], buf, ragged_sends(matrix, me), n)
        return got, received_ids(counts, me, local, e * n), (order, matrix)

    def _combine_ragged(self, out, state):
        order, matrix = state
        n, me = order.shape[0], jax.lax.axis_index(self.axis)
        back = self._ragged(out, _zeros_like_rows(out, n), ragged_sends(matrix.T, me), n)
        return jnp.zeros_like(back).at[order].set(back)  # [N, f] from the sorted order

    def _ragged(self, operand, output, sends, bound: int):
        """One ragged exchange over the axis; `bound`: no slice has more rows (the
        emulation's static padding)."""
        if self.dropless == "ragged":
            return jax.lax.ragged_all_to_all(operand, output, *sends, axis_name=self.axis)
        return emulated_ragged_all_to_all(operand, output, *sends, axis_name=self.axis,
                                          slice_rows=bound)

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


def ragged_sends(matrix, me):
    """matrix [E, E] int32 (copies from sender i to receiver j), this device's index me
    -> `jax.lax.ragged_all_to_all`'s (input_offsets, send_sizes, output_offsets,
    recv_sizes), [E] each, for an operand sorted by destination (my run for j starts at
    sum_{j' < j} matrix[me, j']) and receive buffers written sender-major (mine starts
    at sum_{i < me} matrix[i, j] in j's). With matrix.T: the exchange back."""
    send = matrix[me]  # [E]
    before = jnp.cumsum(matrix, axis=0) - matrix  # [E, E]: senders ahead of i, for j
    return jnp.cumsum(send) - send, send, before[me], matrix[:, me]


def received_ids(counts, me, local: int, rows: int):
    """counts [E, E_total] (every sender's copies per global expert), this device's
    index -> the local expert id of each row of its receive buffer [rows] (sender-major,
    each sender's rows sorted by expert; past them: `local`, no expert)."""
    runs = jax.lax.dynamic_slice_in_dim(counts, me * local, local, axis=1).reshape(-1)
    ends = jnp.cumsum(runs)  # [E local]: (sender, local expert) runs, sender-major
    run = jnp.searchsorted(ends, jnp.arange(rows, dtype=ends.dtype), side="right")
    return jnp.where(run < runs.shape[0], run % local, local).astype(jnp.int32)


def emulated_ragged_all_to_all(operand, output, input_offsets, send_sizes, output_offsets,
                               recv_sizes, *, axis_name, slice_rows: int | None = None):
    """`jax.lax.ragged_all_to_all` (same arguments and result) from a dense all_to_all,
    for compilers without it (XLA:CPU): slice k of operand [M, ...] (rows input_offsets[k]
    + [0, send_sizes[k])) goes, zero-padded to `slice_rows` (default M) rows, to device
    k // (K / E); there its rows land at the sender's output_offsets[k] + [0,
    recv_sizes[k']) of `output`. K slices x slice_rows rows travel (the bytes of a dense
    exchange)."""
    bound = operand.shape[0] if slice_rows is None else slice_rows
    r = jnp.arange(bound)
    src = input_offsets[:, None] + r  # [K, bound]
    block = operand.at[src].get(mode="fill", fill_value=0)  # [K, bound, ...]
    sent = (r < send_sizes[:, None]).reshape(src.shape + (1,) * (operand.ndim - 1))
    block = jnp.where(sent, block, jnp.zeros((), operand.dtype))
    got = jax.lax.all_to_all(block, axis_name, 0, 0, tiled=True)  # slice k from k // (K/E)
    starts = jax.lax.all_to_all(output_offsets, axis_name, 0, 0, tiled=True)  # [K]
    dst = jnp.where(r < recv_sizes[:, None], starts[:, None] + r, output.shape[0])
    return output.at[dst].set(got.astype(output.dtype), mode="drop")  # past the end: dropped


def _zeros_like_rows(x, rows: int):
    """Zeros [rows, ...] of x's trailing shape and dtype, varying over the mesh axes x
    does (a ragged exchange's output buffer is typed as its result)."""
    return vma.like(jnp.zeros((rows,) + x.shape[1:], x.dtype), x)
