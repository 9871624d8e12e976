"""The neutral timing cache: round trip, validation, provenance, and the cache operations."""

from __future__ import annotations

import json
import math
from dataclasses import replace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from harness.cache.operations import diff, merge, pin, pin_from, verify
from harness.cache.timing_cache import (
    CacheEntry,
    Candidate,
    Provenance,
    TimingCache,
    check_compatible,
    normalize_hash,
)
from harness.errors import HarnessError
from harness.fileio import canonical_json, digest

PROV = Provenance(
    backend="tensorrt",
    backend_version="10.13.0.35",
    device="NVIDIA A100-SXM4-40GB (sm_80)",
    device_details={"driver": "550.54.15", "cuda": "12.4"},
    builder_options={"tf32": True, "optimization_level": 3},
)

CONV = (
    Candidate("sm80_conv_64x64", "0x8f86bebb2737", 0.0193),
    Candidate("sm80_conv_128x64", "0x6a6f0fb23c6f5", 0.0202),
    Candidate("ampere_cudnn_conv", "0xa2cec255404e4", 0.0216),
)
GEMM = (
    Candidate("sm80_gemm_32x32", "0x7a8d41bed440e", 0.0082),
    Candidate("sm80_gemm_32x32", "0x454f31af317", 0.0083),
    Candidate("sm80_gemm_64x32", "0x813e02ea68ef", 0.0115),
)
KEY_CONV = "0xa4c123b1612dd272d1371c17149d4395"
KEY_GEMM = "0x36b3216fdaeeb975729fae923d5a4fd1"
KEY_SOFTMAX = "0x2aabfe228f219e9cb0eb53f16947ccf2"


def entry_from(
    key: str, layer: str, candidates: tuple[Candidate, ...], pick: int = 0
) -> CacheEntry:
    c = candidates[pick]
    return CacheEntry(key, layer, c.tactic, c.tactic_hash, c.time_ms, candidates)


def make_cache(provenance: Provenance = PROV) -> TimingCache:
    return TimingCache(
        provenance,
        [
            entry_from(KEY_CONV, "conv1", CONV),
            entry_from(KEY_GEMM, "fc", GEMM),
            CacheEntry(KEY_SOFTMAX, "softmax", "__myl_softmax", "0x786e4d3cea27d2", 0.0041),
        ],
    )


# --- round trip and digest -------------------------------------------------------------


def test_save_load_round_trip_is_equal_and_digest_stable(tmp_path):
    cache = make_cache()
    path = tmp_path / "cache.json"
    cache.save(path)
    loaded = TimingCache.load(path)
    assert loaded == cache
    assert loaded.digest() == cache.digest()
    assert loaded.query_keys() == [KEY_CONV, KEY_GEMM, KEY_SOFTMAX]
    assert loaded.query(KEY_GEMM).candidates == GEMM
    # Saving the loaded cache again reproduces the file byte for byte.
    again = tmp_path / "again.json"
    loaded.save(again)
    assert again.read_bytes() == path.read_bytes()


def test_digest_is_sha256_of_canonical_payload_sorted_by_key():
    cache = make_cache()
    payload = cache.to_json()
    stored = payload.pop("digest")
    payload["entries"].sort(key=lambda e: e["key"])
    assert stored == digest(canonical_json(payload))
    assert stored.startswith("sha256:") and len(stored) == len("sha256:") + 64


def test_digest_ignores_insertion_order_but_not_content():
    cache = make_cache()
    reordered = TimingCache(PROV, list(reversed(cache.entries())))
    assert reordered.digest() == cache.digest()
    changed = make_cache()
    changed.update(entry_from(KEY_CONV, "conv1", CONV, pick=1))
    assert changed.digest() != cache.digest()
    other_options = make_cache(
        replace(PROV, builder_options={"tf32": False, "optimization_level": 3})
    )
    assert other_options.digest() != cache.digest()


@settings(max_examples=25, deadline=None)
@given(
    st.lists(
        st.tuples(
            st.text(min_size=1, max_size=12),
            st.text(max_size=12),
            st.integers(min_value=0, max_value=2**64 - 1),
            st.floats(min_value=0, max_value=1e6, allow_nan=False, allow_infinity=False),
        ),
        max_size=6,
        unique_by=lambda t: t[0],
    )
)
def test_json_round_trip_property(rows):
    entries = [
        CacheEntry(key, layer, f"t{h:x}", f"0x{h:x}", t, (Candidate(f"t{h:x}", f"0x{h:x}", t),))
        for key, layer, h, t in rows
    ]
    cache = TimingCache(PROV, entries)
    obj = json.loads(json.dumps(cache.to_json()))
    assert TimingCache.from_json(obj, "test") == cache


