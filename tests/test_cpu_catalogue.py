"""The CPU engine's catalogue of tactics, and libdnnl's signature table.

Adding a tactic is one entry in its family's catalogue, beside its code: every
entry is one name (the one timing caches record), documented, applies to some
layer and binds to a callable that computes the layer; no name is written
anywhere else, and offering and binding need nothing but the entry. Every
libdnnl function the engine calls is declared, as oneDNN's header declares it.
"""

from __future__ import annotations

import ast
import ctypes
import dataclasses
import re
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from harness.autocast import compile
from harness.engines import capability
from harness.engines.cpu import onednn_primitive, tactics
from harness.engines.cpu.families import FAMILIES
from harness.engines.cpu.families.normalization import SOFTMAX
from harness.engines.cpu.lowering import lower
from harness.engines.cpu.plan import GETITEM
from harness.engines.cpu.tactic import Tactic
from harness.opnames import plan_packet

ROOT = Path(__file__).resolve().parents[1]
HARNESS = ROOT / "harness"
ENGINE = HARNESS / "engines" / "cpu"
# The names timing caches record, by family, in the order a layer is offered them: never renamed.
NAMES = {
    "view": ["reshape"],
    "gemm": [
        "gemm_direct", "gemm_splitk2", "gemm_splitk4", "gemm_nn", "gemm_widened", "gemm_onednn",
        "gemm_onednn_graph", "gemm_onednn_graph_widened", "gemm_dnnl",
    ],
    "convolution": [
        "conv_nchw", "conv_channels_last", "conv_no_mkldnn", "conv_onednn", "conv_onednn_graph",
        "conv_onednn_graph_widened", "conv_dnnl", "conv1x1_gemm", "conv1x1_widened", "conv1x1_onednn", "conv_widened",
    ],
    "adaptive pooling": ["direct", "pool_window", "pool_dnnl"],
    "binary": ["direct", "binary_dnnl"],
    "cast": ["direct", "cast_dnnl"],
    "softmax": ["softmax_fused", "softmax_decomposed"],
    "layer norm": ["layernorm_fused", "layernorm_decomposed", "layernorm_dnnl"],
    "attention": ["sdpa_fused", "sdpa_math", "sdpa_dnnl"],
    "plain": ["direct"],
}  # fmt: skip


class EveryFamily(nn.Module):
    """A layer of every family, and of each form a tactic's check picks out: a padded and a 1x1
    convolution, a global pooling and a per-channel product, a float cast, a linear layer and
    a plain matmul, softmax, layer norm, attention, a view."""

    def __init__(self) -> None:
        super().__init__()
        self.conv, self.pointwise = nn.Conv2d(8, 8, 3, padding=1), nn.Conv2d(8, 8, 1)
        self.fc, self.norm = nn.Linear(64, 64), nn.LayerNorm(64)

    def forward(self, image: torch.Tensor, tokens: torch.Tensor) -> tuple[torch.Tensor, ...]:
        y = self.pointwise(torch.relu(self.conv(image)))
        y = y * F.adaptive_avg_pool2d(y, 1)
        t = self.norm(self.fc(tokens))
        q = t.view(1, 8, 2, 32).transpose(1, 2)
        scores = torch.softmax(q @ q.transpose(-1, -2), -1)
        return y.to(torch.float16).float(), F.scaled_dot_product_attention(q, q, q), scores


@pytest.fixture(scope="module")
def plans():
    gen = torch.Generator().manual_seed(31)
    torch.manual_seed(31)
    module = EveryFamily().eval()
    inputs = (torch.randn(1, 8, 6, 6, generator=gen), torch.randn(1, 8, 64, generator=gen))
    found = {}
    for policy, low, mode in (("fp32", None, "fp32"), ("full", torch.bfloat16, "bf16"), ("full", torch.float16, "fp16")):
        compiled = compile(module, inputs, policy=policy, low_precision_type=low)
        found[mode] = (lower(compiled.graph_module, mode)[0], inputs)
    return found


def test_each_family_s_catalogue_is_its_names_in_order_each_one_documented_entry():
    assert {f.name: [t.name for t in f.tactics] for f in FAMILIES} == NAMES
    assert FAMILIES[-1].name == "plain"  # every layer has a family
    for name, entry in tactics.CATALOGUE.items():
        assert re.fullmatch(r"[a-z0-9_]+", name), name  # what a tactic name's impl part may be
        assert entry.doc and "\n" not in entry.doc, name
    # A name is one object, wherever families share it.
    assert len({id(t) for f in FAMILIES for t in f.tactics}) == len(tactics.CATALOGUE)


