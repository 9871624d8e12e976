"""``torch.export`` archives (``.pt2``, from ``torch.export.save``) as models, loaded without pickle.

``torch.export.load`` reads a zip archive: the program as JSON
(``models/<name>.json``), weights and constants as raw tensor bytes described
by JSON configs, and the example inputs as a ``torch.save`` file. It can also
unpickle, which runs arbitrary code: weights or constants marked
``use_pickle`` (tensor subclasses) go through ``torch.load(weights_only=False)``,
legacy ``<name>.pt`` weight and constant files and script or opaque objects
through ``torch.load``/``pickle.loads``, an AOTInductor package loads a
shared library, and the example inputs are retried with
``weights_only=False`` when the restricted unpickler refuses them.

:func:`check_archive` inspects the archive's listing and JSON configs and
refuses every one of those paths before anything is loaded, and reads the
example inputs with the restricted unpickler (``weights_only=True``: tensors
and plain containers only) so the fallback never happens. What is then
handed to ``torch.export.load`` is the very bytes that were checked (an
in-memory copy, not the path, so the file cannot change in between). The
program's graph names only ops already registered with torch; nothing in the
archive is imported or executed.
"""

from __future__ import annotations

import io
import json
import zipfile
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import Any

import torch

from harness.errors import HarnessError, first_line
from harness.fileio import digest, read_regular_file
from harness.sources.inputs import InputDecl

MAX_PT2_BYTES = 8 << 30
_UNSAFE_PREFIXES = ("custom_obj_", "opaque_obj_")


@dataclass(frozen=True)
class Pt2Archive:
    """A checked archive: its bytes, digest and the loaded program."""

    path: Path
    digest: str
    program: torch.export.ExportedProgram
    inputs: tuple[InputDecl, ...]
    example_inputs: tuple[torch.Tensor, ...]

    @property
    def where(self) -> str:
        return f"torch.export archive {self.path}"


def check_archive(data: bytes, where: str) -> None:
    """Refuse an archive that would make ``torch.export.load`` unpickle or load native code."""
    try:
        archive = zipfile.ZipFile(io.BytesIO(data))
        names = archive.namelist()
    except (zipfile.BadZipFile, ValueError) as exc:
        raise HarnessError(f"{where} is not a torch.export archive (not a zip file: {first_line(exc)})") from None
    roots = {PurePosixPath(n).parts[0] for n in names if PurePosixPath(n).parts}
    if len(roots) != 1:
        raise HarnessError(f"{where} is not a torch.export archive (no single root folder)")
    (root,) = roots
    rel = {str(PurePosixPath(*PurePosixPath(n).parts[1:])): n for n in names if len(PurePosixPath(n).parts) > 1}
    if "archive_format" not in rel or "models/" not in "".join(k[:7] for k in rel):
        raise HarnessError(f"{where} is not a torch.export archive (written by torch.export.save)")
    if any(k.startswith("data/aotinductor/") for k in rel):
        raise HarnessError(f"{where} holds an AOTInductor package (compiled native code); the harness loads programs only")
    models = [k.removeprefix("models/").removesuffix(".json") for k in rel if k.startswith("models/") and k.endswith(".json")]
    if not models:
        raise HarnessError(f"{where} holds no exported program (models/*.json)")
    for model in models:
        for legacy in (f"data/weights/{model}.pt", f"data/constants/{model}.pt"):
            if legacy in rel:
                raise HarnessError(
                    f"{where} stores {legacy} in the legacy pickled format; re-save it with torch.export.save "
                    "of this PyTorch (the harness never unpickles)"
                )
        for kind in ("weights", "constants"):
            config_name = f"data/{kind}/{model}_{kind}_config.json"
            if config_name not in rel:
                raise HarnessError(f"{where} lacks {config_name}")
            try:
                config = json.loads(archive.read(rel[config_name]))["config"]
            except (KeyError, TypeError, ValueError) as exc:
                raise HarnessError(f"{where}: {config_name} is not a payload config ({first_line(exc)})") from None
            if not isinstance(config, dict):
                raise HarnessError(f"{where}: {config_name} is not a payload config")
            for fqn, meta in config.items():
                if not isinstance(meta, dict):
                    raise HarnessError(f"{where}: {config_name}: entry {fqn!r} is not an object")
                if meta.get("use_pickle"):
                    raise HarnessError(
                        f"{where}: {kind[:-1]} {fqn!r} is stored pickled (a tensor subclass); the harness never "
                        "unpickles an archive's contents: save plain tensors"
                    )
                if str(meta.get("path_name", "")).startswith(_UNSAFE_PREFIXES):
                    raise HarnessError(
                        f"{where}: constant {fqn!r} is a pickled script or opaque object; the harness never "
                        "unpickles an archive's contents"
                    )
        sample = f"data/sample_inputs/{model}.pt"
        if sample in rel:
            blob = archive.read(rel[sample])
            if blob:
                try:
                    torch.load(io.BytesIO(blob), weights_only=True)
                except Exception as exc:  # noqa: BLE001 - the restricted unpickler's refusals share no type
                    raise HarnessError(
                        f"{where}: its example inputs are not plain tensors (the restricted unpickler refuses "
                        f"them: {first_line(exc)}); the harness never unpickles them otherwise"
                    ) from None
    del root


