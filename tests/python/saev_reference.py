"""Independent numpy implementation of the saev shard protocol (test oracle).

Written from the protocol documents alone (seed 000: protocol "2.1"; seed 001:
protocol "1.0.0"; docs/format.md for the "2.1 as saev writes it"
variant). Nothing here calls or mirrors the project's C++ code: the writer
produces dataset directories the way saev's Python does, the reader memmaps
shards at the protocol offsets, and the synthetic-value oracle recomputes
SplitMix64 in numpy uint64 arithmetic.
"""

import hashlib
import json
import math
import os

import numpy as np

VARIANTS = ("2.1", "2.1-saev", "1.0.0")

# Field names per variant: (content tokens, d_model, n_examples, budget,
# shards.json count key).
_NAMES = {
    "2.1": ("patches_per_ex", "d_model", "n_examples", "patches_per_shard", "n_examples"),
    "2.1-saev": ("content_tokens_per_example", "d_model", "n_examples",
                 "max_tokens_per_shard", "n_examples"),
    "1.0.0": ("n_patches_per_img", "d_vit", "n_imgs", "max_patches_per_shard", "n_imgs"),
}

# Exact metadata.json key sets as each variant's writer produces them.
METADATA_KEYS = {
    "2.1": ["family", "ckpt", "layers", "patches_per_ex", "cls_token", "d_model",
            "n_examples", "patches_per_shard", "data", "dataset", "dtype", "protocol"],
    "2.1-saev": ["family", "ckpt", "layers", "content_tokens_per_example", "cls_token",
                 "d_model", "n_examples", "max_tokens_per_shard", "data", "dataset",
                 "pixel_agg", "dtype", "protocol"],
    "1.0.0": ["vit_family", "vit_ckpt", "layers", "n_patches_per_img", "cls_token",
              "d_vit", "n_imgs", "max_patches_per_shard", "data", "dtype", "protocol"],
}


# --------------------------------------------------------------------------
# Hashes (what Python's saev code computes).

def sorted_key_json(metadata):
    return json.dumps(metadata, sort_keys=True, separators=(",", ":"))


def sorted_key_hash(metadata):
    """sha256 hex of json.dumps(metadata, sort_keys=True, separators=(',', ':'))."""
    return hashlib.sha256(sorted_key_json(metadata).encode("utf-8")).hexdigest()


def file_order_hash8(metadata):
    """First 8 hex of sha256 of compact, file-order, ensure_ascii=False JSON."""
    text = json.dumps(metadata, separators=(",", ":"), ensure_ascii=False)
    return hashlib.sha256(text.encode("utf-8")).hexdigest()[:8]


def content_hash(variant, metadata):
    return file_order_hash8(metadata) if variant == "2.1-saev" else sorted_key_hash(metadata)


def detect_variant(metadata):
    if "n_patches_per_img" in metadata:
        return "1.0.0"
    if "content_tokens_per_example" in metadata:
        return "2.1-saev"
    return "2.1"


# --------------------------------------------------------------------------
# Geometry.

class Geometry:
    """Shard geometry of a dataset, from protocol section 3."""

    def __init__(self, layers, content_tokens, cls_token, d_model, n_examples, budget):
        self.layers = list(layers)
        self.content_tokens = int(content_tokens)
        self.cls_token = bool(cls_token)
        self.d_model = int(d_model)
        self.n_examples = int(n_examples)
        self.budget = int(budget)

    @property
    def L(self):
        return len(self.layers)

    @property
    def T(self):
        return self.content_tokens + (1 if self.cls_token else 0)

    @property
    def D(self):
        return self.d_model

    @property
    def S(self):
        return self.budget // (self.T * self.L)

    @property
    def n_data_shards(self):
        return math.ceil(self.n_examples / self.S) if self.n_examples else 0

    def shard_counts(self):
        counts = []
        left = self.n_examples
        while left > 0:
            counts.append(min(self.S, left))
            left -= counts[-1]
        return counts

    @property
    def example_bytes(self):
        return self.L * self.T * self.D * 4

    def locate(self, example, layer, token):
        """(shard file name, byte offset) of a vector, per protocol 4.2."""
        shard_idx, ex_in_shard = divmod(example, self.S)
        layer_idx = self.layers.index(layer)  # ValueError if not recorded
        assert 0 <= token < self.T
        offset_in_vectors = ex_in_shard * self.L * self.T + layer_idx * self.T + token
        return shard_name(shard_idx), offset_in_vectors * self.D * 4

    @classmethod
    def from_metadata(cls, metadata):
        v = detect_variant(metadata)
        ct, dm, ne, bud, _ = _NAMES[v]
        return cls(metadata["layers"], metadata[ct], metadata["cls_token"], metadata[dm],
                   metadata[ne], metadata[bud])


def shard_name(i):
    return f"acts{i:06d}.bin"


# --------------------------------------------------------------------------
# Writer (how saev's Python code lays a dataset out).

