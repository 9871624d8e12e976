"""Small re-creations of the patterns that broke the harness on third-party models.

Each factory is loaded the way a user's model file is (``file.py:factory``):
- ``shifted_window_mask``: a mask buffer filled by slice assignment in a loop
  (Swin-style shifted windows), written through ``aten.slice`` views;
- ``no_grad_rotary``: a ``@torch.no_grad()`` method (a rotary embedding), which
  export records as ``wrap_with_set_grad_enabled``;
- ``nested_outputs``: a dict holding a tensor, a tuple and a list;
- ``engine_ops``: ops outside the CPU engine's former allow-list;
- ``token_mixer``: MLP-Mixer blocks, whose token-mixing linear takes a transposed
  3-D activation (in fp16 eager picks its kernel by whether the weight requires grad);
- ``dtype_followers``: every way of writing a dtype that follows a tensor at run
  time (``x.to(y.device)``, ``x.to(y)``, ``type_as``, ``dtype=y.dtype``, ``new_zeros``,
  ``full_like``), which a trace records as constants.
"""

from __future__ import annotations

import torch
from torch import nn

from harness.models import ModelSpec, default_calibration_data


def _spec(name: str, module: nn.Module, *inputs: torch.Tensor) -> ModelSpec:
    return ModelSpec(
        name=name,
        description=f"conformance re-creation: {name}",
        module=module.eval(),
        example_inputs=inputs,
        calibration_data=default_calibration_data(inputs),
    )


