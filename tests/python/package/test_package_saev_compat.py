"""shardcast.compat.saev against saev's own code, on the same shards.

saev's source sits beside the repository (../shared/peers/saev, its
README.md); the datasets are written by saev's own ShardWriter
(make_saev_shards.py there: seeded N(0, 1) activations, labels.bin on
request). Each behaviour is compared with what saev's loaders do with the
same config on the same files: configs (fields, defaults, the values they
reject), Metadata, the errors for path mistakes, ordered passes (the same
rows in the same order), shuffled epochs (the same multiset of rows),
IndexedDataset items; then saev's trainer runs with the switch installed.
Selections saev's loaders do not implement are checked against numpy
(saev_reference). The daemon has no root: loaders attach their datasets by
path. Skipped where saev, or what it imports (torchvision), is not
installed.
"""

import dataclasses
import importlib.util
import os
import pathlib
import shutil
import subprocess
import sys
import types
import typing

import numpy as np
import pytest
import torch
import torch.utils.data

from package_fixtures import (CHILD_ENV, HERE, PACKAGE_DIR, REPO_ROOT,  # noqa: F401
                              Reference, assert_exact_epoch, datasets, package_logs,
                              sockdir, start_daemon)

SAEV = REPO_ROOT.parent / "shared" / "peers" / "saev"
SAEV_PATH = [SAEV / "shims", SAEV / "deps", SAEV / "src"]


def _import_saev():
    """saev.data, imported as ../shared/peers/saev/README.md says (shims,
    deps and src on the path; what shims/sitecustomize.py does at an
    interpreter's start done here), or a module-level skip."""
    if not (SAEV / "src" / "saev").is_dir():
        pytest.skip(f"saev's source is not at {SAEV}", allow_module_level=True)
    for p in reversed(SAEV_PATH):
        if str(p) not in sys.path:
            sys.path.insert(0, str(p))
    if "_saev_shims_site" not in sys.modules:
        spec = importlib.util.spec_from_file_location("_saev_shims_site",
                                                      SAEV / "shims" / "sitecustomize.py")
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        sys.modules["_saev_shims_site"] = module
    try:
        import saev.data
        import saev.utils.scheduling
    except ImportError as e:  # torchvision: deploy/install-deps.sh installs it
        pytest.skip(f"saev cannot be imported here: {e}", allow_module_level=True)
    return saev.data


saev_data = _import_saev()
import saev.utils.scheduling  # noqa: E402

import shardcast  # noqa: E402
import shardcast.compat.saev as compat  # noqa: E402
from shardcast.compat.saev import _checks  # noqa: E402

# name: make_saev_shards.py arguments. Each is a few hundred KB.
SHARDS = {
    # [CLS] and labels, layers 0 and 6, 128 examples a shard: 128, 128, 44
    "cls_labels": ["--cls", "--labels", "--layers", "0,6", "--examples", 300,
                   "--tokens", 8, "--d-model", 16],
    # neither, one layer, 50 a shard: 4 full shards and saev's trailing
    # entry of 0 examples
    "plain": ["--layers", "3", "--examples", 200, "--tokens", 6, "--d-model", 8,
              "--tokens-per-shard", 300],
    # [CLS], no labels, a negative layer value, 40 a shard: 40, 40, 10
    "neg_cls": ["--cls", "--layers=-2,5", "--examples", 90, "--tokens", 5,
                "--d-model", 12, "--tokens-per-shard", 480],
    # labels without [CLS], 30 a shard: 30, 30, 10
    "labels_nocls": ["--labels", "--layers", "1,2", "--examples", 70, "--tokens", 4,
                     "--d-model", 8, "--tokens-per-shard", 240],
}
LOADERS = {"shuffled": ("ShuffledConfig", "ShuffledDataLoader"),
           "ordered": ("OrderedConfig", "OrderedDataLoader"),
           "indexed": ("IndexedConfig", "IndexedDataset")}
CONFIGS = ["ShuffledConfig", "OrderedConfig", "IndexedConfig"]


def saev_env(**extra):
    """Environment of a child Python that imports saev and this package."""
    path = [str(p) for p in SAEV_PATH] + [str(PACKAGE_DIR), str(HERE)]
    return dict(CHILD_ENV, PYTHONPATH=os.pathsep.join(path), **extra)


@pytest.fixture(scope="module")
def shards(tmp_path_factory):
    """The SHARDS datasets under <tmp>/saev/shards, written by saev."""
    root = tmp_path_factory.mktemp("saevroot")
    paths = {}
    for name, args in SHARDS.items():
        proc = subprocess.run([sys.executable, str(SAEV / "make_saev_shards.py"), str(root)] +
                              [str(a) for a in args], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, env=saev_env(), timeout=120)
        assert proc.returncode == 0, proc.stderr.decode(errors="replace")[-3000:]
        paths[name] = pathlib.Path(proc.stdout.decode().split()[-1])
        assert paths[name].parent == root / "saev" / "shards", paths[name]
    assert len(set(paths.values())) == len(paths)
    return types.SimpleNamespace(root=root / "saev" / "shards", paths=paths,
                                 refs={n: Reference(p) for n, p in paths.items()})


