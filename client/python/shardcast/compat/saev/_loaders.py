"""The configs, DataLoaders and Dataset of shardcast.compat.saev (see its
docstring for what they do and where they differ from saev's)."""

import dataclasses
import logging
import math
import operator
import os
import pathlib
import typing

import numpy as np
import torch
import torch.utils.data

from shardcast._client import Client, Error
from shardcast.compat.saev import _checks
from shardcast.compat.saev._metadata import Metadata

# The daemon's address given to install(); None: $SHARDCAST_ADDRESS.
_address = None

_DEFAULT_SHARDS = pathlib.Path("$SAEV_SCRATCH/saev/shards/abcdefg")
_LABELS_CHUNK = 1 << 24  # labels.bin bytes counted at a time (ignore_labels)


def _client_for(cfg):
    """The Client that serves `cfg`'s dataset: the daemon at install()'s
    `address`, else the one a Client finds without an address
    ($SHARDCAST_ADDRESS, the node's, or the user's own, started when
    needed). Every loader connects here."""
    del cfg  # every dataset is served by the same daemon, for now
    return Client(_address)


@_checks.checked
@dataclasses.dataclass(frozen=True)
class ShuffledConfig:
    """saev's shuffled loader config (saev.data.ShuffledConfig): the same
    fields, defaults and checks. `shards` is the dataset's directory
    (.../saev/shards/<hash>); `tokens` "content", "special" ([CLS]) or
    "all"; `layer` a recorded layer or "all"; `ignore_labels` drops content
    tokens with these labels (labels.bin). n_threads, buffer_size,
    min_buffer_fill, batch_timeout_s, debug, log_every_s and use_tmpdir tune
    saev's own reader and are accepted and unused: the daemon reads."""

    shards: pathlib.Path = _DEFAULT_SHARDS
    tokens: typing.Literal["special", "content", "all"] = "content"
    layer: typing.Union[int, typing.Literal["all"]] = -1
    batch_size: int = 1024 * 16
    drop_last: bool = False
    scale_norm: bool = False
    ignore_labels: list[int] = dataclasses.field(default_factory=list)
    n_threads: int = 4
    buffer_size: int = 64
    min_buffer_fill: float = 0.0
    batch_timeout_s: float = 30.0
    seed: int = 17
    debug: bool = False
    log_every_s: float = 30.0
    use_tmpdir: bool = False


@_checks.checked
@dataclasses.dataclass(frozen=True)
class OrderedConfig:
    """saev's ordered loader config (saev.data.OrderedConfig): content
    tokens of `layer` (or of every layer: "all"), in disk order.
    batch_timeout_s, buffer_size, debug and log_every_s are accepted and
    unused."""

    shards: pathlib.Path = _DEFAULT_SHARDS
    tokens: typing.Literal["content"] = "content"
    layer: typing.Union[int, typing.Literal["all"]] = -2
    batch_size: int = 1024 * 16
    batch_timeout_s: float = 30.0
    drop_last: bool = False
    buffer_size: int = 64
    debug: bool = False
    log_every_s: float = 30.0


@_checks.checked
@dataclasses.dataclass(frozen=True)
class IndexedConfig:
    """saev's random-access Dataset config (saev.data.IndexedConfig)."""

    shards: pathlib.Path = _DEFAULT_SHARDS
    tokens: typing.Literal["special", "content", "all"] = "content"
    layer: typing.Union[int, typing.Literal["all"]] = -2
    debug: bool = False


@_checks.checked
def make_ordered_config(shuffled_cfg: ShuffledConfig, **overrides: object) -> OrderedConfig:
    """An OrderedConfig with the fields `shuffled_cfg` shares with it, and
    `overrides` on top (TypeError for a field OrderedConfig lacks)."""
    params = {f.name: getattr(shuffled_cfg, f.name)
              for f in dataclasses.fields(OrderedConfig) if hasattr(shuffled_cfg, f.name)}
    params.update(overrides)
    return OrderedConfig(**params)


def _require_config(cfg, ours, saev_module, who):
    """TypeError unless `cfg` is our config class `ours` or saev's own
    saev.data.<saev_module>.Config (install() may come after saev's trainer
    made its configs)."""
    kind = type(cfg)
    if isinstance(cfg, ours) or (kind.__module__ == f"saev.data.{saev_module}" and
                                 kind.__qualname__ == "Config"):
        return
    raise TypeError(f"{who}(cfg={cfg!r}): cfg is not a {ours.__name__}")


