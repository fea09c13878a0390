"""saev's Metadata (metadata.json of a shards directory) and PixelAgg."""

import base64
import dataclasses
import enum
import hashlib
import json
import math
import pathlib
import pickle
import sys
import typing

from shardcast.compat.saev import _checks

_KW_ONLY = {"kw_only": True} if sys.version_info >= (3, 10) else {}


class PixelAgg(enum.Enum):
    """How pixel-level segmentation labels were aggregated to token labels.

    A member equals saev's member of the same value (saev.data.PixelAgg), so
    a Metadata of ours and one of saev's compare equal field by field."""

    MAJORITY = "majority"
    PREFER_FG = "prefer-fg"

    def __eq__(self, other):
        if isinstance(other, enum.Enum) and type(other).__name__ == "PixelAgg":
            return self.value == other.value
        return NotImplemented

    def __hash__(self):
        return hash(self._name_)  # as enum.Enum hashes, so saev's members too


def _json_value(value):
    """A field value as saev's JSON writer (orjson) writes it."""
    if isinstance(value, enum.Enum):
        return value.value
    if isinstance(value, pathlib.PurePath):
        return str(value)
    if isinstance(value, tuple):
        return [_json_value(v) for v in value]
    return value


@_checks.checked
@dataclasses.dataclass(frozen=True, **_KW_ONLY)
class Metadata:
    """The metadata.json of a saev shards directory: saev's fields, defaults,
    checks and properties. `dataclasses.asdict` of it equals saev's."""

    family: typing.Literal["bird-mae", "clip", "dinov2", "dinov3", "fake-clip", "pe-core",
                           "pe-spatial", "siglip"]
    ckpt: str
    layers: tuple[int, ...]
    content_tokens_per_example: int
    cls_token: bool
    d_model: int
    n_examples: int
    max_tokens_per_shard: int
    data: str
    dataset: pathlib.Path
    pixel_agg: PixelAgg = PixelAgg.MAJORITY
    dtype: typing.Literal["float32"] = "float32"
    protocol: typing.Literal["1.0.0", "1.1", "2.1"] = "2.1"

    def __post_init__(self):
        if self.examples_per_shard < 1:
            raise AssertionError("At least one example per shard must fit; increase "
                                 "max_tokens_per_shard.")

    @classmethod
    def load(cls, shards_dir: pathlib.Path) -> "Metadata":
        """The Metadata in `shards_dir`/metadata.json, as saev loads it:
        AssertionError unless `shards_dir` is .../saev/shards/<hash>,
        FileNotFoundError without metadata.json, KeyError / ValueError /
        TypeError for fields saev's Metadata does not have or take."""
        _checks.require_shards_dir(shards_dir)
        with open(shards_dir / "metadata.json") as f:
            fields = json.load(f)
        fields["layers"] = tuple(fields.pop("layers"))
        fields["dataset"] = pathlib.Path(fields["dataset"])
        fields["pixel_agg"] = PixelAgg(fields["pixel_agg"])
        return cls(**fields)

    def _json(self, indent=None):
        values = {f.name: _json_value(getattr(self, f.name))
                  for f in dataclasses.fields(self)}
        if indent is None:
            return json.dumps(values, separators=(",", ":"), ensure_ascii=False)
        return json.dumps(values, indent=indent, ensure_ascii=False)

    def dump(self, shards_root: pathlib.Path):
        """Writes metadata.json into `shards_root`/<hash> (shards_root must
        end in saev/shards), as saev does."""
        shards_root = pathlib.Path(shards_root)
        if not (shards_root.is_dir() and shards_root.parts[-2:] == ("saev", "shards")):
            raise AssertionError(f"'{shards_root}' is not a saev shards root "
                                 "(an existing directory .../saev/shards)")
        (shards_root / self.hash).mkdir(exist_ok=True)
        with open(shards_root / self.hash / "metadata.json", "wb") as f:
            f.write(self._json(indent=2).encode("utf-8"))

    @property
    def hash(self) -> str:
        """saev's id of these metadata: the first 8 hex digits of the SHA-256
        of their compact JSON, fields in declaration order (the directory
        name saev gives the dataset)."""
        return hashlib.sha256(self._json().encode("utf-8")).hexdigest()[:8]

    @property
    def tokens_per_example(self) -> int:
        """Content tokens, plus one for [CLS] when there is one."""
        return self.content_tokens_per_example + int(self.cls_token)

    @property
    def n_shards(self) -> int:
        """Shards needed for n_examples."""
        return math.ceil(self.n_examples / self.examples_per_shard)

    @property
    def examples_per_shard(self) -> int:
        """Examples in a full shard."""
        return self.max_tokens_per_shard // (self.tokens_per_example * len(self.layers))

    @property
    def shard_shape(self) -> tuple[int, int, int, int]:
        """(examples_per_shard, layers, tokens_per_example, d_model)."""
        return (self.examples_per_shard, len(self.layers), self.tokens_per_example,
                self.d_model)

    def make_data_cfg(self):
        """The dataset config saev pickled into `data` (unpickling it needs
        saev's dataset classes, as in saev)."""
        return pickle.loads(base64.b64decode(self.data.encode("utf8")))