# --- corrupt and invalid files ------------------------------------------------------------


def saved(tmp_path, cache: TimingCache | None = None):
    path = tmp_path / "cache.json"
    (cache or make_cache()).save(path)
    return path


def test_tampered_file_is_detected(tmp_path):
    path = saved(tmp_path)
    obj = json.loads(path.read_text())
    obj["entries"][0]["tactic_hash"] = "0x6a6f0fb23c6f5"  # hand edit, digest left as it was
    path.write_text(json.dumps(obj))
    with pytest.raises(HarnessError, match="digest mismatch") as exc:
        TimingCache.load(path)
    assert str(path) in str(exc.value)


def test_truncated_file_names_the_file(tmp_path):
    path = saved(tmp_path)
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])
    with pytest.raises(HarnessError, match="not valid JSON") as exc:
        TimingCache.load(path)
    assert str(path) in str(exc.value)


def test_missing_file(tmp_path):
    with pytest.raises(HarnessError, match="no such file"):
        TimingCache.load(tmp_path / "absent.json")


def test_wrong_schema_version_says_what_is_supported(tmp_path):
    path = saved(tmp_path)
    obj = json.loads(path.read_text())
    obj["schema_version"] = 2
    path.write_text(json.dumps(obj))
    with pytest.raises(HarnessError, match=r"schema_version 2 is not supported .*version 1"):
        TimingCache.load(path)


def test_schema_violation_names_the_field(tmp_path):
    path = saved(tmp_path)
    obj = json.loads(path.read_text())
    del obj["entries"][1]["tactic"]
    path.write_text(json.dumps(obj))
    with pytest.raises(
        HarnessError, match=r"invalid at entries/1: 'tactic' is a required property"
    ):
        TimingCache.load(path)


def test_nan_time_in_file_is_rejected(tmp_path):
    path = saved(tmp_path)
    # json.dumps writes NaN and json.loads reads it back; JSON schema cannot catch it.
    obj = json.loads(path.read_text())
    obj["entries"][0]["time_ms"] = math.nan
    path.write_text(json.dumps(obj))
    with pytest.raises(HarnessError, match="NaN is not a number JSON allows"):
        TimingCache.load(path)


def test_duplicate_key_in_file_is_rejected(tmp_path):
    path = saved(tmp_path)
    obj = json.loads(path.read_text())
    obj["entries"].append(obj["entries"][0])
    path.write_text(json.dumps(obj))
    with pytest.raises(HarnessError, match=f"key {KEY_CONV} appears more than once"):
        TimingCache.load(path)


def test_entries_refuse_non_finite_times():
    with pytest.raises(HarnessError, match="layer 'conv1'"):
        CacheEntry(KEY_CONV, "conv1", "t", "0x1", math.nan)
    with pytest.raises(HarnessError, match="candidate 't'"):
        Candidate("t", "0x1", math.inf)


# --- container semantics -------------------------------------------------------------------


def test_update_inserts_and_replaces_remove_and_reset():
    cache = make_cache()
    new = CacheEntry("0x" + "1" * 32, "extra", "t", "0x1", 1.0)
    cache.update(new)
    assert cache.query_keys()[-1] == new.key
    replacement = entry_from(KEY_CONV, "conv1", CONV, pick=2)
    cache.update(replacement)
    assert cache.query(KEY_CONV) == replacement
    assert cache.query_keys()[0] == KEY_CONV  # replacing keeps the position
    assert cache.remove(new.key) is True
    assert cache.remove(new.key) is False
    assert cache.by_layer("fc") == [cache.query(KEY_GEMM)]
    cache.reset()
    assert len(cache) == 0 and cache.query(KEY_CONV) is None


# --- provenance -----------------------------------------------------------------------------