@pytest.fixture
def daemon(start_daemon, monkeypatch):
    """A daemon at $SHARDCAST_ADDRESS with no root: the loaders attach
    their datasets by path."""
    d = start_daemon("--scan-start-delay-ms", "0", roots=[])
    monkeypatch.setenv("SHARDCAST_ADDRESS", d.address)
    return d


def raised(fn):
    """The exception fn() raises, or None."""
    try:
        fn()
    except Exception as e:  # noqa: BLE001  (any type is compared)
        return e
    return None


def both(kind, **fields):
    """(ours, saev's) loader of `kind` for the same config fields."""
    config, loader = LOADERS[kind]
    return (getattr(compat, loader)(getattr(compat, config)(**fields)),
            getattr(saev_data, loader)(getattr(saev_data, config)(**fields)))


def assert_same_batches(ours, theirs, what):
    assert len(ours) == len(theirs), f"{what}: {len(ours)} batches, saev {len(theirs)}"
    for i, (a, b) in enumerate(zip(ours, theirs)):
        assert list(a) == list(b), f"{what} batch {i}: keys {list(a)}, saev {list(b)}"
        for k in a:
            assert a[k].dtype == b[k].dtype and a[k].shape == b[k].shape, (
                f"{what} batch {i} {k}: {a[k].dtype} {tuple(a[k].shape)}, "
                f"saev {b[k].dtype} {tuple(b[k].shape)}")
            assert torch.equal(a[k], b[k]), f"{what} batch {i}: {k} differs"


def sorted_rows(batches, tokens_per_example):
    """One epoch's rows (act, example_idx, token_idx) in (example, token)
    order, and the number of distinct (example, token) among them."""
    act = torch.cat([b["act"] for b in batches])
    ex = torch.cat([b["example_idx"] for b in batches]).long()
    tok = torch.cat([b["token_idx"] for b in batches]).long()
    key = ex * tokens_per_example + tok
    order = torch.argsort(key)
    return act[order], ex[order], tok[order], len(set(key.tolist()))


# ---------------------------------------------------------------------------
# Names, configs, Metadata.

def test_every_loading_name_of_saev_data_is_here():
    """Every name in saev.data.__all__, and the submodule spellings
    (shuffled / ordered: Config, DataLoader; indexed: Config, Dataset;
    shards: Metadata, PixelAgg), with the kind of object saev has there."""
    for name in saev_data.__all__:
        assert hasattr(compat, name), name
        assert isinstance(getattr(compat, name), type) == isinstance(
            getattr(saev_data, name), type), name
    from shardcast.compat.saev import indexed, ordered, shards, shuffled
    assert (shuffled.Config, shuffled.DataLoader) == (compat.ShuffledConfig,
                                                      compat.ShuffledDataLoader)
    assert (ordered.Config, ordered.DataLoader) == (compat.OrderedConfig,
                                                    compat.OrderedDataLoader)
    assert (indexed.Config, indexed.Dataset) == (compat.IndexedConfig, compat.IndexedDataset)
    assert (shards.Metadata, shards.PixelAgg) == (compat.Metadata, compat.PixelAgg)
    assert issubclass(compat.IndexedDataset, torch.utils.data.Dataset)


def describe_fields(cls):
    """[(name, default, annotation, kw_only)]; PixelAgg (saev's or ours) by
    its name and values."""
    hints = typing.get_type_hints(cls)
    for name, hint in hints.items():
        if isinstance(hint, type) and hint.__name__ == "PixelAgg":
            hints[name] = ("PixelAgg", [m.value for m in hint])
    out = []
    for f in dataclasses.fields(cls):
        default = f.default
        if f.default_factory is not dataclasses.MISSING:
            default = f.default_factory()
        out.append((f.name, default, hints[f.name], f.kw_only if hasattr(f, "kw_only") else 0))
    return out


@pytest.mark.parametrize("name", CONFIGS + ["Metadata"])
def test_configs_have_saevs_fields_defaults_and_types(name):
    """Same fields in the same order (positional construction agrees), the
    same defaults and annotations; frozen, as saev's."""
    ours, theirs = getattr(compat, name), getattr(saev_data, name)
    assert describe_fields(ours) == describe_fields(theirs)
    assert ours.__dataclass_params__.frozen and theirs.__dataclass_params__.frozen
    if name != "Metadata":
        assert dataclasses.asdict(ours()) == dataclasses.asdict(theirs())
        cfg = ours(pathlib.Path("/x/saev/shards/abc"), "content", 0)
        assert cfg == ours(shards=pathlib.Path("/x/saev/shards/abc"), tokens="content", layer=0)
        with pytest.raises(dataclasses.FrozenInstanceError):
            cfg.layer = 1