def _open_shards(cfg):
    """`cfg.shards`, after saev's first check (RuntimeError naming it when
    it is not a directory)."""
    path = cfg.shards
    if not os.path.isdir(path):
        raise RuntimeError(f"Activations are not saved at '{path}'.")
    return path


def _check_files(path):
    """Metadata of shards directory `path` after saev's file checks."""
    md = Metadata.load(path)
    _checks.validate_shard_files(path, _checks.load_shard_entries(path))
    return md


def _tokens(md, tokens):
    """Tokens per example and layer that `tokens` selects."""
    return {"content": md.content_tokens_per_example, "special": 1,
            "all": md.tokens_per_example}[tokens]


def _per_example(md, tokens, layer):
    """Vectors per example selected by (tokens, layer)."""
    return _tokens(md, tokens) * (len(md.layers) if layer == "all" else 1)


def _require_cls(md, tokens, path):
    if tokens == "special" and not md.cls_token:
        raise AssertionError(f"tokens='special' selects [CLS] tokens, and the shards at "
                             f"'{path}' have none (cls_token is false)")


def _attach(cfg, path):
    """(client, dataset record) of the daemon serving directory `path`;
    RuntimeError naming `path` when it cannot."""
    try:
        client = _client_for(cfg)
        info = client.attach(path)
    except Error as e:
        raise RuntimeError(f"shardcastd cannot serve the shards at '{path}': {e}") from e
    if not info.ok:
        raise RuntimeError(f"shardcastd cannot serve the shards at '{path}': {info.error}")
    return client, info


class _DataLoader:
    """What saev's two DataLoaders share: one pass (`for batch in loader`)
    is one epoch of n_samples vectors in len(loader) batches of dicts."""

    def __init__(self, cfg, order, logger):
        self.cfg = cfg
        self.logger = logging.getLogger(logger)
        self._order = order
        self._stream = None
        self._passes = 0
        self._client = self._info = self._pid = None
        # Nothing runs in another process here: the daemon reads. saev's
        # monitors read these and find no process (manager_pid -1).
        self.manager_proc = None
        self.reservoir = None
        self.stop_event = None

    def _connect(self):
        if self._client is None or self._pid != os.getpid():
            self._client, self._info = _attach(self.cfg, self.cfg.shards)
            self._pid = os.getpid()

    @property
    def metadata(self) -> Metadata:
        """The dataset's Metadata (saev's shuffled loader's name for it)."""
        return self.md

    @property
    def n_batches(self) -> int:
        return len(self)

    @property
    def n_samples(self) -> int:
        """Vectors in one epoch."""
        return self._n_samples

    @property
    def batch_size(self) -> int:
        return self.cfg.batch_size

    @property
    def drop_last(self) -> bool:
        return self.cfg.drop_last

    @property
    def manager_pid(self) -> int:
        """-1: no loader process (saev's has one; here the daemon reads)."""
        return -1

    def _stream_options(self):
        raise NotImplementedError

    def _batch(self, b):
        raise NotImplementedError

    def __iter__(self):
        layer = self.cfg.layer
        if layer != "all" and layer not in self.md.layers:
            raise RuntimeError(f"Layer {layer} not in {self.md.layers}: the shards at "
                               f"'{self.cfg.shards}' do not have it.")
        if self.n_samples == 0:
            return
        self._connect()
        self.shutdown()
        stream = self._client.stream(
            self._info.id, layer=None if layer == "all" else layer, order=self._order,
            batch_size=self.cfg.batch_size, epochs=1, copy=True, **self._stream_options())
        self._stream = stream
        n = 0
        try:
            for b in stream:
                yield self._batch(b)
                n += 1
        except Error as e:  # saev's loader says RuntimeError when its reader fails
            raise RuntimeError(f"shardcastd ended the pass over '{self.cfg.shards}' after "
                               f"{n}/{len(self)} batches: {e}") from e
        finally:
            stream.close()
            if self._stream is stream:
                self._stream = None

    def shutdown(self):
        """Ends the pass in progress, if any (the next pass starts anew)."""
        stream, self._stream = self._stream, None
        if stream is not None:
            stream.close()

    def __del__(self):
        # Not Client.close(): at interpreter exit it waits for grpc threads
        # that are gone; the channel closes itself when collected.
        try:
            self.shutdown()
        except Exception:  # interpreter shutdown
            pass