def test_mismatches_list_each_kernel_relevant_difference():
    other = replace(
        PROV,
        backend_version="10.14.1.48",
        device="NVIDIA H100 80GB HBM3 (sm_90)",
        device_details={"driver": "560.28.03"},
        builder_options={"tf32": False, "optimization_level": 3, "sparsity": True},
    )
    assert PROV.mismatches(other) == [
        "backend_version: 10.13.0.35 != 10.14.1.48",
        "device: NVIDIA A100-SXM4-40GB (sm_80) != NVIDIA H100 80GB HBM3 (sm_90)",
        "builder_options.sparsity: (unset) != True",
        "builder_options.tf32: True != False",
    ]
    # Driver / CUDA differences are shown but never block reuse.
    details_only = replace(PROV, device_details={"driver": "560.28.03"})
    assert PROV.mismatches(details_only) == []
    assert PROV.detail_differences(details_only) == [
        "device_details.cuda: 12.4 != (unset)",
        "device_details.driver: 550.54.15 != 560.28.03",
    ]


def test_check_compatible_refuses_with_differences_and_accepts_when_ignored():
    cache = make_cache(replace(PROV, builder_options={"tf32": False, "optimization_level": 3}))
    with pytest.raises(HarnessError) as exc:
        check_compatible(cache, PROV, ignore_mismatch=False, where="build")
    message = str(exc.value)
    assert message.startswith("build:")
    assert "builder_options.tf32: False != True" in message
    assert "--ignore-mismatch" in message
    check_compatible(cache, PROV, ignore_mismatch=True, where="build")
    check_compatible(make_cache(), PROV, ignore_mismatch=False, where="build")


def test_combine_adds_missing_keys_keeps_ours_and_checks_provenance():
    ours = TimingCache(PROV, [entry_from(KEY_CONV, "conv1", CONV, pick=0)])
    theirs = TimingCache(
        PROV, [entry_from(KEY_CONV, "conv1", CONV, pick=1), entry_from(KEY_GEMM, "fc", GEMM)]
    )
    assert ours.combine(theirs) == 1
    assert ours.query(KEY_CONV).tactic_hash == CONV[0].tactic_hash
    assert ours.query(KEY_GEMM) == theirs.query(KEY_GEMM)
    foreign = TimingCache(
        replace(PROV, device="NVIDIA L4 (sm_89)"), [entry_from(KEY_SOFTMAX, "s", CONV)]
    )
    with pytest.raises(HarnessError, match=r"device: NVIDIA L4 \(sm_89\) != NVIDIA A100"):
        ours.combine(foreign)
    assert ours.query(KEY_SOFTMAX) is None
    assert ours.combine(foreign, ignore_mismatch=True) == 1


# --- operations ---------------------------------------------------------------------------


def test_normalize_hash():
    assert normalize_hash("0x00AbC") == normalize_hash("abc") == "abc"
    assert normalize_hash("0x0") == "0"


def test_diff_reports_per_layer_status():
    a = make_cache()
    b = make_cache()
    b.update(replace(entry_from(KEY_CONV, "conv1", CONV, pick=1)))
    b.update(replace(b.query(KEY_GEMM), time_ms=0.5))  # time differs, tactic same
    b.remove(KEY_SOFTMAX)
    b.update(CacheEntry("0x" + "e" * 32, "head", "t", "0x9", 0.1))
    rows = diff(a, b)
    assert [(r.layer, r.status) for r in rows] == [
        ("conv1", "changed"),
        ("fc", "same"),
        ("softmax", "only-a"),
        ("head", "only-b"),
    ]
    conv = rows[0]
    assert (conv.tactic_a, conv.time_ms_a) == ("sm80_conv_64x64", 0.0193)
    assert (conv.tactic_b, conv.tactic_hash_b, conv.time_ms_b) == (
        "sm80_conv_128x64",
        "0x6a6f0fb23c6f5",
        0.0202,
    )
    assert rows[2].tactic_b is None and rows[3].tactic_a is None


def test_pin_by_name_and_by_hash_keeps_candidates():
    cache = make_cache()
    pinned = pin(cache, "conv1", "ampere_cudnn_conv")
    assert (pinned.tactic, pinned.tactic_hash, pinned.time_ms, pinned.pinned) == (
        "ampere_cudnn_conv",
        "0xa2cec255404e4",
        0.0216,
        True,
    )
    assert pinned.candidates == CONV
    assert cache.query(KEY_CONV) == pinned
    # Hash spelling does not matter; a duplicated kernel name is resolved by hash.
    by_hash = pin(cache, "fc", "0x0454F31AF317")
    assert by_hash.tactic_hash == "0x454f31af317"


