"""On a GPU: cuDNN's pieces of ring attention (framework/model/fused_pieces.py, CUDNN)
against their plain-JAX reference (REFERENCE), the check the CPU tests cannot make
(they run the ring with REFERENCE in cuDNN's place). For a diagonal (causal) and a
full piece in bfloat16: the forward's output and log-sum-exp, and the backward's
gradients handed the *whole* attention's output and log-sum-exp (a ring's: this piece
merged with a second one over other keys). Prints the worst error of each, relative
to the reference's largest value; exits 1 above `--tolerance`.

    python tools/fused_pieces_check.py [--tolerance 0.03]
"""

from __future__ import annotations

import argparse
import sys

import jax
import jax.numpy as jnp

from framework.model.fused_pieces import CUDNN, REFERENCE

B, T, G, R, HD = 2, 512, 2, 4, 128  # [b, t, g r, hd] queries; keys [b, t, g, hd]


def _inputs():
    keys = jax.random.split(jax.random.key(0), 6)
    q = jax.random.normal(keys[0], (B, T, G * R, HD), jnp.bfloat16)
    k, v, k2, v2 = (jax.random.normal(x, (B, T, G, HD), jnp.bfloat16) for x in keys[1:5])
    d_out = jax.random.normal(keys[5], (B, T, G * R, HD), jnp.bfloat16)
    return q, k, v, k2, v2, d_out


def _worst(got, want) -> float:
    got, want = (jnp.asarray(x, jnp.float32) for x in (got, want))
    return float(jnp.max(jnp.abs(got - want)) / jnp.maximum(jnp.max(jnp.abs(want)), 1e-6))


def check(causal: bool, kernel=CUDNN) -> dict[str, float]:
    """Worst relative errors of `kernel`'s piece against the reference's, both handed
    the same whole attention (the reference's piece merged with a second one)."""
    q, k, v, k2, v2, d_out = _inputs()
    scale = HD ** -0.5
    forward = lambda kern: jax.jit(kern.forward, static_argnums=(3, 4))(q, k, v, causal, scale)
    (out, lse), (ref_out, ref_lse) = forward(kernel), forward(REFERENCE)
    # the whole attention of these queries: the piece merged with one over other keys
    out2, lse2 = REFERENCE.forward(q, k2, v2, False, scale)
    whole_lse = jnp.logaddexp(ref_lse, lse2)  # [b, n, t]
    weight = lambda x: jnp.exp(x - whole_lse).transpose(0, 2, 1)[..., None]
    whole = (ref_out.astype(jnp.float32) * weight(ref_lse)
             + out2.astype(jnp.float32) * weight(lse2)).astype(q.dtype)
    backward = lambda kern: jax.jit(kern.backward, static_argnums=(6, 7))(
        q, k, v, whole, whole_lse, d_out, causal, scale)
    got = (out, lse) + tuple(backward(kernel))
    want = (ref_out, ref_lse) + tuple(backward(REFERENCE))
    return {name: _worst(a, b) for name, a, b in zip(("out", "lse", "dq", "dk", "dv"),
                                                      got, want)}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tolerance", type=float, default=0.03)
    parser.add_argument("--self-test", action="store_true",
                        help="the reference against itself (runs anywhere)")
    args = parser.parse_args(argv)
    kernel = REFERENCE if args.self_test else CUDNN
    if jax.default_backend() != "gpu" and not args.self_test:
        print("fused_pieces_check: needs an NVIDIA GPU (cuDNN); this is "
              f"{jax.default_backend()}")
        return 2
    worst = 0.0
    for causal in (True, False):
        errors = check(causal, kernel)
        worst = max(worst, *errors.values())
        print(f"{'causal' if causal else 'full'} piece, worst error relative to the "
              f"reference's largest: " + ", ".join(f"{k} {v:.2e}" for k, v in errors.items()))
    print(f"fused_pieces_check: {'ok' if worst <= args.tolerance else 'FAILED'} "
          f"(worst {worst:.2e}, tolerance {args.tolerance})")
    return 0 if worst <= args.tolerance else 1


if __name__ == "__main__":
    sys.exit(main())