# Values some config field may reject; each is tried on every config.
BAD_VALUES = [
    dict(shards="/tmp/saev/shards/abc"), dict(shards=None), dict(tokens="cls"),
    dict(tokens="special"), dict(tokens="all"), dict(layer="x"), dict(layer=1.0),
    dict(layer=None), dict(layer=True), dict(batch_size=1.5), dict(batch_size=True),
    dict(drop_last=1), dict(debug="yes"), dict(seed="1"), dict(batch_timeout_s=30),
    dict(min_buffer_fill=2.0), dict(n_threads=-1), dict(ignore_labels=(1,)),
    dict(ignore_labels=[1.0]), dict(ignore_labels=[1, 2]), dict(scale_norm=True),
    dict(use_tmpdir=1), dict(log_every_s="1"), dict(bogus=1),
]


@pytest.mark.parametrize("name", CONFIGS)
@pytest.mark.parametrize("kwargs", BAD_VALUES, ids=lambda kw: "-".join(f"{k}={v!r}"
                                                                       for k, v in kw.items()))
def test_configs_reject_what_saev_rejects(name, kwargs):
    """Each value: accepted by both, or refused by both with the same
    exception type (beartype's, or TypeError for an unknown field)."""
    theirs = raised(lambda: getattr(saev_data, name)(**kwargs))
    ours = raised(lambda: getattr(compat, name)(**kwargs))
    assert type(ours) is type(theirs), f"ours: {ours!r}\nsaev: {theirs!r}"


def test_without_beartype_the_same_values_are_rejected(monkeypatch):
    """Without beartype (installed beside saev, not needed by shardcast),
    the configs' own check refuses exactly what beartype refuses, with
    TypeError."""
    monkeypatch.setattr(_checks, "_beartype", None)
    for name in CONFIGS:
        ours = getattr(compat, name)
        fields = [(f.name, f.type, dataclasses.field(default=f.default)
                   if f.default is not dataclasses.MISSING
                   else dataclasses.field(default_factory=f.default_factory))
                  for f in dataclasses.fields(ours)]
        plain = _checks.checked(dataclasses.make_dataclass(name, fields, frozen=True))
        plain.__module__ = ours.__module__
        for kwargs in BAD_VALUES:
            theirs = raised(lambda: getattr(saev_data, name)(**kwargs))
            got = raised(lambda: plain(**kwargs))
            assert (got is None) == (theirs is None), (name, kwargs, got, theirs)
            assert got is None or type(got) is TypeError, (name, kwargs, got)


WITHOUT_SAEV = r"""
import pathlib
import shardcast.compat.saev as compat
from shardcast.compat.saev import _checks
assert _checks._beartype is None
cfg = compat.ShuffledConfig(shards=pathlib.Path("/x/saev/shards/abc"), layer=3)
assert cfg.batch_size == 16384 and cfg.ignore_labels == []
for bad in (dict(shards="/x/saev/shards/abc"), dict(layer="x"), dict(drop_last=1)):
    try:
        compat.ShuffledConfig(**bad)
    except TypeError:
        pass
    else:
        raise AssertionError(bad)
try:
    compat.install()
except ImportError:
    print("ok")
"""


def test_the_package_works_without_saev_or_beartype(tmp_path):
    """Without saev (and beartype) on the path, the configs check their
    fields themselves (TypeError) and install() is an ImportError."""
    env = dict(CHILD_ENV, PYTHONPATH=str(PACKAGE_DIR))
    proc = subprocess.run([sys.executable, "-c", WITHOUT_SAEV], stdout=subprocess.PIPE,
                          stderr=subprocess.PIPE, env=env, cwd=tmp_path, timeout=60)
    assert proc.returncode == 0, proc.stderr.decode(errors="replace")[-3000:]
    assert proc.stdout.decode().split() == ["ok"]


def test_make_ordered_config_is_saevs(shards):
    """The fields both configs have carry over, overrides win; an unknown
    override, a non-shuffled config and tokens an ordered config cannot
    take are refused with saev's exception types."""
    base = dict(shards=shards.paths["cls_labels"], layer=6, batch_size=128, drop_last=True,
                seed=3, debug=True, buffer_size=8, log_every_s=2.0)
    ours = compat.make_ordered_config(compat.ShuffledConfig(**base), batch_size=64)
    theirs = saev_data.make_ordered_config(saev_data.ShuffledConfig(**base), batch_size=64)
    assert isinstance(ours, compat.OrderedConfig)
    assert dataclasses.asdict(ours) == dataclasses.asdict(theirs)
    for args, kwargs in [((dict(base),), dict(bogus=1)), ((dict(base),), dict(tokens="all")),
                         ((dict(base, tokens="all"),), {})]:
        fields, = args
        t = raised(lambda: saev_data.make_ordered_config(saev_data.ShuffledConfig(**fields),
                                                         **kwargs))
        o = raised(lambda: compat.make_ordered_config(compat.ShuffledConfig(**fields),
                                                      **kwargs))
        assert t is not None and type(o) is type(t), (kwargs, o, t)
    t = raised(lambda: saev_data.make_ordered_config(saev_data.OrderedConfig()))
    o = raised(lambda: compat.make_ordered_config(compat.OrderedConfig()))
    assert t is not None and type(o) is type(t), (o, t)


