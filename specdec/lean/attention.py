"""Attention for the lean runtime: one kernel per array module and device, one function per cache layout.

A kernel attends queries [..., kv_heads, groups, rows, dim] (the G query heads sharing a key/value
head side by side, so keys and values are never repeated) over keys/values [..., kv_heads, S, dim],
and builds the causal mask it consumes (``causal``):

- ``SdpaKernel``: torch's SDPA with the groups folded into the query length; its kernels (flash on
  CPU, memory-efficient on CUDA) never hold the scores, but the bool mask is [G x rows, S];
- ``WrittenKernel``: torch, softmax written out (torch's CPU SDPA with a mask costs far more than
  the products around it at a few query rows): the static passes on CPU;
- ``NumpyKernel``: numpy, an additive -inf bias [rows, S]: the numpy pass.

A cache layout writes a pass's new keys/values where it keeps them and attends over them:

- ``attend_session``: one session's ``LeanKV`` buffers (views, no copy); a long prefill attends
  in blocks of query rows (``query_block_rows``), each with its own mask, so memory stays linear
  in its length;
- ``attend_ragged``: several sessions' keys/values concatenated, a block mask keeping them apart;
- ``attend_slots``: a ``SlotPool``'s [slots, kv_heads, S, dim] rows of fixed shape (capturable).
"""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F

SCORE_BYTES = 64 << 20  # one attention block's scores (all heads) stay under this, however long the pass