def make_metadata(variant, geom, *, family="clip", ckpt="ViT-B-16/openai", data=None,
                  dataset="/datasets/imagenet/train", pixel_agg=None, protocol=None,
                  extra=None):
    """metadata.json content for `variant`, keys in that writer's order."""
    if variant == "2.1":
        md = {
            "family": family, "ckpt": ckpt, "layers": list(geom.layers),
            "patches_per_ex": geom.content_tokens, "cls_token": geom.cls_token,
            "d_model": geom.d_model, "n_examples": geom.n_examples,
            "patches_per_shard": geom.budget,
            "data": "gASVAAAAAAAAAAB9lC4=" if data is None else data,
            "dataset": dataset, "dtype": "float32", "protocol": protocol or "2.1",
        }
    elif variant == "2.1-saev":
        md = {
            "family": family, "ckpt": ckpt, "layers": list(geom.layers),
            "content_tokens_per_example": geom.content_tokens, "cls_token": geom.cls_token,
            "d_model": geom.d_model, "n_examples": geom.n_examples,
            "max_tokens_per_shard": geom.budget,
            "data": {"__class__": "Imagenet", "split": "train"} if data is None else data,
            "dataset": dataset, "pixel_agg": pixel_agg, "dtype": "float32",
            "protocol": protocol or "2.1",
        }
    elif variant == "1.0.0":
        md = {
            "vit_family": family, "vit_ckpt": ckpt, "layers": list(geom.layers),
            "n_patches_per_img": geom.content_tokens, "cls_token": geom.cls_token,
            "d_vit": geom.d_model, "n_imgs": geom.n_examples,
            "max_patches_per_shard": geom.budget,
            "data": {"root": dataset, "split": "train", "__class__": "ImageFolder"}
            if data is None else data,
            "dtype": "float32", "protocol": protocol or "1.0.0",
        }
    else:
        raise ValueError(variant)
    if extra:
        md.update(extra)
    return md


def write_dataset(root, variant, acts, layers, cls_token, budget, *, labels=None,
                  full_last_shard=False, trailing_empty=False, trailing_file="full",
                  metadata=None, dir_name=None, json_style="indent4",
                  write_checksums=False, pad_value=np.float32(-7.5), **md_kwargs):
    """Writes acts (float32 [N, L, T, D], T including CLS) as a saev dataset.

    Returns (path, metadata dict, geometry). The directory is named by the
    variant's content hash unless `dir_name` is given. `metadata` overrides
    the generated metadata entirely (its geometry must match `acts`).
    `full_last_shard` pads the last shard file with `pad_value` rows (garbage
    a correct reader never returns); `trailing_empty` appends saev's extra
    {count: 0} entry, with a shard file that is "full" (zeros, as saev's
    preallocating writer leaves it), "empty" (0 bytes) or None (absent).
    """
    acts = np.asarray(acts)
    assert acts.dtype == np.float32 and acts.ndim == 4, (acts.dtype, acts.shape)
    n, n_layers, t, d = acts.shape
    assert n_layers == len(layers)
    content_tokens = t - (1 if cls_token else 0)
    geom = Geometry(layers, content_tokens, cls_token, d, n, budget)
    if metadata is None:
        metadata = make_metadata(variant, geom, **md_kwargs)
    count_key = _NAMES[variant][4]
    name = dir_name or content_hash(variant, metadata)
    path = os.path.join(str(root), name)
    os.makedirs(path)

    if geom.S >= 1:
        counts = geom.shard_counts()
    else:  # broken metadata on purpose: one shard with everything
        counts = [n]
    entries = []
    start = 0
    for i, c in enumerate(counts):
        rows = acts[start:start + c]
        start += c
        with open(os.path.join(path, shard_name(i)), "wb") as f:
            f.write(rows.astype("<f4").tobytes())
            if full_last_shard and i == len(counts) - 1 and c < geom.S:
                pad = np.full((geom.S - c, n_layers, t, d), pad_value, dtype="<f4")
                f.write(pad.tobytes())
        entries.append({"name": shard_name(i), count_key: c})
    if trailing_empty:
        i = len(counts)
        if trailing_file == "full":
            with open(os.path.join(path, shard_name(i)), "wb") as f:
                f.write(bytes(geom.S * geom.example_bytes))
        elif trailing_file == "empty":
            open(os.path.join(path, shard_name(i)), "wb").close()
        entries.append({"name": shard_name(i), count_key: 0})

    if labels is not None:
        labels = np.asarray(labels)
        assert labels.dtype == np.uint8 and labels.shape == (n, content_tokens)
        with open(os.path.join(path, "labels.bin"), "wb") as f:
            f.write(labels.tobytes())

    write_json(os.path.join(path, "metadata.json"), metadata, json_style)
    write_json(os.path.join(path, "shards.json"), entries, json_style)
    if write_checksums:
        write_sha256sums(path)
    return path, metadata, geom


