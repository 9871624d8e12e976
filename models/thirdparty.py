"""Architectures this project did not write: Hugging Face ``transformers`` models.

The zoo's own models prove little about the models users bring. These entries
build real ``transformers`` architectures from small configs (no download:
the weights are drawn from the seeded generator every factory starts from),
at batch 1, returning what the library returns (a ``ModelOutput``). They are
the conformance suite's subjects and can be benchmarked like any zoo model
(``harness bench --models hf-bert``).

``transformers`` is an optional dependency (the ``hf`` extra); it is imported
only when one of these models is built.

Two of them are here for the patterns that once broke the harness on
third-party code (issue 7), and :data:`EXERCISES` says where each occurs; the
conformance suite checks every such claim against the exported graph, so a
``transformers`` release that rewrites the code is noticed instead of silently
leaving the pattern untested (as happened to Swin's mask and LLaMA's rotary
embedding, which no longer write through views or disable grad):
- ``hf-bart``: ``shift_tokens_right`` builds the decoder inputs by slice
  assignment into a fresh tensor (``copy_`` on a slice, ``fill_`` on a select);
- ``hf-trocr``: the sinusoidal position embedding's ``forward`` is
  ``@torch.no_grad()``, exported as ``wrap_with_set_grad_enabled``.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import torch

from harness.errors import HarnessError
from harness.models import ModelSpec, register

SEQ = 16  # tokens per sequence
VOCAB = 128
IMAGE = 32  # pixels per side
MEL_BINS, FRAMES = 16, 32
CALIBRATION_BATCHES = 4


def _transformers() -> Any:
    try:
        import transformers
    except ImportError:
        raise HarnessError(
            "the hf-* models need the transformers package: pip install 'mixed-precision-harness[hf]'"
        ) from None
    # Config warnings about unused token ids. transformers' own set_verbosity_error() sets this
    # logger's level too, but is untyped.
    logging.getLogger("transformers").setLevel(logging.ERROR)
    return transformers


def _token_ids(generator: torch.Generator) -> tuple[torch.Tensor]:
    return (torch.randint(0, VOCAB, (1, SEQ), generator=generator),)


def _images(generator: torch.Generator) -> tuple[torch.Tensor]:
    return (torch.randn(1, 3, IMAGE, IMAGE, generator=generator),)


def _features(generator: torch.Generator) -> tuple[torch.Tensor]:
    return (torch.randn(1, MEL_BINS, FRAMES, generator=generator),)


def _spec(
    name: str,
    description: str,
    module: torch.nn.Module,
    inputs: Callable[[torch.Generator], tuple[torch.Tensor, ...]],
) -> ModelSpec:
    generator = torch.Generator().manual_seed(0)
    return ModelSpec(
        name=name,
        description=f"transformers {description} from a small config (random weights, batch 1)",
        module=module.eval(),
        example_inputs=inputs(generator),
        calibration_data=[inputs(generator) for _ in range(CALIBRATION_BATCHES)],
        batch_dim=0,
    )


_SMALL = {"hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 4, "intermediate_size": 64}
# Token ids inside the small vocabulary, and no key/value cache in the outputs.
_TOKENS = {"pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2}


# Model -> (pattern, where) claims checked by tests/conformance/test_patterns.py. Patterns:
# "write-through-view" (an in-place write into a view of another tensor) and "set-grad-region"
# (a grad-mode switch, exported as a higher-order op); "where" is a module class or a
# function named in the source location export records for the node.
EXERCISES: dict[str, tuple[tuple[str, str], ...]] = {
    "hf-bart": (("write-through-view", "shift_tokens_right"),),
    "hf-trocr": (("set-grad-region", "TrOCRSinusoidalPositionalEmbedding"),),
}


@register("hf-bert")
def bert() -> ModelSpec:
    t = _transformers()
    config = t.BertConfig(vocab_size=VOCAB, max_position_embeddings=64, **_SMALL)
    return _spec("hf-bert", "BertModel", t.BertModel(config), _token_ids)


@register("hf-distilbert")
def distilbert() -> ModelSpec:
    t = _transformers()
    config = t.DistilBertConfig(
        vocab_size=VOCAB, dim=32, n_layers=2, n_heads=4, hidden_dim=64, max_position_embeddings=64
    )
    return _spec("hf-distilbert", "DistilBertModel", t.DistilBertModel(config), _token_ids)


@register("hf-gpt2")
def gpt2() -> ModelSpec:
    t = _transformers()
    config = t.GPT2Config(
        vocab_size=VOCAB, n_embd=32, n_layer=2, n_head=4, n_positions=64, use_cache=False, **_TOKENS
    )
    return _spec("hf-gpt2", "GPT2LMHeadModel", t.GPT2LMHeadModel(config), _token_ids)


@register("hf-t5")
def t5() -> ModelSpec:
    t = _transformers()
    config = t.T5Config(
        vocab_size=VOCAB, d_model=32, d_kv=8, d_ff=64, num_layers=2, num_heads=4, use_cache=False
    )
    return _spec("hf-t5", "T5EncoderModel", t.T5EncoderModel(config), _token_ids)


@register("hf-llama")
def llama() -> ModelSpec:
    t = _transformers()
    config = t.LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        use_cache=False,
        **_TOKENS,
    )
    # RMSNorm, rotary position embeddings, grouped-query attention (2 key/value heads
    # for 4 query heads), a SiLU-gated MLP. Its rotary embedding is no longer
    # @torch.no_grad() in current transformers: hf-trocr covers that pattern.
    return _spec("hf-llama", "LlamaForCausalLM", t.LlamaForCausalLM(config), _token_ids)


@register("hf-whisper-encoder")
def whisper_encoder() -> ModelSpec:
    t = _transformers()
    config = t.WhisperConfig(
        vocab_size=VOCAB,
        num_mel_bins=MEL_BINS,
        d_model=32,
        encoder_layers=2,
        encoder_attention_heads=4,
        encoder_ffn_dim=64,
        decoder_layers=1,
        decoder_attention_heads=4,
        decoder_ffn_dim=64,
        max_source_positions=FRAMES // 2,
        decoder_start_token_id=1,
        **_TOKENS,
    )
    encoder = t.WhisperModel(config).get_encoder()
    return _spec("hf-whisper-encoder", "WhisperEncoder", encoder, _features)


@register("hf-vit")
def vit() -> ModelSpec:
    t = _transformers()
    config = t.ViTConfig(image_size=IMAGE, patch_size=8, num_channels=3, **_SMALL)
    return _spec("hf-vit", "ViTModel", t.ViTModel(config), _images)


@register("hf-clip-vision")
def clip_vision() -> ModelSpec:
    t = _transformers()
    config = t.CLIPVisionConfig(image_size=IMAGE, patch_size=8, **_SMALL)
    return _spec("hf-clip-vision", "CLIPVisionModel", t.CLIPVisionModel(config), _images)


@register("hf-swin")
def swin() -> ModelSpec:
    t = _transformers()
    config = t.SwinConfig(
        image_size=IMAGE, patch_size=2, embed_dim=16, depths=[2, 2], num_heads=[2, 4], window_size=4
    )
    # Shifted windows: torch.roll, window partition by view/permute, patch merging, and a
    # shifted-window attention mask. Current transformers computes that mask arithmetically
    # (no slice assignment any more): hf-bart covers writes through views.
    return _spec("hf-swin", "SwinModel", t.SwinModel(config), _images)


@register("hf-bart")
def bart() -> ModelSpec:
    t = _transformers()
    config = t.BartConfig(
        vocab_size=VOCAB,
        d_model=32,
        encoder_layers=2,
        decoder_layers=2,
        encoder_attention_heads=4,
        decoder_attention_heads=4,
        encoder_ffn_dim=64,
        decoder_ffn_dim=64,
        max_position_embeddings=64,
        use_cache=False,
        decoder_start_token_id=2,
        **_TOKENS,
    )
    # Encoder-decoder with cross-attention; given only input ids, the model builds its
    # decoder inputs with shift_tokens_right, by slice assignment into new_zeros.
    return _spec("hf-bart", "BartModel", t.BartModel(config), _token_ids)


@register("hf-trocr")
def trocr() -> ModelSpec:
    t = _transformers()
    config = t.TrOCRConfig(
        vocab_size=VOCAB,
        d_model=32,
        decoder_layers=2,
        decoder_attention_heads=4,
        decoder_ffn_dim=64,
        max_position_embeddings=64,
        use_learned_position_embeddings=False,
        use_cache=False,
        **_TOKENS,
    )
    # The TrOCR text decoder as a causal LM. With sinusoidal positions, the position
    # embedding's forward is decorated @torch.no_grad() (and reads a plain tensor
    # attribute, which export lifts as a constant).
    return _spec("hf-trocr", "TrOCRForCausalLM", t.TrOCRForCausalLM(config), _token_ids)


THIRD_PARTY = (
    "hf-bert",
    "hf-distilbert",
    "hf-gpt2",
    "hf-t5",
    "hf-llama",
    "hf-whisper-encoder",
    "hf-vit",
    "hf-clip-vision",
    "hf-swin",
    "hf-bart",
    "hf-trocr",
)
