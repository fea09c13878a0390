"""The configs and DataLoaders of shardcast.compat.saev (see its docstring)."""

import dataclasses
import math
import os
import typing

import torch

from shardcast._client import Client, Error

_PATCHES = {"cls": "special", "image": "content", "all": "all"}  # protocol 1.0.0
_TOKENS = {"special": "special", "content": "content", "all": "all"}


@dataclasses.dataclass(frozen=True)
class _Config:
    shard_root: typing.Optional[str] = None  # protocol 1.0.0 spelling
    shards: typing.Optional[str] = None      # saev's current spelling
    patches: typing.Optional[str] = None     # "cls" | "image" | "all"
    tokens: typing.Optional[str] = None      # "special" | "content" | "all"
    layer: typing.Union[int, str] = -2
    batch_size: int = 1024 * 16
    drop_last: bool = False
    seed: int = 17
    address: typing.Optional[str] = None     # default $SHARDCAST_ADDRESS
    # saev's own settings, accepted for drop-in use; the daemon loads.
    debug: bool = False
    batch_timeout_s: float = 30.0
    buffer_size: int = 64

    def token_selection(self):
        if self.patches is not None and self.tokens is not None:
            raise ValueError("give patches (protocol 1.0.0) or tokens, not both")
        if self.tokens is not None:
            if self.tokens not in _TOKENS:
                raise ValueError(f"tokens={self.tokens!r}: special, content or all")
            return _TOKENS[self.tokens]
        patches = self.patches if self.patches is not None else "image"
        if patches not in _PATCHES:
            raise ValueError(f"patches={patches!r}: cls, image or all")
        return _PATCHES[patches]

    def root(self):
        root = self.shards if self.shards is not None else self.shard_root
        if root is None:
            raise ValueError("give shard_root (or shards): the dataset's directory")
        return os.fspath(root)


@dataclasses.dataclass(frozen=True)
class OrderedConfig(_Config):
    """saev's ordered (disk order) loader config."""


@dataclasses.dataclass(frozen=True)
class ShuffledConfig(_Config):
    """saev's shuffled loader config."""
    scale_norm: bool = False
    n_threads: int = 4
    log_every_s: float = 30.0


class _DataLoader:
    def __init__(self, cfg, order):
        if getattr(cfg, "scale_norm", False):
            raise NotImplementedError("scale_norm is not implemented (as in saev)")
        self.cfg = cfg
        self._order = order
        self._tokens = cfg.token_selection()
        self._id = os.path.basename(os.path.normpath(cfg.root()))
        self._client = Client(cfg.address)
        info = self._client.describe(self._id)
        if not info.ok:
            raise RuntimeError(f"shardcastd rejected dataset {self._id}: {info.error}")
        self._layer = None if cfg.layer == "all" else int(cfg.layer)
        if self._layer is not None and self._layer not in info.layers:
            raise ValueError(f"layer {self._layer} is not among the recorded "
                             f"layers {list(info.layers)}")
        self._v1 = info.protocol.startswith("1.")
        per_example = {"content": info.content_tokens, "special": 1,
                       "all": info.tokens_per_example}[self._tokens]
        layers = len(info.layers) if self._layer is None else 1
        self._n_samples = info.n_examples * per_example * layers
        self._passes = 0

    @property
    def n_samples(self) -> int:
        return self._n_samples

    @property
    def batch_size(self) -> int:
        return self.cfg.batch_size

    @property
    def drop_last(self) -> bool:
        return self.cfg.drop_last

    @property
    def n_batches(self) -> int:
        return len(self)

    def __len__(self) -> int:
        if self.cfg.drop_last:
            return self.n_samples // self.cfg.batch_size
        return math.ceil(self.n_samples / self.cfg.batch_size)

    def __iter__(self):
        # Each pass is one epoch; a shuffled loader's passes differ (seed, pass).
        seed = self.cfg.seed + self._passes
        self._passes += 1
        with self._client.stream(self._id, layer=self._layer, tokens=self._tokens,
                                 order=self._order, batch_size=self.cfg.batch_size,
                                 seed=seed, epochs=1, drop_last=self.cfg.drop_last,
                                 copy=True) as stream:
            for b in stream:
                act = torch.from_numpy(b.vectors)
                example = torch.from_numpy(b.example_idx.copy())
                token = torch.from_numpy(b.token_idx.astype("int64"))
                if self._v1:
                    yield {"act": act, "image_i": example, "patch_i": token}
                else:
                    yield {"act": act, "example_idx": example, "token_idx": token}

    def shutdown(self):
        """Nothing to stop: the daemon loads (saev's API)."""


class OrderedDataLoader(_DataLoader):
    """saev's ordered DataLoader: every selected vector once, in disk order."""

    def __init__(self, cfg: OrderedConfig):
        super().__init__(cfg, "ordered")


class ShuffledDataLoader(_DataLoader):
    """saev's shuffled DataLoader: every selected vector once per pass, in a
    seeded order (the daemon's shared scan)."""

    def __init__(self, cfg: ShuffledConfig):
        super().__init__(cfg, "shuffled")


__all__ = ["Error", "OrderedConfig", "OrderedDataLoader", "ShuffledConfig",
           "ShuffledDataLoader"]