class ShuffledDataLoader(_DataLoader):
    """saev's shuffled DataLoader (saev.data.ShuffledDataLoader): each pass
    yields every selected vector once, shuffled by the daemon (each pass in
    a new order), in batches of `batch_size` and a last, shorter one: as in
    saev, `drop_last` is reported but drops nothing, and len() counts it.
    Batches: act float32 [B, d_model], example_idx and token_idx int32 [B]
    (token_idx counts content tokens; -1 is [CLS])."""

    class ExampleBatch(typing.TypedDict):
        act: torch.Tensor
        example_idx: torch.Tensor
        token_idx: torch.Tensor

    def __init__(self, cfg: ShuffledConfig):
        _require_config(cfg, ShuffledConfig, "shuffled", "ShuffledDataLoader")
        super().__init__(cfg, "shuffled", "shuffled.DataLoader")
        path = _open_shards(cfg)
        if cfg.scale_norm:
            raise NotImplementedError("scale_norm not implemented.")
        self.md = _check_files(path)
        _require_cls(self.md, cfg.tokens, path)
        self._n_samples = self.md.n_examples * _per_example(self.md, cfg.tokens, cfg.layer)
        if cfg.ignore_labels:
            self._n_samples = self._count_kept_labels(path)
        self._connect()

    def _count_kept_labels(self, path):
        """Content tokens of one layer whose label ignore_labels keeps,
        counted in labels.bin as saev counts them."""
        if self.cfg.tokens != "content" or not isinstance(self.cfg.layer, int):
            raise NotImplementedError(
                "Patch label filtering only supports 'content' patches with fixed layer")
        labels = path / "labels.bin"
        if not labels.exists():
            raise FileNotFoundError(f"labels.bin not found at {labels}")
        n = self.md.n_examples * self.md.content_tokens_per_example
        drop = np.zeros(256, dtype=bool)
        drop[[x for x in self.cfg.ignore_labels if 0 <= x < 256]] = True
        values = np.memmap(labels, mode="r", dtype=np.uint8, shape=(n,))
        kept = n
        for start in range(0, n, _LABELS_CHUNK):
            kept -= int(drop[values[start:start + _LABELS_CHUNK]].sum())
        del values
        return kept

    def _stream_options(self):
        seed = self.cfg.seed + self._passes  # a new order each pass
        self._passes += 1
        return dict(tokens=self.cfg.tokens, seed=seed, drop_last=False,
                    exclude_labels=[x for x in self.cfg.ignore_labels if 0 <= x < 256])

    def _batch(self, b):
        return {"act": torch.from_numpy(b.vectors),
                "example_idx": torch.from_numpy(b.example_idx.astype(np.int32)),
                "token_idx": torch.from_numpy(b.token_idx.astype(np.int32))}

    def __len__(self) -> int:
        """Batches in an epoch, the short last one included."""
        return math.ceil(self.n_samples / self.cfg.batch_size)


class OrderedDataLoader(_DataLoader):
    """saev's ordered DataLoader (saev.data.OrderedDataLoader): each pass
    yields every content token of the layer in disk order (example by
    example, token by token; with layer="all", each example's layers in
    recorded order), in batches of `batch_size`, the last one shorter unless
    drop_last. Batches: act float32 [B, d_model], example_idx and token_idx
    int64 [B], and token_labels int64 [B] when the dataset has labels.bin."""

    class ExampleBatch(typing.TypedDict, total=False):
        act: torch.Tensor
        example_idx: torch.Tensor
        token_idx: torch.Tensor
        token_labels: torch.Tensor

    def __init__(self, cfg: OrderedConfig):
        _require_config(cfg, OrderedConfig, "ordered", "OrderedDataLoader")
        super().__init__(cfg, "ordered", "ordered.DataLoader")
        path = _open_shards(cfg)
        self.md = _check_files(path)
        self._n_samples = self.md.n_examples * _per_example(self.md, cfg.tokens, cfg.layer)
        self._connect()

    def _stream_options(self):
        return dict(tokens="content", drop_last=self.cfg.drop_last)

    def _batch(self, b):
        batch = {"act": torch.from_numpy(b.vectors),
                 "example_idx": torch.from_numpy(b.example_idx.astype(np.int64)),
                 "token_idx": torch.from_numpy(b.token_idx.astype(np.int64))}
        if self._info.has_labels:
            batch["token_labels"] = torch.from_numpy(b.labels.astype(np.int64))
        return batch

    def __len__(self) -> int:
        """Batches in an epoch."""
        if self.cfg.drop_last:
            return self.n_samples // self.cfg.batch_size
        return math.ceil(self.n_samples / self.cfg.batch_size)


