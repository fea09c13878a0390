"""`shardcast import pkl` checked against fixtures written by Python itself.

Seed-002 sources (metadata.json + shard_NNNN.pkl.gz) are written here with
Python's gzip, pickle (protocols 2, 4, 5), numpy and hashlib; the resulting
saev dataset is read back with saev_reference's numpy reader (memmap at the
protocol offsets) and compared with the arrays the fixture pickled. Nothing
expected comes from the project's C++ code.

Mapping under test: example = sample (shard order, then list order), layer
value = the N of "layer_N", token = sequence position (no CLS), padding to
max_seq_length with zero vectors labelled 255 in labels.bin (real tokens 0).
"""

import builtins
import gzip
import json
import os
import pickle
import pickletools
import signal
import subprocess
import time

import numpy as np
import pytest

import saev_reference as ref
from conftest import assert_no_crash
from pkl_reference import PAD_LABEL, TOKEN_LABEL, make_source, sha256_file


def run_import(cli, src, root, *extra):
    return cli.json("import", "pkl", src.path, root, *extra)


def leftovers(root):
    """Everything in ROOT: datasets and writer temporaries."""
    return sorted(os.listdir(root)) if os.path.isdir(root) else []


def check_dataset(out, src, layers=None, tokens=None, budget_examples=None):
    """The dataset at out["path"] holds exactly what the source pickled."""
    path = out["path"]
    layers = list(layers or src.layers)
    md, shards, geom = ref.open_dataset(path)
    assert md["protocol"] == "2.1" and md["dtype"] == "float32"
    assert md["layers"] == layers
    assert md["cls_token"] is False
    assert md["d_model"] == src.hidden
    assert md["n_examples"] == len(src.samples)
    assert md["dataset"] == os.path.realpath(src.path)
    assert md["family"] == "qwen2" and md["ckpt"] == "Qwen/Qwen2.5-7B"
    assert os.path.basename(path) == ref.content_hash("2.1", md) == out["hash"]
    if budget_examples is not None:
        assert geom.S == budget_examples
        assert len(shards) == -(-len(src.samples) // budget_examples)
    want_acts, want_labels = src.expected(layers, tokens)
    assert md["patches_per_ex"] == want_acts.shape[2]
    ref.assert_f32_equal(ref.load_all(path), want_acts, "activations")
    np.testing.assert_array_equal(ref.load_labels(path, geom), want_labels)
    # A few vectors through the protocol's offset arithmetic as well.
    for e in (0, len(src.samples) - 1):
        for li, layer in enumerate(layers):
            ref.assert_f32_equal(ref.read_example_layer(path, geom, e, layer),
                                 want_acts[e, li], f"example {e} layer {layer}")

    with open(os.path.join(path, "samples.json"), encoding="utf-8") as f:
        side = json.load(f)
    assert side["format"] == "shardcast.samples/1"
    assert side["padding_label"] == PAD_LABEL and side["token_label"] == TOKEN_LABEL
    assert side["layers"] == layers
    assert side["tokens_per_example"] == want_acts.shape[2]
    assert side["source"] == os.path.realpath(src.path)
    assert len(side["samples"]) == len(src.samples)
    for e, (got, want) in enumerate(zip(side["samples"], src.samples)):
        assert got["example"] == e
        assert got["sample_idx"] == want["sample_idx"]
        assert got["dataset_idx"] == want["dataset_idx"]
        assert got["seq_len"] == want["seq_len"]
        assert got["shard"] == want["shard"]
        assert got["text_preview"] == want["text_preview"]
        assert got["metadata"]["token_count"] == want["seq_len"]
    # One sample per line, as documented.
    with open(os.path.join(path, "samples.json"), encoding="utf-8") as f:
        lines = f.read().splitlines()
    assert len(lines) == len(src.samples) + 2
    # The writer's checksums cover the data files.
    proc = subprocess.run(["sha256sum", "--strict", "-c", "SHA256SUMS"], cwd=path,
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, timeout=60)
    assert proc.returncode == 0, proc.stdout.decode()


# --------------------------------------------------------------------------
# Correct imports.

@pytest.mark.parametrize("protocol", [2, 4, 5])
def test_import_protocols_variable_lengths_several_shards(cli, tmp_path, protocol):
    src = make_source(tmp_path / "src", protocol=protocol, seq_lens=((5, 3, 8), (2, 6), (1,)),
                      seed=protocol)
    root = tmp_path / "root"
    # Budget 48 = 3 examples of 8 tokens x 2 layers per saev shard, so the
    # output spans several shards too.
    out = run_import(cli, src, root, "--budget", "48")
    assert out["reused"] is False
    assert out["n_examples"] == 6 and out["padding_label"] == PAD_LABEL
    check_dataset(out, src, budget_examples=3)
    assert leftovers(root) == [out["hash"]]
    cli.ok("verify", out["path"])


def test_layers_subset_in_given_order(cli, tmp_path):
    src = make_source(tmp_path / "src", layers=(3, 7, 11), seed=1)
    out = run_import(cli, src, tmp_path / "root", "--layers", "11,3")
    check_dataset(out, src, layers=[11, 3])


def test_max_seq_length_option_pads_further(cli, tmp_path):
    src = make_source(tmp_path / "src", seed=2)
    out = run_import(cli, src, tmp_path / "root", "--max-seq-length", "13")
    check_dataset(out, src, tokens=13)


def test_sequence_longer_than_max_seq_length_is_an_error(cli, tmp_path):
    src = make_source(tmp_path / "src", seq_lens=((4, 9),), max_seq_length=8, seed=3)
    root = tmp_path / "root"
    proc = cli.fails("import", "pkl", src.path, root)
    assert "9 tokens, more than max_seq_length = 8" in proc.err
    assert "--max-seq-length" in proc.err
    assert leftovers(root) == []


def test_without_counts_layers_or_lengths_in_metadata(cli, tmp_path):
    # num_samples, layers and max_seq_length absent: a first pass finds them
    # (layers sorted by value, tokens = the longest sequence).
    src = make_source(tmp_path / "src", layers=(20, 4), seq_lens=((3, 5), (7,)),
                      in_metadata=False, seed=4)
    proc = cli.run("import", "pkl", src.path, tmp_path / "root", "--json")
    assert proc.returncode == 0, cli.describe(proc)
    assert "first pass" in proc.err
    out = json.loads(proc.out)
    assert out["layers"] == [4, 20] and out["tokens_per_example"] == 7
    check_dataset(out, src, layers=[4, 20], tokens=7)


def test_float16_is_widened_exactly(cli, tmp_path):
    src = make_source(tmp_path / "src", dtype=np.float16, seed=5)
    out = run_import(cli, src, tmp_path / "root")
    check_dataset(out, src)


@pytest.mark.parametrize("protocol", [2, 5])
def test_big_endian_and_fortran_arrays(cli, tmp_path, protocol):
    def odd_layout(a):
        big = a.astype(">f4")
        return np.asfortranarray(big) if a.shape[0] % 2 else big
    src = make_source(tmp_path / "src", protocol=protocol, array_fn=odd_layout, seed=6)
    out = run_import(cli, src, tmp_path / "root")
    check_dataset(out, src)


def test_second_import_reuses_identical_dataset(cli, tmp_path):
    src = make_source(tmp_path / "src", seed=7)
    root = tmp_path / "root"
    first = run_import(cli, src, root)
    second = run_import(cli, src, root)
    assert second["path"] == first["path"] and second["reused"] is True
    assert leftovers(root) == [first["hash"]]
    check_dataset(second, src)


def test_help_documents_padding_label_and_mapping(cli):
    proc = cli.ok("import", "--help")
    for text in ("255", "exclude_labels", "layer_<idx>", "samples.json", "sha256",
                 "max-seq-length", "no CLS"):
        assert text in proc.out, text
    assert "import" in cli.ok("--help").out


# --------------------------------------------------------------------------
# Refusals: clean errors, nothing executed, nothing left in ROOT.

def global_name(data):
    """module.name of the first GLOBAL / STACK_GLOBAL in a pickle."""
    strings = []
    for op, arg, _ in pickletools.genops(data):
        if op.name == "GLOBAL":
            return arg.replace(" ", ".")
        if op.name in ("SHORT_BINUNICODE", "BINUNICODE", "BINUNICODE8"):
            strings.append(arg)
        if op.name == "STACK_GLOBAL":
            return f"{strings[-2]}.{strings[-1]}"
    raise AssertionError("no global in the pickle")


class _Reduce:
    def __init__(self, fn, args):
        self.fn, self.args = fn, args

    def __reduce__(self):
        return (self.fn, self.args)


@pytest.mark.parametrize("protocol", [2, 4, 5])
@pytest.mark.parametrize("kind", ["system", "eval", "popen"])
def test_malicious_pickle_is_refused_and_not_run(cli, tmp_path, protocol, kind):
    marker = tmp_path / "pwned"
    evil = {
        "system": _Reduce(os.system, (f"touch {marker}",)),
        "eval": _Reduce(builtins.eval, (f"open({str(marker)!r}, 'w')",)),
        "popen": _Reduce(subprocess.Popen, (["touch", str(marker)],)),
    }[kind]
    # The name as pickle writes it: os.system is posix.system on Linux, and
    # protocol 2 uses Python 2 names (fix_imports: __builtin__.eval, ...).
    name = global_name(pickle.dumps(evil, protocol=protocol))
    assert name.split(".")[-1] in ("system", "eval", "Popen"), name
    src = make_source(tmp_path / "src", protocol=protocol, seq_lens=((2,), (3,)), seed=8)
    # Shard 2 carries the payload in a sample's metadata; its checksum is
    # correct, so only the unpickler stands in the way.
    fpath = os.path.join(src.path, "shard_0002.pkl.gz")
    with gzip.open(fpath, "rb") as f:
        data = pickle.load(f)
    data["layer_16"][0]["metadata"]["payload"] = evil
    with gzip.open(fpath, "wb") as f:
        pickle.dump(data, f, protocol=protocol)
    src.metadata["shards"][1]["checksum"] = "sha256:" + sha256_file(fpath)
    src.write_metadata()
    root = tmp_path / "root"
    proc = cli.fails("import", "pkl", src.path, root)
    assert f"refusing to load global '{name}'" in proc.err, proc.err
    assert "shard_0002.pkl.gz" in proc.err
    time.sleep(0.2)  # a spawned command would have had time to run
    assert not marker.exists(), "the pickle's payload ran"
    assert leftovers(root) == [], "a failed import left files in ROOT"


def test_checksum_mismatch_names_the_shard(cli, tmp_path):
    src = make_source(tmp_path / "src", seq_lens=((2,), (3,), (1,)), seed=9)
    # Shard 2 is replaced by another valid shard: only the digest tells.
    fpath = os.path.join(src.path, "shard_0002.pkl.gz")
    with gzip.open(fpath, "rb") as f:
        data = pickle.load(f)
    data["layer_15"][0]["activation"][0, 0] += 1
    with gzip.open(fpath, "wb") as f:
        pickle.dump(data, f, protocol=4)
    root = tmp_path / "root"
    proc = cli.fails("import", "pkl", src.path, root)
    assert "shard_0002.pkl.gz" in proc.err and "checksum mismatch" in proc.err
    assert sha256_file(fpath) in proc.err
    assert src.metadata["shards"][1]["checksum"].split(":")[1] in proc.err
    assert leftovers(root) == []


@pytest.mark.parametrize("keep", [0.5, 0.99])
def test_truncated_gzip_is_a_clear_error(cli, tmp_path, keep):
    src = make_source(tmp_path / "src", seq_lens=((2,), (3,)), seed=10)
    fpath = os.path.join(src.path, "shard_0002.pkl.gz")
    with open(fpath, "rb") as f:
        data = f.read()
    with open(fpath, "wb") as f:
        f.write(data[:int(len(data) * keep)])
    root = tmp_path / "root"
    # With the old checksum: the digest catches it first.
    proc = cli.fails("import", "pkl", src.path, root)
    assert "checksum mismatch" in proc.err and "shard_0002.pkl.gz" in proc.err
    # With a checksum of the truncated file: the gzip decoder does.
    src.metadata["shards"][1]["checksum"] = "sha256:" + sha256_file(fpath)
    src.write_metadata()
    proc = cli.fails("import", "pkl", src.path, root)
    assert "shard_0002.pkl.gz" in proc.err and "gzip" in proc.err
    assert "truncated" in proc.err
    assert leftovers(root) == []


def test_corrupt_gzip_is_a_clear_error(cli, tmp_path):
    src = make_source(tmp_path / "src", seq_lens=((2,),), seed=11)
    fpath = os.path.join(src.path, "shard_0001.pkl.gz")
    data = bytearray(open(fpath, "rb").read())
    data[-6] ^= 0xFF  # the CRC-32 trailer
    open(fpath, "wb").write(bytes(data))
    src.metadata["shards"][0]["checksum"] = "sha256:" + sha256_file(fpath)
    src.write_metadata()
    proc = cli.fails("import", "pkl", src.path, tmp_path / "root")
    assert "gzip" in proc.err and "corrupt" in proc.err and "shard_0001" in proc.err


def test_missing_metadata_json(cli, tmp_path):
    (tmp_path / "empty").mkdir()
    proc = cli.fails("import", "pkl", tmp_path / "empty", tmp_path / "root")
    assert "metadata.json not found" in proc.err
    assert leftovers(tmp_path / "root") == []


def test_missing_shard_is_named_before_anything_is_written(cli, tmp_path):
    src = make_source(tmp_path / "src", seq_lens=((2,), (3,), (1,)), seed=12)
    os.unlink(os.path.join(src.path, "shard_0003.pkl.gz"))
    proc = cli.fails("import", "pkl", src.path, tmp_path / "root")
    assert "missing shard" in proc.err and "shard_0003.pkl.gz" in proc.err
    assert leftovers(tmp_path / "root") == []


@pytest.mark.parametrize("dtype", ["float64", "int32"])
def test_wrong_dtype_is_refused(cli, tmp_path, dtype):
    src = make_source(tmp_path / "src", seq_lens=((2, 3),), seed=13,
                      array_fn=lambda a: a.astype(dtype))
    proc = cli.fails("import", "pkl", src.path, tmp_path / "root")
    assert f"dtype {dtype}" in proc.err and "float32" in proc.err
    assert "shard_0001.pkl.gz" in proc.err


def test_inconsistent_hidden_size(cli, tmp_path):
    src = make_source(tmp_path / "src", seq_lens=((2, 3), (4,)), seed=14)
    fpath = os.path.join(src.path, "shard_0002.pkl.gz")
    with gzip.open(fpath, "rb") as f:
        data = pickle.load(f)
    data["layer_16"][0]["activation"] = np.zeros((4, src.hidden + 1), np.float32)
    with gzip.open(fpath, "wb") as f:
        pickle.dump(data, f, protocol=4)
    src.metadata["shards"][1]["checksum"] = "sha256:" + sha256_file(fpath)
    src.write_metadata()
    proc = cli.fails("import", "pkl", src.path, tmp_path / "root")
    assert "inconsistent hidden size" in proc.err
    assert "shard_0002.pkl.gz" in proc.err and "layer_16" in proc.err
    assert f"[4, {src.hidden + 1}]" in proc.err
    assert leftovers(tmp_path / "root") == []


def test_hidden_size_disagreeing_with_metadata(cli, tmp_path):
    src = make_source(tmp_path / "src", seed=15)
    src.metadata["extraction_config"]["model_params"]["hidden_size"] = 4096
    src.write_metadata()
    proc = cli.fails("import", "pkl", src.path, tmp_path / "root")
    assert "inconsistent hidden size" in proc.err and "4096" in proc.err


def test_sample_count_disagreeing_with_metadata(cli, tmp_path):
    src = make_source(tmp_path / "src", seq_lens=((2, 3), (4,)), seed=16)
    src.metadata["shards"][1]["num_samples"] = 2
    src.write_metadata()
    proc = cli.fails("import", "pkl", src.path, tmp_path / "root")
    assert "shard_0002.pkl.gz holds 1 samples" in proc.err and "num_samples = 2" in proc.err


def test_shard_path_must_stay_inside_dir(cli, tmp_path):
    src = make_source(tmp_path / "src", seq_lens=((2,),), seed=17)
    src.metadata["shards"][0]["filename"] = "../outside.pkl.gz"
    src.write_metadata()
    proc = cli.fails("import", "pkl", src.path, tmp_path / "root")
    assert "plain file name" in proc.err


def test_usage_errors(cli, tmp_path):
    cli.fails("import", "npz", tmp_path, tmp_path / "root", code=2)
    cli.fails("import", "pkl", tmp_path, code=2)
    cli.fails("import", "pkl", tmp_path, tmp_path / "r", "--max-seq-length", "0", code=2)


# --------------------------------------------------------------------------
# Crash and resume.

def test_killed_import_then_rerun_succeeds(shardcast_bin, cli, tmp_path):
    # 24 shards of ~1.5 MB: the import is SIGKILLed right after it reports
    # the first shard, with most of the work still ahead.
    src = make_source(tmp_path / "src", hidden=512, max_seq_length=128,
                      seq_lens=[(128, 80, 128, 33)] * 24, seed=18, compresslevel=1)
    root = tmp_path / "root"
    proc = subprocess.Popen([str(shardcast_bin), "import", "pkl", src.path, str(root)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        seen = b""
        while b"shard 1/24" not in seen:
            line = proc.stderr.readline()
            assert line, f"import ended early: {seen.decode()}"
            seen += line
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == -signal.SIGKILL
    left = leftovers(root)
    assert left and all(x.startswith(".shardcast-tmp-") for x in left), left

    rerun = cli.run("import", "pkl", src.path, root, "--json", timeout=300)
    assert rerun.returncode == 0, cli.describe(rerun)
    assert_no_crash(rerun)
    assert "left by an interrupted run" in rerun.err
    out = json.loads(rerun.out)
    assert leftovers(root) == [out["hash"]], "the killed run's directory is still there"
    check_dataset(out, src)


# ---------------------------------------------------------------------------
# Bounded memory (issue 42): a shard may inflate only to what metadata.json
# says it holds, the memo is capped, and running out of memory anyway is an
# error, never an abort. The limits are the kernel's (RLIMIT_AS), set in the
# child; a sanitizer build reserves terabytes of address space for its
# shadow, so those runs are skipped there.

def _sanitized(binary):
    with open(binary, "rb") as f:
        data = f.read()
    return b"__asan_init" in data or b"__tsan_init" in data


def _run_limited(binary, args, address_space_bytes, timeout=120):
    import resource

    def limit():
        resource.setrlimit(resource.RLIMIT_AS, (address_space_bytes, address_space_bytes))
        resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    proc = subprocess.run([str(binary), *map(str, args)], stdout=subprocess.PIPE,
                          stderr=subprocess.PIPE, timeout=timeout, preexec_fn=limit)
    proc.err = proc.stderr.decode("utf-8", errors="replace")
    return proc


def _replace_shard(src, name, pickle_bytes):
    """Shard `name` becomes gzip(pickle_bytes), its checksum updated."""
    fpath = os.path.join(src.path, name)
    with gzip.open(fpath, "wb", compresslevel=9) as f:
        f.write(pickle_bytes)
    for entry in src.metadata["shards"]:
        if entry["filename"] == name:
            entry["checksum"] = "sha256:" + sha256_file(fpath)
            entry["size_bytes"] = os.path.getsize(fpath)
    src.write_metadata()
    return fpath


def test_a_gzip_bomb_stops_at_what_metadata_says_the_shard_holds(shardcast_bin, tmp_path):
    """A 300 MB pickle in a few hundred KB of gzip, where metadata.json says
    the shard holds 3 samples x 2 layers x 8 tokens x 8 values: refused at
    that bound (8 bytes a value, 1 MiB a sample, 64 MiB), naming the shard
    and the arithmetic, within a 1 GiB address space (the default bound,
    --max-shard-bytes, is 32 GiB)."""
    src = make_source(tmp_path / "src", seq_lens=((2, 3, 1), (2,)), seed=20)
    bomb = b"\x80\x04B" + (300 << 20).to_bytes(4, "little") + bytes(300 << 20) + b"."
    fpath = _replace_shard(src, "shard_0001.pkl.gz", bomb)
    assert os.path.getsize(fpath) < 1 << 20
    bound = 3 * 2 * 8 * 8 * 8 + 3 * (1 << 20) + (64 << 20)
    root = tmp_path / "root"
    limit = None if _sanitized(shardcast_bin) else 1 << 30
    start = time.monotonic()
    if limit is None:
        proc = subprocess.run([str(shardcast_bin), "import", "pkl", src.path, root],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, timeout=120)
        proc.err = proc.stderr.decode("utf-8", errors="replace")
    else:
        proc = _run_limited(shardcast_bin, ["import", "pkl", src.path, root], limit)
    assert proc.returncode == 1, proc.err
    assert "shard_0001.pkl.gz" in proc.err and f"more than the {bound} bytes" in proc.err, \
        proc.err
    assert "3 samples x 2 layers x 8 tokens x 8 values" in proc.err, proc.err
    assert time.monotonic() - start < 60
    assert leftovers(root) == []


def test_a_pickle_that_memoizes_in_a_loop_is_refused(cli, tmp_path):
    """MEMOIZE 2 million times (2 MB of opcodes, ~120 MB of memo unbounded):
    RESOURCE_EXHAUSTED at the memo cap, naming the shard and the byte."""
    src = make_source(tmp_path / "src", seq_lens=((2,),), seed=21)
    _replace_shard(src, "shard_0001.pkl.gz", b"\x80\x04]" + b"\x94" * 2_000_000 + b".")
    proc = cli.fails("import", "pkl", src.path, tmp_path / "root")
    assert "shard_0001.pkl.gz" in proc.err and "memo entries" in proc.err, proc.err
    assert "byte 1048579" in proc.err, proc.err  # the (2^20 + 1)-th MEMOIZE
    assert leftovers(tmp_path / "root") == []


def test_running_out_of_memory_is_an_error_not_an_abort(shardcast_bin, tmp_path):
    """Under a 256 MiB address space, a shard that needs more (a 300 MB
    pickle, no counts in metadata.json to bound it by) ends with exit 1 and
    a message, not SIGABRT from an uncaught std::bad_alloc."""
    if _sanitized(shardcast_bin):
        pytest.skip("a sanitizer's shadow memory needs more address space")
    src = make_source(tmp_path / "src", seq_lens=((2,),), seed=22, in_metadata=False)
    bomb = b"\x80\x04B" + (300 << 20).to_bytes(4, "little") + bytes(300 << 20) + b"."
    _replace_shard(src, "shard_0001.pkl.gz", bomb)
    root = tmp_path / "root"
    proc = _run_limited(shardcast_bin, ["import", "pkl", src.path, root], 256 << 20)
    assert proc.returncode == 1, (proc.returncode, proc.err)
    assert "out of memory" in proc.err, proc.err
    assert leftovers(root) == []
