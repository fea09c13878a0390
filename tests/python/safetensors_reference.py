"""safetensors and lmprobe 2.0 written and read from the formats' own
descriptions (seed 004 and the safetensors library's layout: 8-byte
little-endian header length, JSON header padded with spaces to a multiple of
8, then the data section; "data_offsets" relative to the data section;
lmprobe's per-layer shards named by file_pattern / key_pattern, seed 003).
The `safetensors` Python package is not installed; nothing here calls the
project's code. Shared by test_safetensors.py and test_lmprobe_serve.py.
"""

import json
import os
import struct
import types

import numpy as np

# safetensors dtype name -> numpy dtype (little-endian); bits for the others.
NP_DTYPES = {"F64": "<f8", "F32": "<f4", "F16": "<f2", "I64": "<i8", "I32": "<i4",
             "I16": "<i2", "I8": "i1", "U8": "u1", "U16": "<u2", "U32": "<u4",
             "U64": "<u8", "BOOL": "?"}
BITS = {"BF16": 16, "F8_E4M3": 8, "F8_E5M2": 8, "F4": 4}


# --------------------------------------------------------------------------
# An independent safetensors reader and writer.

def _no_duplicates(pairs):
    keys = [k for k, _ in pairs]
    assert len(keys) == len(set(keys)), f"duplicate keys {keys}"
    return dict(pairs)


def read_safetensors(path):
    """(tensors {name: np.ndarray or raw bytes}, metadata, info) of a file,
    asserting every rule of the format on the way."""
    with open(path, "rb") as f:
        raw = f.read()
    assert len(raw) >= 8
    (n,) = struct.unpack("<Q", raw[:8])
    assert 8 + n <= len(raw)
    header_bytes = raw[8:8 + n]
    text = header_bytes.decode("utf-8")
    assert text.startswith("{")
    # The safetensors library pads with spaces so the data starts 8-aligned.
    assert (8 + n) % 8 == 0, n
    stripped = text.rstrip(" ")
    assert len(text) - len(stripped) < 8
    header = json.loads(stripped, object_pairs_hook=_no_duplicates)
    data = raw[8 + n:]
    metadata = header.pop("__metadata__", None)
    if metadata is not None:
        assert all(isinstance(k, str) and isinstance(v, str) for k, v in metadata.items())
    spans = []
    tensors = {}
    for name, info in header.items():
        assert set(info) == {"dtype", "shape", "data_offsets"}, info
        begin, end = info["data_offsets"]
        shape = info["shape"]
        count = int(np.prod(shape, dtype=np.int64)) if shape else 1
        if info["dtype"] in NP_DTYPES:
            dt = np.dtype(NP_DTYPES[info["dtype"]])
            assert end - begin == count * dt.itemsize, (name, info)
            tensors[name] = np.frombuffer(data[begin:end], dtype=dt).reshape(shape)
        else:
            assert (end - begin) * 8 == count * BITS[info["dtype"]], (name, info)
            tensors[name] = data[begin:end]
        spans.append((begin, end, name))
    cursor = 0
    for begin, end, name in sorted(spans):
        assert begin == cursor, f"{name}: gap or overlap at {cursor}"
        cursor = end
    assert cursor == len(data), "bytes after the last tensor"
    offsets = {name: 8 + n + info["data_offsets"][0] for name, info in header.items()}
    return tensors, metadata, types.SimpleNamespace(header_len=n, offsets=offsets,
                                                    header=header)


def safetensors_bytes(tensors, metadata=None, order=None, pad=True):
    """A safetensors file as the library writes it (tensors: name -> array)."""
    names = order or list(tensors)
    header = {}
    if metadata is not None:
        header["__metadata__"] = metadata
    offset = 0
    blobs = []
    for name in names:
        arr = np.ascontiguousarray(tensors[name])
        blob = arr.tobytes()
        dtype = next(k for k, v in NP_DTYPES.items() if np.dtype(v) == arr.dtype)
        header[name] = {"dtype": dtype, "shape": list(arr.shape),
                        "data_offsets": [offset, offset + len(blob)]}
        offset += len(blob)
        blobs.append(blob)
    text = json.dumps(header, separators=(",", ":")).encode()
    if pad:
        text += b" " * ((8 - len(text) % 8) % 8)
    return struct.pack("<Q", len(text)) + text + b"".join(blobs), 8 + len(text)


# --------------------------------------------------------------------------
# lmprobe directories.

def lmprobe_name(layer, shard):
    # The default file_pattern, formatted by Python itself.
    return "tensors/hidden_layer{layer:03d}_shard{shard:03d}.safetensors".format(
        layer=layer, shard=shard)


def write_lmprobe(root, *, storage, layers, dim, shards, np_dtype="<f4", with_info=True,
                  last_token_shards=0, seed=0, skip_empty=True):
    """An lmprobe 2.0 dataset: per-layer safetensors shards of [rows, dim]
    under tensors/, and lmprobe_info.json with the hidden_layers descriptor.

    shards: list of (num_prompts, rows). Returns {(layer, shard): (array,
    file offset of its data)}; an empty shard gets no file (as lmprobe does)
    when skip_empty."""
    rng = np.random.default_rng(seed)
    os.makedirs(os.path.join(root, "tensors"), exist_ok=True)
    written = {}
    for layer in layers:
        for s, (_, rows) in enumerate(shards):
            arr = rng.standard_normal((rows, dim)).astype(np_dtype)
            if rows == 0 and skip_empty:
                written[(layer, s)] = (arr, None)
                continue
            blob, data_offset = safetensors_bytes({f"hidden.layer_{layer}": arr})
            with open(os.path.join(root, lmprobe_name(layer, s)), "wb") as f:
                f.write(blob)
            written[(layer, s)] = (arr, data_offset)
    if with_info:
        desc = {"type": "hidden", "layers": list(layers), "dim": dim,
                "dtype": {"<f4": "float32", "<f2": "float16"}[np_dtype],
                "layout": "per_layer",
                "file_pattern": "tensors/hidden_layer{layer:03d}_shard{shard:03d}.safetensors",
                "key_pattern": "hidden.layer_{layer}", "storage": storage}
        if storage == "pooled":
            desc["pooling"] = "last_token"
            desc["row_bytes"] = dim * np.dtype(np_dtype).itemsize
            desc["shards"] = [{"num_prompts": p} for p, _ in shards]
            num_prompts = sum(p for p, _ in shards)
        else:
            desc["last_token_shards"] = last_token_shards
            desc["shards"] = [{"num_prompts": p, "num_tokens": r} for p, r in shards]
            num_prompts = sum(p for p, _ in shards[:last_token_shards])
        info = {"format_version": "2.0",
                "model": {"name": "meta-llama/Llama-3.1-8B-Instruct", "revision": "5206a32e"},
                "num_prompts": num_prompts, "prompt_ordering": "random",
                "tensors": {"hidden_layers": desc},
                "provenance": {"lmprobe_version": "0.8.9"}}
        with open(os.path.join(root, "lmprobe_info.json"), "w") as f:
            json.dump(info, f, indent=2)
    return written
