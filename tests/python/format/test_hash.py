"""The content hash must equal Python's byte for byte (docs/format.md).

Datasets are written by hand (saev_reference) into directories named with
Python's own hash of their metadata; `shardcast info` must report the same
hash and hash_matches_dir, and `verify` must reject a misnamed directory.
"""

import json
import os
import shutil

import numpy as np
import pytest

import saev_reference as ref

FLOATS = [0.1, 1e-05, 1e16, 1e+300, -0.0, 2.5, 1e15, 0.0001, 1.5e-07, 5e-324,
          1.7976931348623157e308, 100.0, 123456789.123, -3.0e-10, 1 / 3, 2.0 ** 70,
          0.5e-4, 1e22, 9007199254740993.0, 1e-310]
INTS = [0, -1, 2 ** 31, 2 ** 53 + 1, 2 ** 63 - 1, -2 ** 63, 2 ** 64 - 1]
CONTROLS = "tab\tnl\ncr\rbs\bff\fnul\x00unit\x1fesc\x1bdel\x7fq\"bs\\sl/"
NESTED = {
    "zeta": {"b": [1, {"y": None, "x": "é"}], "a": []},
    "alpha": {},
    "Beta": [[], [[]], [True, False, None]],
    "日本": 1, "é": 2, "\uff21": 3, "😀": 4, "e": 5, "E": 6, "": 7, "~": 8,
    "\U0001F9EA": {"\u00ff": "\u0100", "a b": "c\td"},
}
WEIRD = {
    "text": "café ÉCOLE naïve Ωμέγα",
    "cjk": "日本語テキスト",
    "emoji": "😀 🚀 \U0001F9EA",
    "controls": CONTROLS,
    "separators": "\u2028\u2029\ufeff\u00a0",
    "floats": FLOATS,
    "ints": INTS,
    "flags": [True, False, None],
    "true": True, "false": False, "null": None,
    "nested": NESTED,
}

# (case id, variant, make_metadata keyword arguments)
CASES = []
for _v in ref.VARIANTS:
    CASES += [
        (f"{_v}-data-object", _v, {"data": dict(WEIRD, __class__="Weird😀")}),
        (f"{_v}-strings", _v, {"family": "clip", "ckpt": "hf-hub:timm/ViT-é-日本語-😀\x01",
                               "dataset": "/data/ünïcödé/日本/😀\t/x"}),
        (f"{_v}-extra-keys", _v, {"extra": {"zz_extra": NESTED, "aa_floats": FLOATS,
                                            "mm_flags": [True, False, None],
                                            "Émoji😀": CONTROLS}}),
    ]
CASES += [
    ("2.1-data-string", "2.1", {"data": "gASVNAAAAAAAAACMCGJ1aWx0aW5zlIwEZGljdJSTlCmBlC4="}),
    ("2.1-saev-pixel-agg", "2.1-saev", {"pixel_agg": "majority", "data": {"b": 1, "a": 2}}),
    ("1.0.0-cls-key", "1.0.0", {"data": {"__cls__": "Imagenet", "split": "val", "é": 0.1}}),
    ("1.1-pixel-agg", "1.0.0", {"protocol": "1.1", "extra": {"pixel_agg": None}}),
]


def small_acts(seed, n=2, n_layers=2, t=4, d=4):
    rng = np.random.default_rng(seed)
    return rng.standard_normal((n, n_layers, t, d)).astype(np.float32)


def write_case(tmp_path, variant, kwargs, json_style="indent4", dir_name=None):
    acts = small_acts(7)
    return ref.write_dataset(tmp_path, variant, acts, [-2, 6], True, budget=64,
                             json_style=json_style, dir_name=dir_name, **kwargs)


def test_python_reference_spellings():
    # Sanity of the oracle itself: these are the spellings Python produces.
    assert json.dumps(FLOATS[:6]) == "[0.1, 1e-05, 1e+16, 1e+300, -0.0, 2.5]"
    assert ref.sorted_key_json({"b": 1, "a": "é😀"}) == '{"a":"\\u00e9\\ud83d\\ude00","b":1}'
    assert json.dumps({"x": "é\x7f\n"}, ensure_ascii=False) == '{"x": "é\x7f\\n"}'


@pytest.mark.parametrize("json_style", ["indent4", "compact_raw"])
@pytest.mark.parametrize("case_id,variant,kwargs", CASES, ids=[c[0] for c in CASES])
def test_info_reports_python_hash(cli, tmp_path, case_id, variant, kwargs, json_style):
    path, md, _ = write_case(tmp_path, variant, kwargs, json_style)
    expected = ref.content_hash(variant, md)
    assert os.path.basename(path) == expected
    info = cli.json("info", path)
    assert info["variant"] == variant
    assert info["hash"] == expected, (
        f"python hashes {ref.sorted_key_json(md)!r}" if variant != "2.1-saev" else
        f"python hashes {json.dumps(md, separators=(',', ':'), ensure_ascii=False)!r}")
    assert info["hash_matches_dir"] is True
    cli.ok("verify", path)