def write_json(fpath, obj, style="indent4"):
    with open(fpath, "w", encoding="utf-8") as f:
        if style == "indent4":  # what saev's json.dump(..., indent=4) writes
            json.dump(obj, f, indent=4)
        elif style == "compact_raw":
            json.dump(obj, f, separators=(",", ":"), ensure_ascii=False)
        elif style == "spaced_raw":
            json.dump(obj, f, indent="\t", ensure_ascii=False)
        else:
            raise ValueError(style)


def write_sha256sums(path):
    names = sorted(x for x in os.listdir(path) if x.endswith(".bin"))
    with open(os.path.join(path, "SHA256SUMS"), "w") as f:
        for x in names:
            with open(os.path.join(path, x), "rb") as g:
                f.write(f"{hashlib.sha256(g.read()).hexdigest()}  {x}\n")


# --------------------------------------------------------------------------
# Reader (memmap at the protocol offsets).

def load_json(path, name):
    with open(os.path.join(path, name), encoding="utf-8") as f:
        return json.load(f)


def open_dataset(path):
    """(metadata, shards list, geometry) of a dataset directory."""
    md = load_json(path, "metadata.json")
    shards = load_json(path, "shards.json")
    return md, shards, Geometry.from_metadata(md)


def read_vector(path, geom, example, layer, token):
    """One [D] vector by memmap at the byte offset of protocol section 4.2."""
    name, offset = geom.locate(example, layer, token)
    mm = np.memmap(os.path.join(path, name), dtype="<f4", mode="r", offset=offset,
                   shape=(geom.D,))
    return np.array(mm)


def read_example_layer(path, geom, example, layer):
    """[T, D] slice: all tokens of one layer of one example."""
    name, offset = geom.locate(example, layer, 0)
    mm = np.memmap(os.path.join(path, name), dtype="<f4", mode="r", offset=offset,
                   shape=(geom.T, geom.D))
    return np.array(mm)


def load_all(path):
    """The whole logical [N, L, T, D] tensor, assembled shard by shard."""
    md, shards, geom = open_dataset(path)
    count_key = _NAMES[detect_variant(md)][4]
    parts = []
    for entry in shards:
        c = entry[count_key]
        if c == 0:
            continue
        mm = np.memmap(os.path.join(path, entry["name"]), dtype="<f4", mode="r",
                       shape=(c, geom.L, geom.T, geom.D))
        parts.append(np.array(mm))
    if not parts:
        return np.zeros((0, geom.L, geom.T, geom.D), np.float32)
    return np.concatenate(parts, axis=0)


def load_labels(path, geom):
    return np.fromfile(os.path.join(path, "labels.bin"), dtype=np.uint8).reshape(
        geom.n_examples, geom.content_tokens)


# --------------------------------------------------------------------------
# The synthetic-data oracle (contract of `shardcast synth`).

_M64 = (1 << 64) - 1


def splitmix64(x):
    x = np.asarray(x, dtype=np.uint64)
    with np.errstate(over="ignore"):
        x = x + np.uint64(0x9E3779B97F4A7C15)
        x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        return x ^ (x >> np.uint64(31))


def synth_values(seed, shape):
    """float32 array: element i = float32((h >> 40) / 2**24 * 2 - 1)."""
    n = int(np.prod(shape))
    idx = np.arange(n, dtype=np.uint64)
    mixed = np.uint64((seed * 0x100000001B3) & _M64)
    h = splitmix64(idx ^ mixed)
    vals = (h >> np.uint64(40)).astype(np.float64) / float(1 << 24) * 2.0 - 1.0
    return vals.astype(np.float32).reshape(shape)


def synth_labels(seed, n_examples, content_tokens):
    j = np.arange(n_examples * content_tokens, dtype=np.uint64)
    with np.errstate(over="ignore"):
        jm = j * np.uint64(0x9E37)
    h = splitmix64(np.uint64(~seed & _M64) ^ jm)
    return (h & np.uint64(7)).astype(np.uint8).reshape(n_examples, content_tokens)


def splitmix64_scalar(x):
    """Pure-int SplitMix64 (cross-checks the numpy version)."""
    x = (x + 0x9E3779B97F4A7C15) & _M64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _M64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _M64
    return x ^ (x >> 31)


# --------------------------------------------------------------------------
# Float comparison helpers.

def f32_bits(a):
    return np.ascontiguousarray(np.asarray(a, dtype=np.float32)).view(np.uint32)


def json_floats_to_f32(values):
    """JSON numbers (parsed as Python floats/ints) -> float32 array."""
    return np.asarray(values, dtype=np.float64).astype(np.float32)


def assert_f32_equal(actual, expected, what=""):
    a = f32_bits(actual)
    e = f32_bits(expected)
    assert a.shape == e.shape, f"{what}: shape {a.shape} != {e.shape}"
    if not np.array_equal(a, e):
        bad = np.argwhere(a != e)[:5]
        detail = ", ".join(
            f"{tuple(i)}: got {np.asarray(actual, np.float32)[tuple(i)]!r} "
            f"want {np.asarray(expected, np.float32)[tuple(i)]!r}" for i in bad)
        raise AssertionError(f"{what}: {int((a != e).sum())} float32 values differ "
                             f"bitwise: {detail}")
