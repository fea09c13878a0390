"""Seed-002 sources (metadata.json + shard_NNNN.pkl.gz), the input of
`shardcast import pkl`, written by Python itself: gzip, pickle (protocols 2,
4, 5), numpy and hashlib. Nothing here calls the project's code.

Shared by format/test_import_pkl.py, daemon/test_example_info.py and
tests/bench/run_import_bench.sh. Mapping: example = sample (shard order, then
list order), layer value = the N of "layer_N", token = sequence position (no
CLS), padding to max_seq_length with zero vectors labelled PAD_LABEL (real
tokens TOKEN_LABEL).
"""

import gzip
import hashlib
import json
import os
import pickle

import numpy as np

PAD_LABEL = 255
TOKEN_LABEL = 0


def sha256_file(path):
    with open(path, "rb") as f:
        return hashlib.sha256(f.read()).hexdigest()


class Source:
    """A seed-002 directory and what a correct importer must produce from it."""

    def __init__(self, path, layers, hidden, max_seq_length, samples, metadata):
        self.path = str(path)
        self.layers = layers
        self.hidden = hidden
        self.max_seq_length = max_seq_length
        self.samples = samples  # [{"sample_idx", "acts": {layer: [n, D] f32}, ...}]
        self.metadata = metadata

    def expected(self, layers=None, tokens=None):
        """float32 [N, L, T, D] with zero padding, and uint8 labels [N, T]."""
        layers = list(layers or self.layers)
        t = tokens or self.max_seq_length
        n = len(self.samples)
        acts = np.zeros((n, len(layers), t, self.hidden), np.float32)
        labels = np.full((n, t), PAD_LABEL, np.uint8)
        for e, s in enumerate(self.samples):
            for li, layer in enumerate(layers):
                a = s["acts"][layer]
                acts[e, li, :a.shape[0]] = a
            labels[e, :s["seq_len"]] = TOKEN_LABEL
        return acts, labels

    def write_metadata(self):
        with open(os.path.join(self.path, "metadata.json"), "w") as f:
            json.dump(self.metadata, f, indent=2)


def make_source(path, *, protocol=4, layers=(15, 16), hidden=8, seq_lens=((5, 3, 8), (2, 6)),
                max_seq_length=8, seed=0, dtype=np.float32, in_metadata=True,
                array_fn=None, first_sample_idx=100, compresslevel=6):
    """Writes a seed-002 directory; returns a Source.

    seq_lens: per shard, the sequence length of each sample. array_fn, when
    given, maps the float32 array to what is pickled (another dtype, byte
    order, memory order); the expected values stay the float32 array's.
    in_metadata=False leaves out num_samples, max_seq_length and the layer
    lists, so the importer has to find them in the shards.
    """
    os.makedirs(path, exist_ok=True)
    rng = np.random.default_rng(seed)
    samples, shard_entries = [], []
    sample_idx = first_sample_idx
    for si, lens in enumerate(seq_lens):
        data = {f"layer_{layer}": [] for layer in layers}
        for n in lens:
            acts = {}
            for layer in layers:
                a = rng.standard_normal((n, hidden)).astype(np.float32)
                if dtype is not np.float32:
                    a = a.astype(dtype).astype(np.float32)  # representable
                acts[layer] = a
                pickled = a.astype(dtype) if array_fn is None else array_fn(a)
                data[f"layer_{layer}"].append({
                    "sample_idx": sample_idx,
                    "activation": pickled,
                    "shape": tuple(pickled.shape),
                    "text_preview": f"sample {sample_idx}: caf\u00e9 \u2603",
                    "metadata": {"token_count": n, "dataset_idx": 5000 + sample_idx,
                                 "machine_id": 0},
                })
            samples.append({"sample_idx": sample_idx, "acts": acts, "seq_len": n,
                            "shard": f"shard_{si + 1:04d}.pkl.gz",
                            "text_preview": f"sample {sample_idx}: caf\u00e9 \u2603",
                            "dataset_idx": 5000 + sample_idx})
            sample_idx += 1
        fname = f"shard_{si + 1:04d}.pkl.gz"
        fpath = os.path.join(path, fname)
        with gzip.open(fpath, "wb", compresslevel=compresslevel) as f:
            pickle.dump(data, f, protocol=protocol)
        entry = {"shard_id": si + 1, "filename": fname, "size_bytes": os.path.getsize(fpath),
                 "compressed": True, "checksum": "sha256:" + sha256_file(fpath)}
        if in_metadata:
            entry.update({"num_samples": len(lens), "layers": list(layers),
                          "sample_id_range": [sample_idx - len(lens), sample_idx - 1]})
        shard_entries.append(entry)
    config = {"model_name": "Qwen/Qwen2.5-7B", "model_architecture": "qwen2",
              "model_params": {"hidden_size": hidden, "num_hidden_layers": 28},
              "dataset_name": "HuggingFaceFW/fineweb-edu", "dataset_split": "train",
              "batch_size": 16}
    if in_metadata:
        config["layers_extracted"] = list(layers)
        config["max_seq_length"] = max_seq_length
    else:
        del config["model_params"]
    metadata = {"version": "1.0", "created_at": "2025-01-09T12:00:00Z",
                "extraction_config": config,
                "distributed_config": {"machine_id": 0, "total_machines": 1},
                "shards": shard_entries,
                "statistics": {"total_shards": len(seq_lens), "total_samples": len(samples)}}
    src = Source(path, list(layers), hidden, max_seq_length, samples, metadata)
    src.write_metadata()
    return src
