"""Attention for packed micro-batches, chosen per batch and per device, a dense mask only where needed.

A packed micro-batch keeps its sequences apart in one of three ways (trainer.model.packed_logprobs):
- one sequence a row, plain causal (PackedBatch.shares_rows false): no mask and no position ids,
  sdpa's causal kernel;
- several sequences a row, plain causal: the sequences' boundaries over the flattened rows
  (`cu_seq_lens`, PackedBatch.sequence_bounds) and variable-length attention: on CUDA in bf16/fp16
  torch's flash kernel (`torch.nn.attention.varlen.varlen_attn`), elsewhere sdpa's causal kernel
  over the sequences of alike lengths gathered into a padded batch (`bucketed`). Neither builds a
  mask, and no query looks at a key of another sequence or after it;
- a hook (sliding window, ...) or a shared prompt changes some sequence's block
  (PackedBatch.needs_mask): the block-diagonal boolean mask [rows, 1, L, L], through sdpa.

`load_policy` loads models with attn_implementation=NAME, this module's function, which takes the
mask (or none) to sdpa as transformers' own sdpa does, and the boundaries, which transformers passes
down from the model's call as it does for its flash kernels, to variable-length attention.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

NAME = "clotho_packed"


def varlen_available(query: torch.Tensor) -> bool:
    """Whether the flash variable-length kernel runs `query`: CUDA, half precision."""
    return query.is_cuda and query.dtype in (torch.bfloat16, torch.float16)


BUCKET_RATIO = 1.25  # a bucket's sequences are at least its longest / this long: bounded padding


def buckets(lengths: list[int]) -> list[list[int]]:
    """Indices of `lengths`, longest first, in runs whose shortest is at least their longest /
    BUCKET_RATIO: each run is one padded batch for attention."""
    order = sorted(range(len(lengths)), key=lambda index: -lengths[index])
    runs: list[list[int]] = []
    for index in order:
        if runs and lengths[index] * BUCKET_RATIO >= lengths[runs[-1][0]]:
            runs[-1].append(index)
        else:
            runs.append([index])
    return runs


def bucketed(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, bounds: list[int], scaling: float | None
) -> torch.Tensor:
    """Causal attention of each [start, end) of `bounds` on its own, [T, H, D] in and out, without
    the flash kernel: the sequences of alike lengths (buckets) gathered into one padded batch each,
    sdpa's causal kernel over it (a sequence's padding comes after it, so it never attends to it),
    and the outputs put back. A few sdpa calls, not one a sequence (each costs a fixed overhead, which
    many short sequences would pay over and over) nor a dense mask over whole rows."""
    starts, lengths = bounds[:-1], [end - start for start, end in zip(bounds, bounds[1:])]
    total = query.shape[0]
    padded = [torch.cat([t, t.new_zeros(1, *t.shape[1:])]) for t in (query, key, value)]  # row `total`: padding
    pieces, places = [], []
    for run in buckets(lengths):
        offsets = torch.arange(lengths[run[0]])
        begin = torch.tensor([starts[index] for index in run])[:, None]
        valid = offsets[None, :] < torch.tensor([lengths[index] for index in run])[:, None]
        index = torch.where(valid, begin + offsets, total).to(query.device)
        q, k, v = (t[index].transpose(1, 2) for t in padded)
        attended = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scaling, enable_gqa=True).transpose(
            1, 2
        )
        valid = valid.to(query.device)
        pieces.append(attended[valid])
        places.append(index[valid])
    # Every slot is in exactly one segment (a row's padding is one too): the pieces, in bucket
    # order, are a permutation of the slots, put back with one gather.
    order = torch.cat(places)
    inverse = torch.empty_like(order)
    inverse[order] = torch.arange(total, device=order.device)
    return torch.cat(pieces)[inverse]


def varlen(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    cu_seq_lens: torch.Tensor,
    max_length: int,
    scaling: float | None,
) -> torch.Tensor:
    """Causal attention within each sequence of flattened [T, H, D] tensors, `cu_seq_lens` [n + 1]
    their boundaries: the flash kernel where it runs, else sdpa over buckets of alike lengths."""
    if varlen_available(query):
        from torch.nn.attention.varlen import varlen_attn

        bounds = cu_seq_lens.to(device=query.device, dtype=torch.int32)
        return varlen_attn(  # type: ignore[return-value]  # returns (output, lse) only when asked for the lse
            query,
            key,
            value,
            bounds,
            bounds,
            max_length,
            max_length,
            scale=scaling,
            window_size=(-1, 0),
            enable_gqa=True,
        )
    return bucketed(query, key, value, cu_seq_lens.tolist(), scaling)


def packed_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """transformers' attention interface: query [rows, heads, L, dim], key and value [rows, kv heads,
    L, dim]; returns [rows, L, heads, dim]. With `cu_seq_lens_q` (the sequences' boundaries over the
    rows flattened), variable-length causal attention; else sdpa with `attention_mask` (None: causal)."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    bounds = kwargs.pop("cu_seq_lens_q", None)
    if bounds is None:
        return sdpa_attention_forward(
            module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs
        )
    if dropout:
        raise ValueError(
            "packed attention over sequence boundaries runs without dropout (the trainer's model is in eval mode)"
        )
    rows, heads, length, dim = query.shape
    flat_query, flat_key, flat_value = (
        t.transpose(1, 2).reshape(rows * length, t.shape[1], dim) for t in (query, key, value)
    )
    output = varlen(flat_query, flat_key, flat_value, bounds, int(kwargs["max_length_q"]), scaling)
    return output.reshape(rows, length, heads, dim), None


def register() -> None:
    """Make NAME an attn_implementation transformers' models accept."""
    from transformers import AttentionInterface

    AttentionInterface.register(NAME, packed_attention)
