"""Document masks: packed sequences whose attention never crosses a document boundary.

A training row packs several documents end to end, each ending in the corpus's
end-of-document token (`tools/prepare_data.py --eos-id`). With `data.document_mask`
every token attends only to the earlier tokens of its own document, as if each
document had been run alone; with `data.reset_positions` its RoPE positions also count
from its document's first token (RoPE scores depend only on the distance between two
positions, Su et al. 2021, so this changes the numbers only by rounding; it is there
for models whose positions are absolute, and for exactness against a one-by-one run).

Segment ids are computed on the device from the input ids themselves, so nothing
travels beside the tokens: token t belongs to segment s[t] = the number of separators
among tokens 0..t-1 (the separator ends its document: it belongs to the document
before it). The kernels (framework/model/attention.py, ring_attention.py) read the
segment ids of their queries and keys; a key is visible iff it is causal and in the
query's segment.

Shapes: `Documents.segment` [batch, n] int32 over the whole sequence (n = train.seq_len,
also under context parallelism: the ring slices it by chunk), `Documents.position`
[batch, n_local] int32, this device's tokens' positions (None: the sequence's own).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple, Optional

import jax
import jax.numpy as jnp


@dataclass(frozen=True)
class DocumentMask:
    """What a run masks by (static, part of the step's configuration)."""

    separator: int  # the end-of-document token id
    reset_positions: bool = False  # RoPE positions restart at every document


class Documents(NamedTuple):
    """Per-row document layout, as the model's attention reads it."""

    segment: jax.Array  # [b, n] int32, the whole sequence's segment ids
    position: Optional[jax.Array] = None  # [b, n_local] int32 RoPE positions, or None


def segment_ids(ids, separator: int):
    """[b, n] token ids -> [b, n] int32: the separators strictly before each token."""
    ends = (ids == separator).astype(jnp.int32)
    return jnp.cumsum(ends, axis=-1) - ends


def positions_in_document(segment):
    """[b, n] segment ids -> [b, n] int32: each token's index within its document
    (index - the index of its document's first token, by a running maximum)."""
    n = segment.shape[-1]
    index = jnp.broadcast_to(jnp.arange(n, dtype=jnp.int32), segment.shape)
    starts = jnp.concatenate([jnp.ones_like(segment[..., :1], bool),
                              segment[..., 1:] != segment[..., :-1]], axis=-1)
    first = jax.lax.cummax(jnp.where(starts, index, 0), axis=segment.ndim - 1)
    return index - first


def documents_of(ids, mask: DocumentMask | None, split=lambda x: x) -> Documents | None:
    """The Documents of a batch of input ids [..., n] (None without a mask); `split`
    takes positions to this device's tokens (context parallelism's chunks)."""
    if mask is None:
        return None
    segment = segment_ids(ids, mask.separator)
    position = split(positions_in_document(segment)) if mask.reset_positions else None
    return Documents(segment, position)


def visible(seg_q, seg_k):
    """[b, sq], [b, sk] segment ids -> [b, sq, sk] bool: same document."""
    return seg_q[:, :, None] == seg_k[:, None, :]