class ShiftedWindowAttention(nn.Module):
    """Attention over 4x4 windows whose mask marks tokens from different shifted regions."""

    def __init__(self, size: int = 8, window: int = 4, shift: int = 2, dim: int = 16) -> None:
        super().__init__()
        self.size, self.window, self.shift = size, window, shift
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)

    def mask(self, x: torch.Tensor) -> torch.Tensor:
        img = x.new_zeros(1, self.size, self.size, 1)
        regions = (slice(0, -self.window), slice(-self.window, -self.shift), slice(-self.shift, None))
        count = 0
        for h in regions:
            for w in regions:
                img[:, h, w, :] = count
                count += 1
        windows = img.view(1, self.size // self.window, self.window, self.size // self.window, self.window, 1)
        windows = windows.permute(0, 1, 3, 2, 4, 5).reshape(-1, self.window * self.window)
        diff = windows.unsqueeze(1) - windows.unsqueeze(2)
        return diff.masked_fill(diff != 0, -100.0).masked_fill(diff == 0, 0.0)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, n, d = x.shape
        w = self.window * self.window
        q, k, v = self.qkv(x).reshape(-1, w, 3, d).unbind(2)
        scores = q @ k.transpose(-2, -1) / d**0.5 + self.mask(x)
        return self.proj(scores.softmax(-1) @ v).reshape(b, n, d)


def shifted_window_mask() -> ModelSpec:
    return _spec("shifted_window_mask", ShiftedWindowAttention(), torch.randn(1, 64, 16))


class Rotary(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.register_buffer("inv_freq", 1.0 / (10000 ** (torch.arange(0, dim, 2).float() / dim)))

    @torch.no_grad()
    def forward(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        freqs = positions[:, None].float() * self.inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos(), emb.sin()


class RotaryBlock(nn.Module):
    def __init__(self, dim: int = 16) -> None:
        super().__init__()
        self.rotary = Rotary(dim)
        self.q = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        cos, sin = self.rotary(torch.arange(x.shape[1]))
        q = self.q(x)
        half = q.shape[-1] // 2
        rotated = torch.cat((-q[..., half:], q[..., :half]), dim=-1)
        return q * cos + rotated * sin


def no_grad_rotary() -> ModelSpec:
    return _spec("no_grad_rotary", RotaryBlock(), torch.randn(1, 8, 16))


class Nested(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(8, 8)
        self.b = nn.Linear(8, 4)

    def forward(self, x: torch.Tensor) -> dict[str, object]:
        h = self.a(x).relu()
        return {"logits": self.b(h), "hidden": (h, [h.sum(-1), x * 2])}


def nested_outputs() -> ModelSpec:
    return _spec("nested_outputs", Nested(), torch.randn(2, 8))


class EngineOps(nn.Module):
    """Ops the CPU engine once refused: new_zeros, new_ones, __and__, diff, sin, cos, expand_as,
    addcmul, reshape_as."""

    def __init__(self) -> None:
        super().__init__()
        self.l = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.l(x)
        zeros, ones = h.new_zeros(h.shape), h.new_ones(2, 8)
        both = (h > 0) & (x > 0)
        d = torch.diff(h, dim=-1, prepend=zeros[..., :1])
        wave = torch.addcmul(h.sin(), h.cos(), d, value=0.5)
        scale = ones[:1].expand_as(wave)
        return (wave * scale).masked_fill(both, 0.0).reshape_as(x) + zeros


def engine_ops() -> ModelSpec:
    return _spec("engine_ops", EngineOps(), torch.randn(2, 8))


class MixerBlock(nn.Module):
    def __init__(self, tokens: int, dim: int, hidden: int) -> None:
        super().__init__()
        self.norm1, self.norm2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.token1, self.token2 = nn.Linear(tokens, hidden), nn.Linear(hidden, tokens)
        self.channel1, self.channel2 = nn.Linear(dim, hidden), nn.Linear(hidden, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        mixed = self.token2(nn.functional.gelu(self.token1(self.norm1(x).transpose(1, 2))))
        x = x + mixed.transpose(1, 2)
        return x + self.channel2(nn.functional.gelu(self.channel1(self.norm2(x))))


class TokenMixer(nn.Module):
    """Patches (4x4 convolution) -> two Mixer blocks -> mean over tokens -> head."""

    def __init__(self, dim: int = 64, hidden: int = 96) -> None:
        super().__init__()
        self.stem = nn.Conv2d(3, dim, 4, 4)
        self.blocks = nn.Sequential(MixerBlock(49, dim, hidden), MixerBlock(49, dim, hidden))
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, 96)

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        tokens = self.stem(images).flatten(2).transpose(1, 2)
        return self.head(self.norm(self.blocks(tokens)).mean(1))


def token_mixer() -> ModelSpec:
    return _spec("token_mixer", TokenMixer(), torch.randn(2, 3, 28, 28))


class DtypeFollowers(nn.Module):
    """A block whose dtypes are read off tensors at run time, each in another way."""

    def __init__(self, dim: int = 16) -> None:
        super().__init__()
        self.proj = nn.Linear(dim, dim)
        self.pos = nn.Conv1d(dim, dim, 3, padding=1)
        self.gain = nn.Parameter(torch.ones(dim))
        self.register_buffer("offset", torch.linspace(-1.0, 1.0, dim))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        h = self.proj(x)
        pos = self.pos(h.transpose(1, 2)).transpose(1, 2)
        h = h + pos.to(h.device)  # wav2vec2's position embedding: pos keeps its own dtype
        dtype = h.dtype
        scale = self.gain.to(h) * self.offset.type_as(h)
        zeros = torch.zeros(h.shape[-1], dtype=h.dtype, device=h.device)
        steps = torch.arange(h.shape[-1], dtype=dtype) * 0.1
        fill = torch.full_like(x, 0.3, dtype=dtype) + h.new_zeros(h.shape) + torch.full_like(h, 0.7)
        wide = h.to(torch.float32)  # a literal dtype stays
        normed = wide * torch.rsqrt(wide.pow(2).mean(-1, keepdim=True) + 1e-6)
        return h * scale + zeros + steps, fill, normed.to(dtype)


def dtype_followers() -> ModelSpec:
    return _spec("dtype_followers", DtypeFollowers(), torch.randn(2, 8, 16))


RECREATIONS = ("shifted_window_mask", "no_grad_rotary", "nested_outputs", "engine_ops", "token_mixer", "dtype_followers")

# What each re-creation is for, in the form of models/thirdparty.py's EXERCISES (checked by
# test_patterns.py), plus "nested-output" (a tensor at least two containers deep under that
# key) and "aten-op" (the op is in the exported graph, not decomposed away by export).
EXERCISES: dict[str, tuple[tuple[str, str], ...]] = {
    "shifted_window_mask": (("write-through-view", "ShiftedWindowAttention"),),
    "no_grad_rotary": (("set-grad-region", "Rotary"),),
    "nested_outputs": (("nested-output", "hidden"),),
    "engine_ops": tuple(
        ("aten-op", op)
        for op in ("new_zeros", "new_ones", "__and__", "diff", "sin", "cos", "expand_as", "addcmul", "reshape_as")
    ),
    "token_mixer": (("aten-op", "linear"), ("aten-op", "transpose")),
    # "dtype-follows": a node of that op carries the frontend's link to the tensor its dtype follows.
    "dtype_followers": tuple(("dtype-follows", op) for op in ("to", "zeros", "arange", "full_like")),
}
