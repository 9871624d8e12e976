"""Hugging Face checkpoints from a local directory (``--model hf:path/to/dir``).

The directory holds ``config.json`` and the weights as safetensors
(``model.safetensors``, or shards listed by ``model.safetensors.index.json``),
as ``save_pretrained`` writes them. It is read with ``transformers``
(the ``hf`` extra) with ``local_files_only=True`` and ``use_safetensors=True``:
nothing is downloaded, no pickle is read (a directory with only
``pytorch_model.bin`` is refused), and no code from the directory runs (a
config that asks for its own code through ``auto_map`` is refused). The model
class is the config's first ``architectures`` entry, looked up in
``transformers`` itself.

Example inputs come from the config: for text models ``input_ids`` of
:data:`DEFAULT_TOKENS` tokens (at most the model's position limit), drawn
below ``vocab_size``, with an all-ones ``attention_mask``; for vision models
``pixel_values`` of ``num_channels x image_size x image_size``. Both are
overridden like any model file's inputs (``--input-shapes``,
``--input-range``, ``--load-inputs``). The identity is the digest of
``config.json`` and the weight files' bytes, never the directory's path.
"""

from __future__ import annotations

import inspect
import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from harness.errors import HarnessError, first_line
from harness.fileio import canonical_json, digest, read_regular_file
from harness.globalstate import preserved_global_state
from harness.sources.inputs import InputDecl

PREFIX = "hf:"
DEFAULT_TOKENS = 128
MAX_CONFIG_BYTES = 1 << 20
MAX_WEIGHTS_BYTES = 64 << 30


@dataclass(frozen=True, eq=False)
class HfCheckpoint:
    path: Path
    digest: str
    module: torch.nn.Module
    inputs: tuple[InputDecl, ...]
    architecture: str

    @property
    def where(self) -> str:
        return f"Hugging Face directory {self.path}"


def weight_files(path: Path, where: str) -> list[Path]:
    """The safetensors files of the checkpoint; refuses a directory with pickled weights only."""
    single = path / "model.safetensors"
    index = path / "model.safetensors.index.json"
    if single.is_file():
        return [single]
    if index.is_file():
        try:
            shards = sorted(set(json.loads(read_regular_file(index, "safetensors index"))["weight_map"].values()))
        except (KeyError, TypeError, ValueError, AttributeError) as exc:
            raise HarnessError(f"{where}: {index.name} is not a safetensors index ({first_line(exc)})") from None
        files = [path / s for s in shards]
        missing = [f.name for f in files if not f.is_file() or f.parent != path]
        if missing:
            raise HarnessError(f"{where}: shards listed in {index.name} are missing: {', '.join(missing)}")
        return files
    if any((path / n).is_file() for n in ("pytorch_model.bin", "pytorch_model.bin.index.json")):
        raise HarnessError(
            f"{where} holds its weights only as pytorch_model.bin (pickle), which the harness never loads; "
            "convert them to safetensors (model.save_pretrained(dir, safe_serialization=True))"
        )
    raise HarnessError(f"{where} has no model.safetensors (nor a safetensors index)")


def checkpoint_digest(path: Path, where: str) -> str:
    """Digest of ``config.json`` and every weight file, by name and bytes (not by the directory's path)."""
    parts = [["config.json", digest(read_regular_file(path / "config.json", "config.json", MAX_CONFIG_BYTES))]]
    for file in weight_files(path, where):
        parts.append([file.name, digest(read_regular_file(file, "weights file", MAX_WEIGHTS_BYTES))])
    return digest(canonical_json(parts))


def read_hf(path: Path) -> HfCheckpoint:
    """Load the checkpoint (see the module docstring); every refusal names the directory."""
    where = f"Hugging Face directory {path}"
    if not path.is_dir():
        raise HarnessError(f"{where}: {'not a directory' if path.exists() else 'no such directory'}")
    if not (path / "config.json").is_file():
        raise HarnessError(f"{where} has no config.json (a directory written by save_pretrained)")
    identity = checkpoint_digest(path, where)
    from harness.extras import require

    transformers = require("transformers", "hf", "reading a Hugging Face checkpoint")
    logging.getLogger("transformers").setLevel(logging.ERROR)
    try:
        config = transformers.AutoConfig.from_pretrained(str(path), local_files_only=True, trust_remote_code=False)
    except Exception as exc:  # transformers raises ValueError, OSError, KeyError for a bad config
        raise HarnessError(f"{where}: config.json cannot be read: {first_line(exc)}") from None
    if getattr(config, "auto_map", None):
        raise HarnessError(f"{where}: its config asks for code from the directory (auto_map); the harness runs none")
    architectures = getattr(config, "architectures", None) or []
    if not architectures:
        raise HarnessError(f"{where}: config.json names no architectures; the model class cannot be chosen")
    arch = str(architectures[0])
    cls = getattr(transformers, arch, None)
    if cls is None or not hasattr(cls, "from_pretrained"):
        raise HarnessError(f"{where}: architecture {arch!r} is not a class of transformers {transformers.__version__}")
    if hasattr(config, "use_cache"):
        config.use_cache = False  # no key/value cache in the outputs: the same work on every call
    try:
        with torch.random.fork_rng(devices=[]), preserved_global_state():
            torch.manual_seed(0)  # weights the checkpoint lacks are initialised the same in every process
            module = cls.from_pretrained(
                str(path), config=config, local_files_only=True, use_safetensors=True, trust_remote_code=False
            )
    except HarnessError:
        raise
    except Exception as exc:  # OSError for missing files, safetensors errors for damaged ones
        raise HarnessError(f"{where}: the weights cannot be loaded: {type(exc).__name__}: {first_line(exc)}") from None
    module.eval()
    return HfCheckpoint(path, identity, module, _declared(module, config, where), arch)


def _declared(module: Any, config: Any, where: str) -> tuple[InputDecl, ...]:
    """The inputs the config implies (see the module docstring)."""
    main = getattr(module, "main_input_name", "input_ids")
    params = inspect.signature(module.forward).parameters
    if main == "input_ids":
        vocab = getattr(config, "vocab_size", None)
        limit = getattr(config, "max_position_embeddings", None)
        tokens = min(DEFAULT_TOKENS, limit) if isinstance(limit, int) and limit > 0 else DEFAULT_TOKENS
        decls = [InputDecl("input_ids", torch.int64, (None, tokens), vocab if isinstance(vocab, int) else None)]
        if "attention_mask" in params:
            decls.append(InputDecl("attention_mask", torch.int64, (None, tokens)))
        return tuple(decls)
    if main == "pixel_values":
        size = getattr(config, "image_size", None)
        channels = getattr(config, "num_channels", 3)
        sizes = size if isinstance(size, (list, tuple)) else (size, size)
        if not all(isinstance(s, int) for s in sizes):
            raise HarnessError(f"{where}: the config gives no image_size; give --input-shapes pixel_values:1xCxHxW")
        return (InputDecl("pixel_values", torch.float32, (None, int(channels), *map(int, sizes))),)
    raise HarnessError(
        f"{where}: its main input is {main!r}; the harness derives the inputs of text (input_ids) and vision "
        "(pixel_values) models from the config only"
    )