@pytest.mark.parametrize("name", list(SHARDS))
def test_metadata_is_saevs(shards, tmp_path, name):
    """Metadata.load: dataclasses.asdict equal to saev's, the same hash
    (the directory's name), properties, dataset config and metadata.json
    bytes from dump(); the same exception types for bad fields and a str
    path."""
    path = shards.paths[name]
    ours, theirs = compat.Metadata.load(path), saev_data.Metadata.load(path)
    assert dataclasses.asdict(ours) == dataclasses.asdict(theirs)
    assert ours.pixel_agg == theirs.pixel_agg and theirs.pixel_agg == ours.pixel_agg
    assert ours.pixel_agg != compat.PixelAgg.PREFER_FG
    for attr in ("hash", "tokens_per_example", "n_shards", "examples_per_shard",
                 "shard_shape"):
        assert getattr(ours, attr) == getattr(theirs, attr), attr
    assert ours.hash == path.name
    assert ours.make_data_cfg() == theirs.make_data_cfg()
    dumped = []
    for who, md in (("ours", ours), ("saev", theirs)):
        root = tmp_path / who / "saev" / "shards"
        root.mkdir(parents=True)
        md.dump(root)
        dumped.append((root / md.hash / "metadata.json").read_bytes())
    assert dumped[0] == dumped[1]

    fields = {f.name: getattr(theirs, f.name) for f in dataclasses.fields(theirs)}
    for bad in [dict(family="gpt"), dict(layers=[0]), dict(dataset="fake"),
                dict(max_tokens_per_shard=1), dict(protocol="3.0"), dict(cls_token=1)]:
        kw = dict(fields, **bad)
        kw_ours = dict(kw, pixel_agg=compat.PixelAgg(kw["pixel_agg"].value))
        t = raised(lambda: saev_data.Metadata(**kw))
        o = raised(lambda: compat.Metadata(**kw_ours))
        assert t is not None and type(o) is type(t), (bad, o, t)
    t = raised(lambda: saev_data.Metadata.load(str(path)))
    o = raised(lambda: compat.Metadata.load(str(path)))
    assert t is not None and type(o) is type(t), (o, t)


# ---------------------------------------------------------------------------
# Mistakes.

def make_mistake(shards, tmp_path, mistake):
    """A shards path with `mistake`, from the cls_labels dataset."""
    good = shards.paths["cls_labels"]
    where = tmp_path / "saev" / "shards" / good.name
    if mistake == "missing_dir":
        return tmp_path / "saev" / "shards" / "0badcafe"
    if mistake == "not_under_saev_shards":
        where = tmp_path / "elsewhere" / good.name
    if mistake == "no_metadata":
        where.mkdir(parents=True)
        return where
    shutil.copytree(good, where)
    if mistake == "no_shards_json":
        (where / "shards.json").unlink()
    elif mistake == "missing_shard":
        (where / "acts000001.bin").unlink()
    elif mistake == "empty_shard":
        (where / "acts000001.bin").write_bytes(b"")
        (where / "acts000002.bin").unlink()
    return where


@pytest.mark.parametrize("kind", list(LOADERS))
@pytest.mark.parametrize("mistake", ["missing_dir", "not_under_saev_shards", "no_metadata",
                                     "no_shards_json", "missing_shard", "empty_shard"])
def test_path_mistakes_raise_what_saev_raises(shards, tmp_path, monkeypatch, kind, mistake):
    """The same exception type as saev's loader for the same path mistake,
    with saev's message (naming the path given or its resolved form), or,
    where saev's has none (AssertionError), one naming the path. No daemon
    is asked: the address leads nowhere."""
    monkeypatch.setenv("SHARDCAST_ADDRESS", f"unix:{tmp_path}/no-daemon.sock")
    path = make_mistake(shards, tmp_path, mistake)
    config, loader = LOADERS[kind]
    theirs = raised(lambda: getattr(saev_data, loader)(getattr(saev_data, config)(
        shards=path, layer=6)))
    ours = raised(lambda: getattr(compat, loader)(getattr(compat, config)(
        shards=path, layer=6)))
    assert theirs is not None and type(ours) is type(theirs), f"ours {ours!r}, saev {theirs!r}"
    if str(theirs):
        assert str(ours) == str(theirs)
        assert str(path) in str(ours)
    else:
        assert str(path) in str(ours), str(ours)


