"""A small pre-norm Transformer encoder classifier: the attention workload.

Attention is written with explicit q/k/v/out projections and
``F.scaled_dot_product_attention`` (not ``nn.MultiheadAttention``) so the
exported graph shows linear, sdpa and layer_norm nodes the autocast rules act
on individually. Inputs are int64 token ids, which calibration must keep as
integers.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from harness.models import ModelSpec, register, seeded_init

SEED = 3000
VOCAB = 1000
MAX_LEN = 64
D_MODEL = 128
HEADS = 4
LAYERS = 2
BATCH = 8


class SelfAttention(nn.Module):
    def __init__(self, d_model: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.q = nn.Linear(d_model, d_model)
        self.k = nn.Linear(d_model, d_model)
        self.v = nn.Linear(d_model, d_model)
        self.out = nn.Linear(d_model, d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, seq, d_model = x.shape

        def split(t: torch.Tensor) -> torch.Tensor:
            return t.view(batch, seq, self.heads, d_model // self.heads).transpose(1, 2)

        y = F.scaled_dot_product_attention(split(self.q(x)), split(self.k(x)), split(self.v(x)))
        out: torch.Tensor = self.out(y.transpose(1, 2).reshape(batch, seq, d_model))
        return out


class Block(nn.Module):
    def __init__(self, d_model: int, heads: int) -> None:
        super().__init__()
        self.norm1 = nn.LayerNorm(d_model)
        self.attn = SelfAttention(d_model, heads)
        self.norm2 = nn.LayerNorm(d_model)
        self.fc1 = nn.Linear(d_model, 4 * d_model)
        self.fc2 = nn.Linear(4 * d_model, d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.norm1(x))
        out: torch.Tensor = x + self.fc2(F.gelu(self.fc1(self.norm2(x))))
        return out


class Encoder(nn.Module):
    def __init__(self, num_classes: int = 10) -> None:
        super().__init__()
        self.tokens = nn.Embedding(VOCAB, D_MODEL)
        self.positions = nn.Parameter(torch.zeros(MAX_LEN, D_MODEL))
        self.blocks = nn.Sequential(*(Block(D_MODEL, HEADS) for _ in range(LAYERS)))
        self.norm = nn.LayerNorm(D_MODEL)
        self.head = nn.Linear(D_MODEL, num_classes)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.tokens(ids) + self.positions[: ids.shape[1]]
        x = self.norm(self.blocks(x))
        logits: torch.Tensor = self.head(x.mean(dim=1))
        return logits


@register("transformer")
def build() -> ModelSpec:
    generator = torch.Generator().manual_seed(SEED)
    module = Encoder()
    seeded_init(module, generator)

    def ids() -> torch.Tensor:
        return torch.randint(0, VOCAB, (BATCH, MAX_LEN), generator=generator)

    return ModelSpec(
        name="transformer",
        description=f"pre-norm encoder, {LAYERS} layers, d_model {D_MODEL}, {HEADS} heads, "
        f"vocab {VOCAB}; input int64 token ids ({BATCH}, {MAX_LEN}), 10 classes",
        module=module.eval(),
        example_inputs=(ids(),),
        # Random ids rather than the generic default, which would repeat the example.
        calibration_data=[(ids(),) for _ in range(4)],
        batch_dim=0,
    )