class IndexedDataset(torch.utils.data.Dataset):
    """saev's random-access Dataset (saev.data.IndexedDataset): item i is a
    dict of act (float32 [d_model]), example_idx and token_idx (ints;
    token_idx counts content tokens, -1 is [CLS]) and, for content tokens of
    a dataset with labels.bin, token_label. Items are numbered example by
    example (then layer by layer with layer="all"), token by token on the
    selected tokens. Each item is one query to the daemon; __getitems__
    answers a list of indices with one. In torch DataLoader workers, use
    multiprocessing_context="spawn": each worker connects itself (a forked
    one cannot, and says so)."""

    class Example(typing.TypedDict, total=False):
        act: torch.Tensor
        example_idx: int
        token_idx: int
        token_label: int

    _LABEL_CACHE = 256  # examples whose labels are kept

    def __init__(self, cfg: IndexedConfig):
        _require_config(cfg, IndexedConfig, "indexed", "IndexedDataset")
        self.cfg = cfg
        path = _open_shards(cfg)
        self.md = _check_files(path)
        self._has_labels = (path / "labels.bin").exists()
        _require_cls(self.md, cfg.tokens, path)
        if isinstance(cfg.layer, int) and cfg.layer not in self.md.layers:
            raise AssertionError(f"No matche for layer; {cfg.layer} not in {self.md.layers}.")
        self._tokens = _tokens(self.md, cfg.tokens)
        self._len = self.md.n_examples * _per_example(self.md, cfg.tokens, cfg.layer)
        self._labels = {}
        self._client = self._info = self._pid = None
        self._connect()

    def _connect(self):
        if self._client is None or self._pid != os.getpid():
            self._client, self._info = _attach(self.cfg, self.cfg.shards)
            self._pid = os.getpid()
            self._labels = {}

    def __getstate__(self):
        # A worker process connects itself (spawn); a client does not travel.
        state = dict(self.__dict__)
        state["_client"] = state["_info"] = state["_pid"] = None
        state["_labels"] = {}
        return state

    @property
    def metadata(self) -> Metadata:
        return self.md

    def transform(self, act):
        """An act as the tensor an item holds (a float32 copy), as saev's."""
        return torch.from_numpy(np.array(act, dtype=np.float32))

    @property
    def d_model(self) -> int:
        """Width of each act."""
        return self.md.d_model

    def __len__(self) -> int:
        return self._len

    def _locate(self, i):
        """(example, layer value, token-axis index, token_idx) of item i."""
        i = operator.index(i)
        if i < 0 or i >= self._len:
            raise IndexError(f"Index {i} out of range for dataset of length {self._len}")
        example, rest = divmod(i, self._tokens * (len(self.md.layers)
                                                   if self.cfg.layer == "all" else 1))
        if self.cfg.layer == "all":
            layer_i, rest = divmod(rest, self._tokens)
            layer = self.md.layers[layer_i]
        else:
            layer = self.cfg.layer
        cls = int(self.md.cls_token)
        axis = {"content": rest + cls, "special": 0, "all": rest}[self.cfg.tokens]
        return example, layer, axis, axis - cls

    def _token_label(self, example, token):
        labels = self._labels.get(example)
        if labels is None:
            if len(self._labels) >= self._LABEL_CACHE:
                self._labels.pop(next(iter(self._labels)))
            labels = self._labels[example] = self._client.get_labels(self._info.id, example)
        return int(labels[token])

    def __getitem__(self, i: int) -> "IndexedDataset.Example":
        return self.__getitems__([i])[0]

    def __getitems__(self, indices):
        """The items at `indices`, from one query."""
        self._connect()
        where = [self._locate(i) for i in indices]
        vectors = self._client.get_vectors(self._info.id, [w[:3] for w in where])
        items = []
        for (example, _, _, token), act in zip(where, vectors):
            item = {"act": self.transform(act), "example_idx": example,
                    "token_idx": token}
            if self._has_labels and token >= 0:
                item["token_label"] = self._token_label(example, token)
            items.append(item)
        return items