@pytest.mark.parametrize("name,fields", [
    ("plain", dict(layer=3, ignore_labels=[1])),
    ("cls_labels", dict(layer="all", ignore_labels=[1])),
    ("cls_labels", dict(layer=6, scale_norm=True)),
])
def test_shuffled_config_mistakes_raise_what_saev_raises(shards, tmp_path, monkeypatch,
                                                         name, fields):
    """ignore_labels without labels.bin (FileNotFoundError), ignore_labels
    with every layer and scale_norm (NotImplementedError): saev's types and
    messages, before any daemon is asked."""
    monkeypatch.setenv("SHARDCAST_ADDRESS", f"unix:{tmp_path}/no-daemon.sock")
    path = shards.paths[name]
    theirs = raised(lambda: saev_data.ShuffledDataLoader(
        saev_data.ShuffledConfig(shards=path, **fields)))
    ours = raised(lambda: compat.ShuffledDataLoader(compat.ShuffledConfig(shards=path,
                                                                          **fields)))
    assert theirs is not None and type(ours) is type(theirs), f"ours {ours!r}, saev {theirs!r}"
    assert str(ours) == str(theirs)


def test_a_layer_the_dataset_lacks(daemon, shards):
    """shuffled / ordered: constructed, then RuntimeError at the first batch
    (saev's manager process dies on it; with batch_timeout_s=0.5 saev says
    so quickly); indexed: AssertionError at construction, saev's message."""
    path = shards.paths["cls_labels"]
    for kind in ("shuffled", "ordered"):
        ours, theirs = both(kind, shards=path, layer=5, batch_timeout_s=0.5)
        for loader in (theirs, ours):
            e = raised(lambda: next(iter(loader)))
            assert type(e) is RuntimeError, (kind, loader, e)
        assert "5" in str(raised(lambda: next(iter(ours))))
    t = raised(lambda: saev_data.IndexedDataset(saev_data.IndexedConfig(shards=path, layer=5)))
    o = raised(lambda: compat.IndexedDataset(compat.IndexedConfig(shards=path, layer=5)))
    assert type(t) is AssertionError and type(o) is AssertionError and str(o) == str(t)
    for tokens in ("special",):
        t = raised(lambda: saev_data.IndexedDataset(saev_data.IndexedConfig(
            shards=shards.paths["plain"], layer=3, tokens=tokens)))
        o = raised(lambda: compat.IndexedDataset(compat.IndexedConfig(
            shards=shards.paths["plain"], layer=3, tokens=tokens)))
        assert type(t) is AssertionError and type(o) is AssertionError, (o, t)


def test_a_dataset_the_daemon_cannot_serve_names_the_path(start_daemon, shards, tmp_path,
                                                          monkeypatch):
    """Past saev's checks, a shard shorter than its entry says (saev fails
    only while reading it): the daemon refuses the dataset at attach and the
    loader says so at construction, naming the path it was given."""
    root = tmp_path / "saev" / "shards"
    bad = root / shards.paths["cls_labels"].name
    shutil.copytree(shards.paths["cls_labels"], bad)
    with open(bad / "acts000001.bin", "r+b") as f:
        f.truncate(1000)
    d = start_daemon("--scan-start-delay-ms", "0", roots=[])
    monkeypatch.setenv("SHARDCAST_ADDRESS", d.address)
    e = raised(lambda: compat.OrderedDataLoader(compat.OrderedConfig(shards=bad, layer=6)))
    assert isinstance(e, (RuntimeError, shardcast.Error)) and str(bad) in str(e), repr(e)


def test_a_shard_cut_short_during_a_pass_ends_it_with_runtime_error(start_daemon, shards,
                                                                   tmp_path, monkeypatch):
    """A shard truncated after the loader was made: saev's pass fails with
    RuntimeError (its reader process crashed); ours too, naming the path,
    when the daemon reaches the shard (DATA_LOSS from the daemon). Here the
    daemon's root holds the dataset: attach finds its catalog entry."""
    root = tmp_path / "saev" / "shards"
    path = root / shards.paths["cls_labels"].name
    shutil.copytree(shards.paths["cls_labels"], path)
    d = start_daemon("--scan-start-delay-ms", "0", roots=[root])
    monkeypatch.setenv("SHARDCAST_ADDRESS", d.address)
    ours, theirs = both("ordered", shards=path, layer=6, batch_size=64, batch_timeout_s=1.0)
    it = iter(ours)
    assert len(next(it)["act"]) == 64
    with open(path / "acts000002.bin", "r+b") as f:
        f.truncate(1000)
    for loader_iter in (it, iter(theirs)):
        e = raised(lambda: [b for b in loader_iter])
        assert type(e) is RuntimeError, repr(e)
    assert str(path) in str(raised(lambda: list(ours)))


# ---------------------------------------------------------------------------
# Batches and items.

@pytest.mark.parametrize("name,layer,batch_size,drop_last", [
    ("cls_labels", 6, 500, False), ("plain", 3, 77, True), ("neg_cls", -2, 128, False),
    ("labels_nocls", 1, 40, False)])
