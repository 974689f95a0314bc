"""A one-layer causal LM small enough for exact gradient comparisons on CPU."""

from __future__ import annotations

import torch
from torch import nn


class ToyCausalLM(nn.Module):
    """Token and position embeddings, one single-head attention layer with a given mask, a head."""

    def __init__(self, vocab_size: int = 17, dim: int = 8, max_positions: int = 64, seed: int = 0):
        super().__init__()
        generator = torch.Generator().manual_seed(seed)
        self.embed = nn.Embedding(vocab_size, dim)
        self.position = nn.Embedding(max_positions, dim)
        self.qkv = nn.Linear(dim, 3 * dim)
        self.head = nn.Linear(dim, vocab_size)
        with torch.no_grad():
            for parameter in self.parameters():
                parameter.copy_(torch.randn(parameter.shape, generator=generator) * 0.5)
        self.double()

    def forward(
        self, input_ids: torch.Tensor, position_ids: torch.Tensor, attention_mask: torch.Tensor
    ) -> torch.Tensor:
        """input_ids, position_ids [B, T]; attention_mask [B, 1, T, T] bool -> logits [B, T, V]."""
        hidden = self.embed(input_ids) + self.position(position_ids)
        query, key, value = self.qkv(hidden).unsqueeze(1).chunk(3, dim=-1)
        attended = nn.functional.scaled_dot_product_attention(query, key, value, attn_mask=attention_mask)
        return self.head(hidden + attended.squeeze(1))


def padded_attention_mask(lengths: list[int], width: int) -> torch.Tensor:
    """[B, 1, width, width] causal mask for right-padded rows; padding slots attend to themselves."""
    masks = []
    for length in lengths:
        mask = torch.eye(width, dtype=torch.bool)
        mask[:length, :length] = torch.ones(length, length, dtype=torch.bool).tril()
        masks.append(mask)
    return torch.stack(masks)[:, None]


def gradients(model: nn.Module) -> dict[str, torch.Tensor]:
    """A copy of every parameter's gradient, then zeroes them for the next backward."""
    result = {name: p.grad.detach().clone() for name, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    return result