def test_saev_variant_hash_is_file_order_not_sorted(cli, tmp_path):
    # Same content, keys of `data` in two orders: sorted-key hashes agree,
    # saev's file-order hashes differ, and each directory matches its own.
    a, md_a, _ = write_case(tmp_path / "a", "2.1-saev", {"data": {"x": 1, "b": "é"}})
    b, md_b, _ = write_case(tmp_path / "b", "2.1-saev", {"data": {"b": "é", "x": 1}})
    assert ref.sorted_key_hash(md_a) == ref.sorted_key_hash(md_b)
    assert os.path.basename(a) != os.path.basename(b)
    for path in (a, b):
        info = cli.json("info", path)
        assert info["hash"] == os.path.basename(path)
        assert len(info["hash"]) == 8
        assert info["hash_matches_dir"] is True


ODD_NUMBERS_TEXT = (
    '[1E16, 2.50, 1e-5, -0.0, 100.000, 1.0E+300, 0.000001, -0, 0.1000000000000000055511151231257827,'
    ' 12345678901234567890, 1e0, 0e10, 4.9406564584124654e-324, 123456789012345.6789,'
    ' "\\u00e9\\ud83d\\ude00\\u65e5\\/\\u001f\\u007f\\u2028", true, false, null]')


@pytest.mark.parametrize("variant", ref.VARIANTS)
def test_numbers_and_escapes_are_renormalised_like_python(cli, tmp_path, variant):
    # metadata.json spelled unlike Python would write it: the hash is of
    # Python's re-serialisation of the parsed values, not of the file text.
    acts = small_acts(3)
    geom = ref.Geometry([-2, 6], 3, True, 4, 2, 64)
    md = ref.make_metadata(variant, geom)
    text = json.dumps(md, indent=1, ensure_ascii=False)
    assert text.endswith("\n}")
    text = text[:-2] + ',\n "odd": ' + ODD_NUMBERS_TEXT + '\n}\n'
    parsed = json.loads(text)
    expected = ref.content_hash(variant, parsed)
    path, _, _ = ref.write_dataset(tmp_path, variant, acts, [-2, 6], True, 64, metadata=parsed,
                                   dir_name=expected)
    with open(os.path.join(path, "metadata.json"), "w", encoding="utf-8") as f:
        f.write(text)
    info = cli.json("info", path)
    assert info["hash"] == expected, (
        f"python re-serialises the odd numbers as {json.dumps(parsed['odd'])}")
    assert info["hash_matches_dir"] is True


@pytest.mark.parametrize("big", [123456789012345678901234567890, -(2 ** 64), 2 ** 64, 10 ** 40])
def test_integers_beyond_64_bits_never_give_a_wrong_hash(cli, tmp_path, big):
    # Python keeps arbitrary-precision integers exactly in json.dumps. A
    # reader limited to 64-bit integers may refuse such metadata with a clear
    # error naming the number, but must never report a different hash.
    path, md, _ = write_case(tmp_path, "2.1", {"extra": {"big": [1, big]}})
    proc = cli.run("info", path, "--json")
    if proc.returncode == 0:
        info = json.loads(proc.out)
        assert info["hash"] == ref.sorted_key_hash(md), (
            f"python hashes ...{ref.sorted_key_json(md)[-80:]!r}")
        assert info["hash_matches_dir"] is True
    else:
        assert proc.returncode == 1 and str(big) in proc.err, cli.describe(proc)


@pytest.mark.parametrize("variant", ref.VARIANTS)
def test_wrong_directory_name_is_reported(cli, tmp_path, variant):
    path, md, _ = write_case(tmp_path, variant, {"data": dict(WEIRD, __class__="X")})
    good = os.path.basename(path)
    wrong = good[:-1] + ("0" if good[-1] != "0" else "1")
    wrong_path = os.path.join(tmp_path, wrong)
    shutil.move(path, wrong_path)
    info = cli.json("info", wrong_path)
    assert info["hash"] == good
    assert info["hash_matches_dir"] is False
    proc = cli.fails("verify", wrong_path, stderr_required=False)
    assert good in proc.out + proc.err, "verify should name the expected hash"

    renamed = os.path.join(tmp_path, "my-dataset")
    shutil.move(wrong_path, renamed)
    assert cli.json("info", renamed)["hash_matches_dir"] is False
    cli.fails("verify", renamed, stderr_required=False)
    res = cli.fails("verify", renamed, "--json", stderr_required=False)
    report = json.loads(res.out)
    assert report["ok"] is False and report["problems"]


@pytest.mark.parametrize("variant", ref.VARIANTS)
def test_edited_metadata_no_longer_matches(cli, tmp_path, variant):
    # Config drift: a correctly named dataset whose metadata is edited later.
    path, md, _ = write_case(tmp_path, variant, {})
    md2 = dict(md)
    key = "ckpt" if "ckpt" in md2 else "vit_ckpt"
    md2[key] = md2[key] + "-finetuned"
    ref.write_json(os.path.join(path, "metadata.json"), md2)
    info = cli.json("info", path)
    assert info["hash"] == ref.content_hash(variant, md2)
    assert info["hash_matches_dir"] is False
    cli.fails("verify", path, stderr_required=False)