def test_the_engine_s_lists_of_tactics_are_read_off_the_catalogue():
    entries = tactics.CATALOGUE.values()
    assert tactics.PRIMITIVE_IMPLS == ("gemm_dnnl", "conv_dnnl", "pool_dnnl", "binary_dnnl", "cast_dnnl", "layernorm_dnnl")
    assert set(tactics.GRAPH_IMPLS) == {t.name for t in entries if t.graph_layout is not None} == {
        "conv_onednn_graph", "conv_onednn_graph_widened", "gemm_onednn_graph", "gemm_onednn_graph_widened",
    }  # fmt: skip
    assert tactics.REGION_FORMS == {"sdpa_fused": "sdpa_math", "sdpa_dnnl": "sdpa_math"}
    assert {t.name for t in entries if t.aten_low} == {
        "conv_nchw", "conv_channels_last", "conv1x1_gemm", "gemm_direct", "gemm_nn", "gemm_splitk2", "gemm_splitk4",
        "sdpa_math",
    }  # fmt: skip
    assert {t.name for t in entries if t.traceable} == {
        "direct", "reshape", "pool_window", "layernorm_fused", "softmax_fused", "sdpa_fused", "sdpa_math",
    }  # fmt: skip
    assert {t.name for t in entries if t.aten_call} == {
        "direct", "pool_window", "layernorm_fused", "softmax_fused", "sdpa_fused"
    }


def test_every_entry_applies_to_some_layer_and_each_offered_one_computes_the_layer(plans):
    """Across the precisions and the known kinds of CPU, every entry is offered or left out
    for some layer; here, every offered one binds and agrees with the layer's first."""
    seen: set[str] = set()
    for plan, _ in plans.values():
        metas = plan.value_metas()
        for kind in (capability.ThisMachine(), *capability.KINDS):
            with capability.forced(kind):
                for node in plan.nodes:
                    if node.op != GETITEM:
                        found = tactics.offer(node, metas, plan.weights)
                        seen |= {*found.impls, *found.left_out}
    assert seen == set(tactics.CATALOGUE)
    bound: set[str] = set()
    for mode, (plan, inputs) in plans.items():
        metas = plan.value_metas()
        tol = 1e-5 if mode == "fp32" else 0.05
        values = {name: t.to(getattr(torch, {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}[meta.dtype]))
                  for (name, meta), t in zip(plan.inputs, inputs, strict=True)}  # fmt: skip
        with torch.inference_mode():
            for node in plan.nodes:
                args = [values[r.name] for r in node.refs()]
                if node.op == GETITEM:
                    values[node.name] = args[0][node.args[1]]
                    continue
                impls = tactics.offer(node, metas, plan.weights).impls
                outs = {impl: tactics.bind(node, impl, metas, plan.weights)(*args) for impl in impls}
                values[node.name] = reference = outs[impls[0]]
                for impl, out in outs.items():
                    torch.testing.assert_close(out.float(), reference.float(), rtol=tol, atol=tol, msg=f"{node.name} {impl}")
                bound |= set(impls)
    # What this CPU offers at all: an entry it never offers must be left out somewhere, with its reason.
    assert bound >= {"reshape", "direct", "gemm_direct", "gemm_widened", "conv_channels_last", "sdpa_fused"}


def _string_constants(path: Path) -> list[tuple[str, int]]:
    return [
        (node.value, node.lineno)
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8")))
        if isinstance(node, ast.Constant) and isinstance(node.value, str)
    ]


def test_no_tactic_name_is_written_outside_its_entry():
    """Each name is written once in harness/: in its family's entry, or for a tactic on a
    oneDNN primitive as that primitive's ``tactic`` (which the entry reads)."""
    written: dict[str, list[str]] = {}
    for path in sorted(HARNESS.rglob("*.py")):
        for value, line in _string_constants(path):
            if value in tactics.CATALOGUE:
                written.setdefault(value, []).append(f"{path.relative_to(ROOT)}:{line}")
    # The builder names the cast ("reformat") layers it inserts by the plain tactic.
    builder = [place for place in written.get("direct", []) if place.startswith("harness/engines/cpu/builder.py:")]
    written["direct"] = [place for place in written.get("direct", []) if place not in builder]
    for name, entry in tactics.CATALOGUE.items():
        (place,) = written[name]
        where = "harness/engines/cpu/families/" if entry.primitive is None else "harness/engines/cpu/onednn_"
        assert place.startswith(where), (name, place)


def test_a_new_entry_is_offered_in_its_place_and_binds_with_nothing_else_to_change(monkeypatch, plans):
    plan, inputs = plans["fp32"]
    metas = plan.value_metas()
    (node,) = [n for n in plan.nodes if plan_packet(n.op) == "softmax"]
    wide = Tactic("softmax_fp64", lambda ctx: lambda x: torch.softmax(x.double(), -1).to(x.dtype), "in fp64")
    family = dataclasses.replace(SOFTMAX, tactics=(*SOFTMAX.tactics[:1], wide, *SOFTMAX.tactics[1:]))
    monkeypatch.setattr(tactics, "FAMILIES", tuple(family if f is SOFTMAX else f for f in FAMILIES))
    assert tactics.offer(node, metas, plan.weights).impls == ("softmax_fused", "softmax_fp64", "softmax_decomposed")
    x = torch.randn(metas[node.refs()[0].name].shape)
    torch.testing.assert_close(tactics.bind(node, "softmax_fp64", metas, plan.weights)(x), torch.softmax(x, -1))