def test_pin_unknown_layer_lists_valid_layers():
    cache = make_cache()
    with pytest.raises(
        HarnessError, match=r"no layer or key 'conv9'.*valid layers: conv1, fc, softmax"
    ):
        pin(cache, "conv9", "x")


def test_pin_unknown_tactic_lists_candidates_and_changes_nothing():
    cache = make_cache()
    before = cache.to_json()
    with pytest.raises(HarnessError) as exc:
        pin(cache, "conv1", "sm90_conv")
    message = str(exc.value)
    assert "'sm90_conv' is not one of its candidates" in message
    for c in CONV:
        assert f"{c.tactic} ({c.tactic_hash}" in message
    assert cache.to_json() == before


def test_pin_ambiguous_name_asks_for_a_hash():
    with pytest.raises(HarnessError, match=r"ambiguous \(hashes 0x7a8d41bed440e, 0x454f31af317\)"):
        pin(make_cache(), "fc", "sm80_gemm_32x32")


def test_pin_entry_without_candidates_is_refused():
    with pytest.raises(HarnessError, match="has no recorded candidates"):
        pin(make_cache(), "softmax", "__myl_softmax")


def test_pin_layer_with_several_keys_needs_the_key():
    cache = make_cache()
    cache.update(entry_from("0x" + "c" * 32, "conv1", CONV, pick=1))
    with pytest.raises(HarnessError, match="pin one of them by key"):
        pin(cache, "conv1", "sm80_conv_64x64")
    pinned = pin(cache, "0x" + "c" * 32, "sm80_conv_64x64")
    assert pinned.key == "0x" + "c" * 32 and pinned.tactic == "sm80_conv_64x64"


def test_pin_from_copies_selections_for_shared_keys():
    target = make_cache()
    source = make_cache()
    pin(source, "conv1", "sm80_conv_128x64")
    source.remove(KEY_SOFTMAX)
    source.update(CacheEntry("0x" + "d" * 32, "not-in-target", "t", "0x5", 1.0))
    assert pin_from(target, source) == ["conv1", "fc"]
    assert target.query(KEY_CONV).tactic == "sm80_conv_128x64"
    assert target.query(KEY_CONV).pinned and target.query(KEY_GEMM).pinned
    assert not target.query(KEY_SOFTMAX).pinned
    assert target.query("0x" + "d" * 32) is None


def test_pin_from_refuses_other_configuration_unless_ignored():
    target = make_cache()
    source = make_cache(replace(PROV, backend_version="10.8.0.43"))
    with pytest.raises(HarnessError, match="backend_version: 10.8.0.43 != 10.13.0.35"):
        pin_from(target, source)
    assert pin_from(target, source, ignore_mismatch=True) == ["conv1", "fc", "softmax"]


def test_merge_is_a_plus_missing_b_and_leaves_inputs_alone():
    a = TimingCache(PROV, [entry_from(KEY_CONV, "conv1", CONV, pick=0)])
    b = TimingCache(
        PROV, [entry_from(KEY_CONV, "conv1", CONV, pick=2), entry_from(KEY_GEMM, "fc", GEMM)]
    )
    merged = merge(a, b)
    assert merged.query_keys() == [KEY_CONV, KEY_GEMM]
    assert merged.query(KEY_CONV).tactic_hash == CONV[0].tactic_hash
    assert len(a) == 1 and len(b) == 2
    with pytest.raises(HarnessError, match="backend: cpu != tensorrt"):
        merge(a, TimingCache(replace(PROV, backend="cpu")))


def test_verify_accepts_names_or_hashes_and_reports_disagreement():
    cache = make_cache()
    agreeing = [
        ("conv1", KEY_CONV, "sm80_conv_64x64"),
        ("fc", KEY_GEMM, "0x7A8D41BED440E"),
    ]
    assert verify(cache, agreeing) == []
    problems = verify(
        cache,
        [("conv1", KEY_CONV, "ampere_cudnn_conv"), ("head", "0x" + "f" * 32, "t")],
    )
    assert problems == [
        f"layer 'conv1' (key {KEY_CONV}): engine uses 'ampere_cudnn_conv', cache selects "
        "'sm80_conv_64x64' (0x8f86bebb2737)",
        f"layer 'head': key {'0x' + 'f' * 32} is not in the cache (the builder timed it afresh)",
    ]