def query_block_rows(heads: int, keys: int, entry_bytes: int = 4) -> int:
    """Query rows per attention block: ``heads`` x rows x ``keys`` entries of ``entry_bytes`` each
    within ``SCORE_BYTES`` (one row at least)."""
    return max(1, SCORE_BYTES // (heads * keys * entry_bytes))


class SdpaKernel:
    """torch SDPA; masks bool [G x rows, S] (True: attend), rows ordered (group, token)."""

    def __init__(self, groups: int, scale: float, device: torch.device) -> None:
        self.groups, self.scale, self.device = groups, scale, device
        self.entry_bytes = 1  # per mask entry (plus the query dtype's, as SDPA's float bias)

    def causal(self, past: int, first: int, end: int) -> torch.Tensor | None:
        """Fed rows first .. end - 1 of one session, row t seeing positions up to past + t; None for
        one row, which sees them all."""
        if end - first == 1:
            return None
        mask = torch.ones((end - first, past + end), dtype=torch.bool, device=self.device).tril(past + first)
        return mask.repeat(self.groups, 1) if self.groups > 1 else mask

    def __call__(self, query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask) -> torch.Tensor:
        *lead, kv_heads, groups, rows, dim = query.shape
        folded = query.reshape(*lead, kv_heads, groups * rows, dim)
        if not lead:  # SDPA's fused kernels want a batch dimension
            out = F.scaled_dot_product_attention(folded[None], keys[None], values[None], attn_mask=mask,
                                                 scale=self.scale)[0]
        else:
            out = F.scaled_dot_product_attention(folded, keys, values, attn_mask=mask, scale=self.scale)
        return out.view(query.shape)


class WrittenKernel(SdpaKernel):
    """SDPA's math written out in torch (bool masks as ``SdpaKernel``'s; a mask is required)."""

    def __call__(self, query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask) -> torch.Tensor:
        *lead, kv_heads, groups, rows, dim = query.shape
        folded = query.reshape(*lead, kv_heads, groups * rows, dim)
        scores = torch.matmul(folded, keys.transpose(-1, -2)).mul_(self.scale).masked_fill_(~mask, -torch.inf)
        return torch.matmul(torch.softmax(scores, dim=-1), values).view(query.shape)


class NumpyKernel:
    """numpy softmax attention; masks are additive fp32 biases [rows, S] (-inf: masked)."""

    entry_bytes = 4  # per score entry

    def __init__(self, scale: float) -> None:
        self.scale = np.float32(scale)

    @staticmethod
    def causal(past: int, first: int, end: int) -> np.ndarray | None:
        if end - first == 1:
            return None
        return np.triu(np.full((end - first, past + end), -np.inf, dtype=np.float32), past + first + 1)

    def __call__(self, query: np.ndarray, keys: np.ndarray, values: np.ndarray, bias) -> np.ndarray:
        # The scale goes on the queries and the softmax's division on the output: [rows, dim] per
        # head each instead of [rows, keys] (as flash attention does).
        scores = np.matmul(query * self.scale, keys[:, None].swapaxes(-1, -2))
        if bias is not None:
            scores += bias
        scores -= scores.max(axis=-1, keepdims=True)
        np.exp(scores, out=scores)
        out = np.matmul(scores, values[:, None])
        out /= scores.sum(axis=-1, keepdims=True)
        return out


def _rows_first(out, xp, rows: int):
    """[kv_heads, groups, rows, dim] -> [rows, heads x dim] (head j x G + g is (j, g))."""
    return xp.permute(out, (2, 0, 1, 3)).reshape(rows, -1)


def attend_session(q_and_k, v, keys, values, past: int, heads: int, kernel, xp, block: int, mask):
    """One session: write the new keys/values ([rows, kv_heads, dim]) into its buffers ``keys``/``values``
    [kv_heads, capacity, dim] at ``past``, attend over its prefix; rows of ``block`` at a time
    (``mask``: the one-block pass's ``kernel.causal(past, 0, rows)``). Returns [rows, heads x dim]."""
    rows, kv_heads, dim = v.shape
    total = past + rows
    keys[:, past:total] = q_and_k[:, heads:].swapaxes(0, 1)
    values[:, past:total] = v.swapaxes(0, 1)
    query = xp.permute(q_and_k[:, :heads].reshape(rows, kv_heads, heads // kv_heads, dim), (1, 2, 0, 3))
    if block >= rows:
        return _rows_first(kernel(query, keys[:, :total], values[:, :total], mask), xp, rows)
    # A block's rows see no position past its last row's.
    return xp.cat([_rows_first(kernel(query[:, :, first:end], keys[:, : past + end], values[:, : past + end],
                                      kernel.causal(past, first, end)), xp, end - first)
                   for first, end in ((f, min(f + block, rows)) for f in range(0, rows, block))], 0)


def ragged_mask(pasts, fed, starts, groups: int, device) -> torch.Tensor:
    """Bool [G x T, sum(pasts) + T] for ``attend_ragged``: each row sees its own session's prefix and
    its own fed rows up to itself."""
    total = sum(fed)
    mask = torch.zeros((total, sum(pasts) + total), dtype=torch.bool, device=device)
    column = 0
    for p, n, start in zip(pasts, fed, starts):
        mask[start : start + n, column : column + p + n] = torch.ones((n, p + n), dtype=torch.bool, device=device).tril(p)
        column += p + n
    return mask.repeat(groups, 1) if groups > 1 else mask


def attend_ragged(q_and_k, v, kvs, index: int, pasts, fed, starts, heads: int, kernel, mask):
    """Several sessions' rows packed one after another (session i's at ``starts[i]``): each writes its
    keys/values into layer ``index`` of its ``LeanKV``; their prefixes are concatenated and ``mask``
    (``ragged_mask``) keeps them apart. Returns [rows, heads x dim]."""
    rows, kv_heads, dim = v.shape
    k = q_and_k[:, heads:]
    keys, values = [], []
    for kv, p, n, start in zip(kvs, pasts, fed, starts):
        kv.keys[index, :, p : p + n] = k[start : start + n].transpose(0, 1)
        kv.values[index, :, p : p + n] = v[start : start + n].transpose(0, 1)
        keys.append(kv.keys[index, :, : p + n])
        values.append(kv.values[index, :, : p + n])
    query = q_and_k[:, :heads].reshape(rows, kv_heads, heads // kv_heads, dim).permute(1, 2, 0, 3)
    out = kernel(query, torch.cat(keys, dim=1), torch.cat(values, dim=1), mask)
    return out.permute(2, 0, 1, 3).reshape(rows, -1)


def slot_mask(positions: torch.Tensor, slot_tokens: int, groups: int) -> torch.Tensor:
    """Bool [B, 1, G x T, slot_tokens] for ``attend_slots``: row (b, t) sees keys 0..positions[b, t]
    of its own slot, rows ordered (group, token) as the kernels fold them."""
    sessions, tokens = positions.shape
    mask = torch.arange(slot_tokens, device=positions.device)[None, None, :] <= positions[:, :, None]
    return mask[:, None, None].expand(sessions, 1, groups, tokens, slot_tokens).reshape(sessions, 1, groups * tokens, -1)


def attend_slots(q_and_k, v, keys, values, slots, positions, slot_rows, heads: int, kernel, mask):
    """Static shapes: rows [B x T] of sessions in slots ``slots`` [B] of a pool layer's ``keys``/``values``
    [slots, kv_heads, S, dim], each row at ``positions`` [B, T] (``slot_rows``: [B, T] slot of each
    row); only fixed-shape ops on fixed tensors. Returns [B x T, heads x dim]."""
    sessions, tokens = positions.shape
    rows, kv_heads, dim = v.shape
    keys[slot_rows, :, positions] = q_and_k[:, heads:].view(sessions, tokens, kv_heads, dim)
    values[slot_rows, :, positions] = v.view(sessions, tokens, kv_heads, dim)
    query = q_and_k[:, :heads].reshape(sessions, tokens, kv_heads, heads // kv_heads, dim).permute(0, 2, 3, 1, 4)
    out = kernel(query, keys.index_select(0, slots), values.index_select(0, slots), mask)
    return out.permute(0, 3, 1, 2, 4).reshape(rows, -1)