# --- libdnnl's signatures ---------------------------------------------------------------------------

_CALLERS = [ENGINE / "onednn_primitive.py", ENGINE / "onednn_attention.py"]


def _called() -> set[str]:
    """The libdnnl functions the engine's code names: as attributes, and through ``destroy(kind)``."""
    names = set()
    for path in _CALLERS:
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Attribute) and node.attr.startswith("dnnl_"):
                names.add(node.attr)
            elif (
                isinstance(node, ast.Call)
                and isinstance(node.func, ast.Attribute)
                and node.func.attr == "destroy"
                and isinstance(node.args[0], ast.Constant)
            ):
                names.add(f"dnnl_{node.args[0].value}_destroy")
    return names


def test_every_libdnnl_function_called_is_declared_and_every_declared_one_called():
    assert _called() == set(onednn_primitive.SIGNATURES)


def _header_prototypes() -> tuple[dict[str, tuple[str, list[str]]], set[str]]:
    """oneDNN's C prototypes (name -> return type, parameter types) and handle typedefs, from
    the oneDNN 3 headers torch ships."""
    include = Path(torch.__file__).parent / "include" / "oneapi" / "dnnl"
    text = " ".join(p.read_text(encoding="utf-8") for p in sorted(include.glob("dnnl*.h")))
    text = re.sub(r"//[^\n]*", " ", text)
    handles = set(re.findall(r"typedef\s+(?:const\s+)?struct\s+\w+\s*\*\s*(\w+)\s*;", text))
    prototypes = {}
    for returns, name, params in re.findall(r"([\w\s\*]+?)\s*DNNL_API\s*\*?\s*(dnnl_\w+)\s*\(([^;]*?)\)\s*;", text):
        star = "*" if re.search(rf"DNNL_API\s*\*\s*{name}\b", text) else ""
        types = [re.sub(r"\s*\w+$", "", p.strip()) if p.strip() not in ("void", "") else "" for p in params.split(",")]
        prototypes[name] = (returns.split()[-1] + star if returns.split() else star, [t for t in types if t])
    return prototypes, handles


def _kind(c_type: str, handles: set[str]) -> str:
    """What ctypes must pass a parameter of ``c_type`` as."""
    bare = c_type.replace("const ", "").strip()
    if "*" in bare or bare in handles or bare == "dnnl_dims_t":
        return "pointer"
    if bare in ("float", "size_t", "int"):
        return bare
    if bare == "unsigned":
        return "unsigned"
    if bare == "char":
        return "string"
    assert re.fullmatch(r"dnnl_\w+_t", bare), c_type  # one of oneDNN's enums
    return "int"


def _ctype_kind(ctype: type) -> str:
    if ctype is ctypes.c_char_p:
        return "string"
    if ctype is ctypes.c_void_p or issubclass(ctype, ctypes._Pointer):
        return "pointer"
    return {ctypes.c_float: "float", ctypes.c_size_t: "size_t", ctypes.c_int: "int", ctypes.c_uint: "unsigned"}[ctype]


def test_the_signature_table_is_oneDNN_s_C_API():
    """Each declared function takes and returns what oneDNN 3's header says (torch's copy of it:
    these prototypes are the same across oneDNN 3 releases)."""
    prototypes, handles = _header_prototypes()
    if not prototypes:
        pytest.skip("this torch ships no oneDNN headers")
    for name, (restype, argtypes) in onednn_primitive.SIGNATURES.items():
        returns, params = prototypes[name]
        assert [_ctype_kind(t) for t in argtypes] == [_kind(p, handles) for p in params], name
        assert _ctype_kind(restype) == ("string" if returns == "char*" else _kind(returns, handles)), name


def test_the_loaded_library_calls_only_what_the_table_declares():
    lib = onednn_primitive.library()
    if lib is None:
        pytest.skip("the onednn extra is not installed")
    for name, (restype, argtypes) in onednn_primitive.SIGNATURES.items():
        function = getattr(lib.lib, name)
        assert function.restype is restype and tuple(function.argtypes) == argtypes, name
    with pytest.raises(AttributeError, match="dnnl_primitive_get_primitive_desc is not declared"):
        lib.lib.dnnl_primitive_get_primitive_desc  # noqa: B018 (a real oneDNN 3 function, undeclared)
