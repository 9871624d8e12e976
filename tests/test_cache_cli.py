"""``harness cache ...`` through the real entry point: output, files written, exit codes."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest
from test_timing_cache import KEY_CONV, KEY_GEMM, KEY_SOFTMAX, PROV, make_cache

from harness.cache.timing_cache import CacheEntry, TimingCache
from harness.cli import main as cli_main


@pytest.fixture(autouse=True)
def only_cache_subcommand(monkeypatch):
    # Exercise main() exactly as users do, without depending on other subcommand modules.
    assert "harness.cli.cache_cmd" in cli_main.SUBCOMMAND_MODULES
    monkeypatch.setattr(cli_main, "SUBCOMMAND_MODULES", ("harness.cli.cache_cmd",))


def run(capsys, *argv: str) -> tuple[int, str, str]:
    code = cli_main.main(["cache", *map(str, argv)])
    out, err = capsys.readouterr()
    return code, out, err


@pytest.fixture
def cache_file(tmp_path):
    path = tmp_path / "cache.json"
    make_cache().save(path)
    return path


def test_show_table_and_json(capsys, cache_file):
    code, out, _ = run(capsys, "show", cache_file)
    assert code == 0
    assert f"3 entries, {make_cache().digest()}" in out
    assert "builder option tf32: True" in out
    lines = out.splitlines()
    conv_row = next(line for line in lines if line.startswith("conv1"))
    assert KEY_CONV in conv_row and "sm80_conv_64x64" in conv_row and "0x8f86bebb2737" in conv_row
    code, out, _ = run(capsys, "show", cache_file, "--json")
    assert code == 0
    assert json.loads(out) == json.loads(cache_file.read_text())


def test_diff_exits_zero_and_reports_changes(capsys, tmp_path, cache_file):
    other = make_cache(replace(PROV, device_details={"driver": "560.28.03", "cuda": "12.4"}))
    other.update(
        replace(other.query(KEY_CONV), tactic="sm80_conv_128x64", tactic_hash="0x6a6f0fb23c6f5")
    )
    other.remove(KEY_SOFTMAX)
    b = tmp_path / "b.json"
    other.save(b)
    code, out, _ = run(capsys, "diff", cache_file, b)
    assert code == 0
    assert "provenance device_details.driver: 550.54.15 != 560.28.03" in out
    assert "1 same, 1 changed, 1 only-a, 0 only-b" in out
    code, out, _ = run(capsys, "diff", cache_file, b, "--json")
    report = json.loads(out)
    assert [(r["layer"], r["status"]) for r in report["layers"]] == [
        ("conv1", "changed"),
        ("fc", "same"),
        ("softmax", "only-a"),
    ]
    assert report["provenance"] == []


def test_pin_layers_in_place(capsys, cache_file):
    code, out, _ = run(
        capsys,
        "pin",
        cache_file,
        "--layer",
        "conv1=ampere_cudnn_conv",
        "--layer",
        "fc=0x454f31af317",
    )
    assert code == 0
    assert "pinned 2 entries" in out
    cache = TimingCache.load(cache_file)
    assert cache.query(KEY_CONV).tactic == "ampere_cudnn_conv" and cache.query(KEY_CONV).pinned
    assert cache.query(KEY_GEMM).tactic_hash == "0x454f31af317"
    assert not cache.query(KEY_SOFTMAX).pinned


def test_pin_to_output_leaves_input_untouched(capsys, tmp_path, cache_file):
    before = cache_file.read_bytes()
    out_path = tmp_path / "pinned.json"
    code, _, _ = run(capsys, "pin", cache_file, "--layer", "conv1=sm80_conv_128x64", "-o", out_path)
    assert code == 0
    assert cache_file.read_bytes() == before
    assert TimingCache.load(out_path).query(KEY_CONV).tactic == "sm80_conv_128x64"


def test_pin_layer_name_with_equals_sign(capsys, tmp_path):
    path = tmp_path / "c.json"
    cache = make_cache()
    conv = cache.query(KEY_CONV)
    cache.update(replace(conv, layer="a=b"))
    cache.save(path)
    code, _, err = run(capsys, "pin", path, "--layer", "a=b=sm80_conv_128x64")
    assert code == 0, err
    assert TimingCache.load(path).query(KEY_CONV).tactic == "sm80_conv_128x64"


@pytest.mark.parametrize(
    ("spec", "expected"),
    [
        ("conv9=x", "valid layers: conv1, fc, softmax"),
        ("conv1=sm90_conv", "valid tactics: sm80_conv_64x64 (0x8f86bebb2737"),
        ("conv1", "--layer expects NAME=TACTIC"),
    ],
)
def test_pin_errors_exit_2_and_write_nothing(capsys, cache_file, spec, expected):
    before = cache_file.read_bytes()
    # A valid first spec must not be written either when a later one fails.
    code, out, err = run(
        capsys, "pin", cache_file, "--layer", "fc=sm80_gemm_64x32", "--layer", spec
    )
    assert code == 2
    assert err.startswith("error: ") and expected in err
    assert cache_file.read_bytes() == before


@pytest.mark.parametrize("damage", ["truncate", "tamper"])
def test_corrupt_cache_is_never_overwritten_by_pin(capsys, cache_file, damage):
    if damage == "truncate":
        cache_file.write_bytes(cache_file.read_bytes()[:200])
    else:
        obj = json.loads(cache_file.read_text())
        obj["entries"][0]["tactic"] = "edited by hand"
        cache_file.write_text(json.dumps(obj, indent=2))
    before = cache_file.read_bytes()
    code, _, err = run(capsys, "pin", cache_file, "--layer", "conv1=sm80_conv_128x64")
    assert code == 2
    assert str(cache_file) in err
    assert cache_file.read_bytes() == before
    assert [p.name for p in cache_file.parent.iterdir()] == [cache_file.name]


def test_pin_from_other_cache(capsys, tmp_path, cache_file):
    source = make_cache()
    source.update(
        replace(source.query(KEY_CONV), tactic="sm80_conv_128x64", tactic_hash="0x6a6f0fb23c6f5")
    )
    src = tmp_path / "src.json"
    source.save(src)
    code, out, _ = run(capsys, "pin", cache_file, "--from", src)
    assert code == 0
    assert "pinned 3 entries" in out
    loaded = TimingCache.load(cache_file)
    assert loaded.query(KEY_CONV).tactic_hash == "0x6a6f0fb23c6f5"
    assert all(e.pinned for e in loaded.entries())


def test_pin_from_mismatched_cache_needs_flag(capsys, tmp_path, cache_file):
    src = tmp_path / "src.json"
    make_cache(replace(PROV, device="NVIDIA H100 (sm_90)")).save(src)
    before = cache_file.read_bytes()
    code, _, err = run(capsys, "pin", cache_file, "--from", src)
    assert code == 2
    assert "device: NVIDIA H100 (sm_90) != NVIDIA A100-SXM4-40GB (sm_80)" in err
    assert "--ignore-mismatch" in err
    # one line that names both files: the foreign source and the cache it was to go into
    assert err.count("\n") == 1 and f"timing cache {src} (pinned into {cache_file})" in err, err
    assert cache_file.read_bytes() == before
    code, _, _ = run(capsys, "pin", cache_file, "--from", src, "--ignore-mismatch")
    assert code == 0
    # The cache keeps its own provenance and says which entries came from where.
    kept = TimingCache.load(cache_file).provenance
    assert kept.device == PROV.device
    assert kept.device_details["entries_from_other_configurations"] == [
        f"timing cache {src} (pinned into {cache_file}): device: NVIDIA H100 (sm_90) != NVIDIA A100-SXM4-40GB (sm_80)"
    ]


def test_pin_from_without_shared_keys_is_an_error(capsys, tmp_path, cache_file):
    src = tmp_path / "src.json"
    TimingCache(PROV, [CacheEntry("0x" + "9" * 32, "other", "t", "0x1", 1.0)]).save(src)
    code, _, err = run(capsys, "pin", cache_file, "--from", src)
    assert code == 2 and "shares no key" in err


def test_pin_requires_layer_or_from(capsys, cache_file):
    with pytest.raises(SystemExit) as exc:
        cli_main.main(["cache", "pin", str(cache_file)])
    assert exc.value.code == 2


def test_merge(capsys, tmp_path, cache_file):
    b_cache = TimingCache(
        PROV,
        [
            replace(make_cache().query(KEY_CONV), tactic="x", tactic_hash="0x77"),
            CacheEntry("0x" + "b" * 32, "extra", "t", "0x2", 0.3),
        ],
    )
    b = tmp_path / "b.json"
    b_cache.save(b)
    out_path = tmp_path / "merged.json"
    code, out, _ = run(capsys, "merge", cache_file, b, "-o", out_path)
    assert code == 0
    assert "1 conflicting keys kept" in out
    merged = TimingCache.load(out_path)
    assert merged.query_keys() == [KEY_CONV, KEY_GEMM, KEY_SOFTMAX, "0x" + "b" * 32]
    assert merged.query(KEY_CONV).tactic == "sm80_conv_64x64"


def test_merge_mismatch_refused_then_ignored(capsys, tmp_path, cache_file):
    b = tmp_path / "b.json"
    make_cache(replace(PROV, builder_options={"tf32": False, "optimization_level": 3})).save(b)
    out_path = tmp_path / "merged.json"
    code, _, err = run(capsys, "merge", cache_file, b, "-o", out_path)
    assert code == 2 and "builder_options.tf32: False != True" in err
    assert err.count("\n") == 1 and f"cannot merge timing cache {b} (merged into {cache_file})" in err, err
    assert not out_path.exists()
    code, _, _ = run(capsys, "merge", cache_file, b, "-o", out_path, "--ignore-mismatch")
    assert code == 0 and out_path.exists()
    notes = TimingCache.load(out_path).provenance.device_details["entries_from_other_configurations"]
    assert notes == [f"timing cache {b} (merged into {cache_file}): builder_options.tf32: False != True"]


def test_verify_bad_engine_path_exits_2(capsys, tmp_path, cache_file):
    code, _, err = run(capsys, "verify", cache_file, "--engine", tmp_path / "nope")
    assert code == 2 and f"engine {tmp_path / 'nope'}: no such engine directory" in err