def read_pt2(path: Path) -> Pt2Archive:
    """Check and load ``path``; its declared inputs come from the program's placeholders."""
    where = f"torch.export archive {path}"
    data = read_regular_file(path, "torch.export archive", MAX_PT2_BYTES)
    check_archive(data, where)
    _register_known_outputs(data)
    try:
        program = torch.export.load(io.BytesIO(data))
    except HarnessError:
        raise
    except Exception as exc:  # whatever the deserializer raises for a damaged or foreign archive
        raise HarnessError(f"{where} cannot be loaded: {type(exc).__name__}: {first_line(exc)}") from None
    example = program.example_inputs
    args, kwargs = example if example is not None else ((), {})
    if kwargs:
        raise HarnessError(f"{where}: the program takes keyword inputs ({', '.join(kwargs)}); the harness feeds positional ones")
    decls = _declared(program, where)
    if args and len(args) != len(decls):
        raise HarnessError(f"{where}: {len(args)} example inputs for {len(decls)} program inputs")
    if not all(isinstance(a, torch.Tensor) for a in args):
        raise HarnessError(f"{where}: the program takes inputs other than tensors")
    return Pt2Archive(path, digest(data), program, decls, tuple(args))


def _register_known_outputs(data: bytes) -> None:
    """Register the output containers of ``transformers`` (an installed library, never the archive's
    code) when the program's output structure names them: pytree can only rebuild registered types."""
    if b"transformers.modeling_outputs" not in data:
        return
    import importlib.util

    if importlib.util.find_spec("transformers") is not None:
        importlib.import_module("transformers.modeling_outputs")


def _declared(program: torch.export.ExportedProgram, where: str) -> tuple[InputDecl, ...]:
    """User inputs: name, dtype and shape (None where the program keeps the dimension symbolic)."""
    from torch.export.graph_signature import InputKind

    user = [s.arg.name for s in program.graph_signature.input_specs if s.kind == InputKind.USER_INPUT]
    placeholders = {n.name: n for n in program.graph.nodes if n.op == "placeholder"}
    decls = []
    for name in user:
        val: Any = placeholders[name].meta.get("val")
        if not isinstance(val, torch.Tensor):
            raise HarnessError(f"{where}: input {name!r} is not a tensor")
        shape = tuple(d if isinstance(d, int) else None for d in val.shape)
        decls.append(InputDecl(name, val.dtype, shape))
    if not decls:
        raise HarnessError(f"{where}: the program takes no inputs")
    return tuple(decls)
