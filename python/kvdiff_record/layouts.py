"""Undo the layouts runtimes keep their tensors in, into the dump's rows:
[positions, heads*D], head-major, q/k in Hugging Face's rotate-half RoPE
layout, head_dim unpadded, rows by absolute position."""

import numpy as np

from .recorder import RecorderError, to_float32_rows


def heads_first(x):
    """[heads, T, D] (or [1, heads, T, D], a batch of one) -> [T, heads*D].
    The KV cache layout of PyTorch/transformers, JAX and CoreML ports."""
    a = to_float32_rows(x, "heads_first")
    if a.ndim == 4:
        if a.shape[0] != 1:
            raise RecorderError(f"heads_first: batch of {a.shape[0]}; record one sequence "
                                f"(index the batch first)")
        a = a[0]
    if a.ndim != 3:
        raise RecorderError(f"heads_first: expected [heads, T, D], got shape {a.shape}")
    h, t, d = a.shape
    return np.ascontiguousarray(a.transpose(1, 0, 2).reshape(t, h * d))


def from_interleaved_rope(rows, head_dim):
    """q or k rows [T, heads*D] whose RoPE pairs are interleaved (element
    2m and 2m+1 of a head rotate together: GPT-J, llama.cpp's Llama, many
    JAX ports) -> the rotate-half layout of Hugging Face (pair m is m and
    m + D/2), which the dump records: index 2m+s goes to s*D/2 + m."""
    a = to_float32_rows(rows, "from_interleaved_rope")
    a = a.reshape(1, -1) if a.ndim == 1 else a
    if head_dim % 2 or a.ndim != 2 or a.shape[1] % head_dim:
        raise RecorderError(f"from_interleaved_rope: rows of shape {a.shape} are not heads of "
                            f"an even head_dim {head_dim}")
    t, w = a.shape
    h = w // head_dim
    return np.ascontiguousarray(
        a.reshape(t, h, head_dim // 2, 2).transpose(0, 1, 3, 2).reshape(t, w))


def unpad_head_dim(rows, heads, head_dim):
    """Rows [T, heads*P] whose heads were padded to P >= head_dim (a kernel
    that wants 128-wide heads) -> [T, heads*head_dim], each head's first
    head_dim values. A [heads, T, P] array: pass heads_first(x) first."""
    a = to_float32_rows(rows, "unpad_head_dim")
    a = a.reshape(1, -1) if a.ndim == 1 else a
    if a.ndim != 2 or a.shape[1] % heads:
        raise RecorderError(f"unpad_head_dim: rows of shape {a.shape} are not {heads} heads")
    padded = a.shape[1] // heads
    if padded < head_dim:
        raise RecorderError(f"unpad_head_dim: heads are {padded} wide, less than head_dim "
                            f"{head_dim}")
    return np.ascontiguousarray(a.reshape(a.shape[0], heads, padded)[:, :, :head_dim]
                                .reshape(a.shape[0], heads * head_dim))


def ring_rows(slots, slot_positions, since=0):
    """A ring (or any slot-addressed) cache read back: slots [S, width] (or
    [heads, S, D], converted with heads_first) and slot_positions [S], the
    absolute position each slot holds (-1: empty). Returns a list of
    (first_position, rows) runs of consecutive positions, ascending, of the
    slots holding positions >= since (the positions not recorded yet), for
    Recorder.rows. Raises RecorderError when two slots claim one position."""
    a = to_float32_rows(slots, "ring_rows")
    if a.ndim in (3, 4):
        a = heads_first(a)
    pos = np.asarray(slot_positions).astype(np.int64).reshape(-1)
    if a.ndim != 2 or a.shape[0] != pos.size:
        raise RecorderError(f"ring_rows: {pos.size} slot positions for slots of shape "
                            f"{a.shape}")
    keep = np.nonzero(pos >= max(since, 0))[0]
    keep = keep[np.argsort(pos[keep], kind="stable")]
    p = pos[keep]
    dup = p[1:][p[1:] == p[:-1]]
    if dup.size:
        raise RecorderError(f"ring_rows: two slots hold position {int(dup[0])}")
    runs = []
    start = 0
    for i in range(1, p.size + 1):
        if i == p.size or p[i] != p[i - 1] + 1:
            runs.append((int(p[start]), a[keep[start:i]]))
            start = i
    return runs