def test_an_ordered_pass_is_saevs(daemon, shards, name, layer, batch_size, drop_last):
    """The same batches as saev's ordered loader, batch for batch: keys
    (token_labels when labels.bin exists), dtypes, shapes and values; the
    same n_samples, n_batches, len, drop_last; disk order (numpy)."""
    ours, theirs = both("ordered", shards=shards.paths[name], layer=layer,
                        batch_size=batch_size, drop_last=drop_last)
    for attr in ("n_samples", "n_batches", "batch_size", "drop_last"):
        assert getattr(ours, attr) == getattr(theirs, attr), attr
    assert len(ours) == len(theirs)
    assert dataclasses.asdict(ours.md) == dataclasses.asdict(theirs.md)
    want = list(theirs)
    got = list(ours)
    assert len(got) == len(ours)
    assert_same_batches(got, want, name)
    r = shards.refs[name]
    rows = []
    for b in got:
        rows += r.rows(b["act"].numpy(), b["example_idx"].numpy(), b["token_idx"].numpy(),
                       np.full(len(b["act"]), layer), check_labels=False)
    assert rows == r.selection(layer)[:len(rows)]
    assert len(rows) == (len(r.selection(layer)) // batch_size * batch_size if drop_last
                         else len(r.selection(layer)))
    ours.shutdown()


@pytest.mark.parametrize("name,layer,batch_size,extra", [
    ("cls_labels", 0, 500, {}), ("plain", 3, 77, {"drop_last": True}),
    ("cls_labels", 6, 256, {"ignore_labels": list(range(50))}),
    ("labels_nocls", 2, 64, {"ignore_labels": [0, 3, 999]})])
def test_a_shuffled_epoch_is_saevs_multiset(daemon, shards, name, layer, batch_size, extra):
    """One pass holds the same rows as saev's (act, example_idx,
    token_idx), each once, in batches of the same sizes (the short last one
    too, drop_last or not, as saev), with the same keys and dtypes; the same
    n_samples (ignore_labels: the labels kept), len and metadata. A second
    pass is the same multiset in another order."""
    ours, theirs = both("shuffled", shards=shards.paths[name], layer=layer,
                        batch_size=batch_size, **extra)
    for attr in ("n_samples", "n_batches", "batch_size", "drop_last"):
        assert getattr(ours, attr) == getattr(theirs, attr), attr
    assert len(ours) == len(theirs)
    assert dataclasses.asdict(ours.metadata) == dataclasses.asdict(theirs.metadata)
    assert isinstance(ours.manager_pid, int)
    want = list(theirs)
    got = list(ours)
    assert [len(b["act"]) for b in got] == [len(b["act"]) for b in want]
    for a, b in zip(got, want):
        assert list(a) == list(b)
        assert all(a[k].dtype == b[k].dtype and a[k].shape == b[k].shape for k in a)
    t = shards.refs[name].T
    ours_rows, theirs_rows = sorted_rows(got, t), sorted_rows(want, t)
    assert ours_rows[3] == theirs_rows[3] == ours.n_samples, "rows repeat or are missing"
    for a, b in zip(ours_rows[:3], theirs_rows[:3]):
        assert torch.equal(a, b)
    again = list(ours)
    assert not all(torch.equal(a["example_idx"], b["example_idx"]) for a, b in zip(again, got))
    for a, b in zip(sorted_rows(again, t)[:3], ours_rows[:3]):
        assert torch.equal(a, b)


@pytest.mark.parametrize("name,layer", [("cls_labels", 6), ("cls_labels", 0), ("plain", 3),
                                        ("labels_nocls", 2), ("neg_cls", -2)])
def test_indexed_items_are_saevs(daemon, shards, name, layer):
    """Content tokens: every item equals saev's item (act, example_idx,
    token_idx, token_label when labels.bin exists; Python ints), len and
    d_model equal, out-of-range indices raise saev's IndexError, a batch
    from __getitems__ and torch's DataLoader equal item by item."""
    cfg = dict(shards=shards.paths[name], layer=layer)
    ours = compat.IndexedDataset(compat.IndexedConfig(**cfg))
    theirs = saev_data.IndexedDataset(saev_data.IndexedConfig(**cfg))
    assert len(ours) == len(theirs) and ours.d_model == theirs.d_model
    assert dataclasses.asdict(ours.md) == dataclasses.asdict(theirs.md)
    items = ours.__getitems__(list(range(len(ours))))
    for i in range(len(ours)):
        a, b = ours[i], theirs[i]
        assert list(a) == list(b), (i, list(a), list(b))
        assert torch.equal(a["act"], b["act"]) and a["act"].dtype == b["act"].dtype, i
        assert {k: (v, type(v)) for k, v in a.items() if k != "act"} == \
            {k: (v, type(v)) for k, v in b.items() if k != "act"}, i
        assert torch.equal(items[i]["act"], a["act"]) and items[i].keys() == a.keys(), i
    for i in (-1, len(ours), len(ours) + 5):
        t, o = raised(lambda: theirs[i]), raised(lambda: ours[i])
        assert type(t) is IndexError and type(o) is IndexError and str(o) == str(t)
    a = next(iter(torch.utils.data.DataLoader(ours, batch_size=32)))
    b = next(iter(torch.utils.data.DataLoader(theirs, batch_size=32)))
    assert_same_batches([a], [b], "collated")


