"""A mixture of experts with a capacity factor (`model.moe.capacity_factor`; GShard,
Lepikhin et al. 2020; Switch Transformer, Fedus et al. 2021): the static slots of
framework/model/moe.py's layer (its module docstring says why a GPU wants them).

Each expert has C = ceil(c s k / E) slots per sequence of s tokens (`capacity`); a
sequence's token copies take their expert's slots in token order and those past C are
dropped (`slots`, `dropped_copies`). The layer (`capacity_experts`) scatters the kept
copies into a buffer [E, rows x C, d], runs the experts as batched einsums over it
(under expert parallelism after one all-to-all of it to the devices holding them,
framework/parallel/expert.py's `exchange`, and back), and gathers each copy's row.
Slots per sequence, not per device: every layout drops the copies one device drops.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from framework.config import ModelConfig
from framework.model.layers import gated
from framework.model.fp8_delayed import sent_in_e4m3
from framework.model.weight_ops import Fp8Use, sent_scale, weight_op


def capacity(cfg: ModelConfig, seq: int) -> int:
    """Slots per expert per sequence of `seq` tokens: ceil(c seq top_k / experts)."""
    m = cfg.moe
    return max(1, math.ceil(m.capacity_factor * seq * m.top_k / m.experts))


def slots(cfg: ModelConfig, ids, rows: int):
    """ids [rows s, k] (global expert ids, token-major) -> (each copy's slot [rows s, k]
    in its expert's buffer of rows x C, `rows` x C where it is dropped; C). A copy's
    place in its sequence: how many of the sequence's earlier copies went to its expert."""
    t, k = ids.shape
    c = capacity(cfg, t // rows)
    hot = jax.nn.one_hot(ids.reshape(rows, -1), cfg.moe.experts, dtype=jnp.int32)  # [b, s k, E]
    rank = jnp.sum((jnp.cumsum(hot, axis=1) - 1) * hot, axis=-1)  # [b, s k]
    slot = jnp.arange(rows, dtype=jnp.int32)[:, None] * c + rank
    return jnp.where(rank < c, slot, rows * c).reshape(t, k), c


def capacity_experts(module, cfg: ModelConfig, x, weights, ids, w_in, w_down, rows: int):
    """The experts with C slots each per sequence (module docstring): x [T, d] (`rows`
    sequences), weights/ids [T, k], w_in [E/P, d, 2, f@tensor], w_down [E/P, f@tensor, d]
    -> [T, d] (partial sums over `tensor`), dropped copies contributing zero."""
    t, k = ids.shape
    slot, c = slots(cfg, ids, rows)
    token = jnp.arange(t * k) // k  # copy i k + j is token i's j-th
    buf = jnp.zeros((cfg.moe.experts, rows * c, x.shape[-1]), x.dtype)
    buf = buf.at[ids.reshape(-1), slot.reshape(-1)].set(x[token], mode="drop")  # [E, b C, d]
    ep = module.tp.expert
    parts = ep.chunks if ep.runs and (rows * c) % ep.chunks == 0 else 1
    outs = [_slot_experts(module, cfg, part, w_in, w_down, i)
            for i, part in enumerate(jnp.split(buf, parts, axis=1))]
    out = outs[0] if parts == 1 else jnp.concatenate(outs, axis=1)  # [E, b C, d]
    got = out.at[ids.reshape(-1), slot.reshape(-1)].get(mode="fill", fill_value=0)
    return jnp.einsum("tkd,tk->td", got.reshape(t, k, -1), weights.astype(got.dtype))


def _slot_experts(module, cfg: ModelConfig, buf, w_in, w_down, part: int):
    """One part of the slots buf [E, n, d] through their experts (exchanged to and from
    the devices holding them under expert parallelism) -> [E, n, d]. Parts are
    independent (each slot row is its own), so the compiler can send one part while it
    multiplies another: the exchange hidden inside the layer (`ExpertParallel.chunks`).
    Each part's matmuls are weight ops of their own (names with `part` past 0). On
    the GPU compiler (Mixtral's recipe at 16 layers, 2026-11-29) 2 parts raised the
    overlapped share of the `expert` bytes from 50% to 59%, 4 parts to 61%: the first
    dispatch and the last combine of a layer have nothing of the layer to hide behind."""
    ep, tag = module.tp.expert, f"_{part}" if part else ""
    local, seen = _dispatched(module, ep, buf)  # [E/P, P n, d]: this device's experts
    # (current=False: under expert parallelism a device's slots mix the data replicas'
    # tokens, so a current FP8 scale of them would depend on the layout; every part's
    # op reads its matrix's FP8 state)
    gate_up = weight_op(module, "w_gate_up" + tag, "ecd,edgf->ecgf", local, w_in,
                        Fp8Use(current=False, matrix="w_gate_up", seen=seen))
    hidden = gated(cfg, gate_up)  # [E/P, P n, f]
    out = weight_op(module, "w_down" + tag, "ecf,efd->ecd", hidden, w_down,
                    Fp8Use(current=False, matrix="w_down"))  # [E/P, P n, d]
    return ep.exchange_back(out) if ep.runs else out  # [E, n, d]


def _dispatched(module, ep, buf):
    """buf [E, n, d] -> (this device's experts' slots [E/P, P n, d], the tensor their
    FP8 statistics are taken from: None where they are those slots). Under expert
    parallelism with delayed FP8 (`model.fp8_dispatch`) the slots travel as E4M3 at
    their matmul's delayed scale, which casts them there anyway (half of bfloat16's
    bytes, the same numbers: `fp8_delayed.sent_in_e4m3`); their exponents are counted
    on the sender's slots, before the cast. The way back stays in the compute dtype
    (no scale of the experts' outputs is known before them)."""
    if not ep.runs:
        return buf, None
    scale = sent_scale(module, "w_gate_up")
    if scale is None:
        return ep.exchange(buf), None
    return sent_in_e4m3(ep.exchange, ep.exchange_back, buf, scale), buf


def dropped_copies(cfg: ModelConfig, ids, rows: int):
    """The copies a capacity factor drops (float32 scalar; 0 when dropless)."""
    if cfg.moe.capacity_factor is None:
        return jnp.zeros((), jnp.float32)
    slot, c = slots(cfg, ids, rows)
    return jnp.sum(slot == rows * c).astype(jnp.float32)