@pytest.mark.parametrize("name,layer", [("cls_labels", 6), ("neg_cls", 5)])
def test_indexed_cls_items_are_right_where_saevs_are_not(daemon, shards, name, layer):
    """tokens="special": item i is example i's [CLS] (numpy), token_idx -1,
    no token_label, as saev's keys and indices. saev's own act comes from
    example (i // S) * (S + 1) of the shard (IndexMap.from_global divides
    where it should take the remainder): equal to ours only in each shard's
    diagonal example. This pins that difference down."""
    cfg = dict(shards=shards.paths[name], layer=layer, tokens="special")
    ours = compat.IndexedDataset(compat.IndexedConfig(**cfg))
    theirs = saev_data.IndexedDataset(saev_data.IndexedConfig(**cfg))
    r = shards.refs[name]
    s = r.geom.S
    assert len(ours) == len(theirs) == r.N
    for i in range(len(ours)):
        a, b = ours[i], theirs[i]
        assert list(a) == list(b) == ["act", "example_idx", "token_idx"]
        assert (a["example_idx"], a["token_idx"]) == (b["example_idx"], b["token_idx"]) == (i, -1)
        assert np.array_equal(a["act"].numpy(), r.vector(i, layer, 0)), i
        assert np.array_equal(b["act"].numpy(), r.vector(i // s * (s + 1), layer, 0)), i


def test_selections_saev_does_not_implement_are_served(daemon, shards):
    """Shuffled [CLS] / all tokens / every layer, ordered every layer and
    indexed all tokens / every layer (saev refuses or never finishes them):
    exact epochs of numpy's vectors, in the documented orders."""
    r = shards.refs["cls_labels"]
    path = r.path
    for tokens in ("special", "all"):
        assert type(raised(lambda: saev_data.ShuffledDataLoader(
            saev_data.ShuffledConfig(shards=path, layer=6, tokens=tokens)))) is AssertionError
    by_value = {r.vector(e, l, t).tobytes(): (e, l, t) for e, l, t in r.selection(None, "all")}
    assert len(by_value) == len(r.selection(None, "all")), "vectors repeat"
    cases = [("shuffled", "special", 6), ("shuffled", "all", 0), ("shuffled", "content", "all"),
             ("shuffled", "all", "all"), ("ordered", "content", "all")]
    for kind, tokens, layer in cases:
        config, loader = LOADERS[kind]
        dl = getattr(compat, loader)(getattr(compat, config)(shards=path, tokens=tokens,
                                                             layer=layer, batch_size=97))
        rows = []
        for b in dl:
            assert b["act"].dtype == torch.float32
            for act, e, t in zip(b["act"].numpy(), b["example_idx"].tolist(),
                                 b["token_idx"].tolist()):
                row = by_value[act.tobytes()]
                assert (row[0], row[2] - r.cls) == (e, t), (kind, tokens, layer)
                rows.append(row)
        want = r.selection(None if layer == "all" else layer, tokens)
        assert len(rows) == dl.n_samples == len(want)
        assert_exact_epoch(rows, want, f"{kind} {tokens} {layer}")
        if kind == "ordered":
            assert rows == want
    for tokens, layer in [("all", 6), ("content", "all"), ("all", "all")]:
        ds = compat.IndexedDataset(compat.IndexedConfig(shards=path, tokens=tokens, layer=layer))
        want = r.selection(None if layer == "all" else layer, tokens)
        assert len(ds) == len(want)
        for i in range(0, len(ds), 7):
            e, l, t = want[i]
            item = ds[i]
            assert (item["example_idx"], item["token_idx"]) == (e, t - r.cls)
            assert np.array_equal(item["act"].numpy(), r.vector(e, l, t))
            assert ("token_label" in item) == (t >= r.cls)


def test_saevs_batch_limiter_and_attributes(daemon, shards):
    """saev's BatchLimiter (its trainer's wrapper) takes our loaders as a
    DataLoaderLike, reads through to `metadata`, and stops once it counts n
    samples, across passes (its count, by its own rule, leaves out one
    batch a pass)."""
    path = shards.paths["cls_labels"]
    ours, theirs = both("shuffled", shards=path, layer=6, batch_size=300)
    for loader in (ours, theirs):
        assert isinstance(loader, saev.utils.scheduling.DataLoaderLike)
    limited = saev.utils.scheduling.BatchLimiter(ours, 5000)
    assert limited.metadata is ours.metadata and len(limited) == 17
    n = sum(len(b["act"]) for b in limited)
    assert 5000 <= limited.n_seen < 5300 and n == limited.n_seen + 2 * 300
    ours.shutdown()
    theirs.shutdown()


# ---------------------------------------------------------------------------
# The switch: saev's own code on the daemon.

TRAINER = r"""
import pathlib, sys
import torch


class Adam(torch.optim.Adam):  # torch 1.13 has no fused Adam for CPU tensors
    def __init__(self, *args, fused=None, **kwargs):
        super().__init__(*args, **kwargs)


torch.optim.Adam = Adam
order, shards, runs = sys.argv[1:4]
import shardcast.compat.saev as compat
if order == "install-first":
    compat.install()
import saev.data
from saev import nn
from saev.framework import train
data = saev.data.ShuffledConfig(shards=pathlib.Path(shards), layer=6, batch_size=256)
cfg = train.Config(train_data=data, val_data=data, n_train=3000, n_val=1000,
                   sae=nn.SparseAutoencoderConfig(d_model=16, d_sae=32), track=False,
                   device="cpu", log_every=2, n_lr_warmup=2, runs_root=pathlib.Path(runs))
if order == "configs-first":
    compat.install()
assert saev.data.ShuffledDataLoader is compat.ShuffledDataLoader
ids = train.worker_fn([cfg])
print("config", type(data).__module__, "ids", *ids)
"""


@pytest.mark.parametrize("order", ["install-first", "configs-first"])
def test_saevs_trainer_runs_on_the_daemon_after_install(daemon, shards, tmp_path, order):
    """saev.framework.train.worker_fn (train: datapoint init, steps with
    metrics every 2, checkpoint; evaluate) on CPU with install() called
    before saev's trainer is imported (configs are shardcast's) or after
    its configs exist (they are saev's): it finishes, writes its checkpoint,
    and the daemon delivered every batch it trained and evaluated on."""
    before = shardcast.Client(daemon.address).status().bytes_delivered
    runs = tmp_path / "saev" / "runs"
    runs.mkdir(parents=True)
    proc = subprocess.run([sys.executable, "-c", TRAINER, order,
                           str(shards.paths["cls_labels"]), str(runs)],
                          stdout=subprocess.PIPE, stderr=subprocess.PIPE, cwd=tmp_path,
                          env=saev_env(SHARDCAST_ADDRESS=daemon.address), timeout=120)
    err = proc.stderr.decode(errors="replace")[-4000:]
    assert proc.returncode == 0, err
    out = proc.stdout.decode().split()
    module = "shardcast.compat.saev._loaders" if order == "install-first" else \
        "saev.data.shuffled"
    assert out[:2] == ["config", module], out
    assert (runs / out[3] / "checkpoint" / "sae.pt").is_file()
    delivered = shardcast.Client(daemon.address).status().bytes_delivered - before
    # datapoint init (2400 vectors), 3000 training and 1000 evaluation
    # vectors of 16 float32, at least.
    assert delivered >= (2400 + 3000 + 1000) * 16 * 4, delivered


INSTALL = r"""
import sys
import saev.data, saev.data.shuffled, saev.data.ordered, saev.data.indexed
import saev.framework.inference as inference
import shardcast.compat.saev as compat
originals = saev.data.ShuffledConfig, inference.OrderedDataLoader
compat.install(address=sys.argv[1])
compat.install()
names = {"ShuffledConfig": ("shuffled", "Config"), "ShuffledDataLoader": ("shuffled", "DataLoader"),
         "OrderedConfig": ("ordered", "Config"), "OrderedDataLoader": ("ordered", "DataLoader"),
         "IndexedConfig": ("indexed", "Config"), "IndexedDataset": ("indexed", "Dataset")}
for name, (module, attr) in names.items():
    ours = getattr(compat, name)
    assert getattr(saev.data, name) is ours, name
    assert getattr(getattr(saev.data, module), attr) is ours, (module, attr)
assert saev.data.make_ordered_config is compat.make_ordered_config
assert inference.OrderedConfig is compat.OrderedConfig
assert inference.OrderedDataLoader is compat.OrderedDataLoader
assert saev.data.Metadata is not compat.Metadata  # saev's writer checks its type
from saev.data import OrderedConfig, OrderedDataLoader
import pathlib
loader = OrderedDataLoader(saev.data.make_ordered_config(
    saev.data.ShuffledConfig(shards=pathlib.Path(sys.argv[2]), layer=6, batch_size=64)))
print(type(loader).__module__, len(next(iter(loader))["act"]))
"""


def test_install_replaces_saevs_loading_names(daemon, shards, tmp_path):
    """install(address=...) (twice: idempotent) replaces the loader names
    in saev.data, its submodules and saev modules imported before (saev's
    inference step), and the address it names is used without
    $SHARDCAST_ADDRESS."""
    env = {k: v for k, v in saev_env().items() if k != "SHARDCAST_ADDRESS"}
    proc = subprocess.run([sys.executable, "-c", INSTALL, daemon.address,
                           str(shards.paths["cls_labels"])], stdout=subprocess.PIPE,
                          stderr=subprocess.PIPE, cwd=tmp_path, env=env, timeout=120)
    assert proc.returncode == 0, proc.stderr.decode(errors="replace")[-4000:]
    assert proc.stdout.decode().split() == ["shardcast.compat.saev._loaders", "64"]
