"""install(): saev's own code gets shardcast's loaders."""

import importlib
import sys

from shardcast.compat.saev import _loaders

# saev.data's names that install() replaces, and their saev.data submodule
# spellings.
_NAMES = {
    "ShuffledConfig": ("shuffled", "Config"),
    "ShuffledDataLoader": ("shuffled", "DataLoader"),
    "OrderedConfig": ("ordered", "Config"),
    "OrderedDataLoader": ("ordered", "DataLoader"),
    "IndexedConfig": ("indexed", "Config"),
    "IndexedDataset": ("indexed", "Dataset"),
    "make_ordered_config": (None, None),
}
# id(saev's object) -> (saev's object, ours), from the first install(); the
# object is kept so that its id is not reused.
_replaced = {}


def install(address=None):
    """Makes saev's data loading shardcast's, in this process: saev.data's
    ShuffledConfig, ShuffledDataLoader, OrderedConfig, OrderedDataLoader,
    IndexedConfig, IndexedDataset and make_ordered_config (and their
    spellings in saev.data.shuffled / ordered / indexed) become this
    package's, in saev.data and in every saev module already imported that
    holds them, so saev's trainer (saev.framework.train) and inference read
    through the daemon. `address` is the daemon's (default: the one a
    Client finds without an address: $SHARDCAST_ADDRESS, the node's, or
    your own, started when needed). Call it before importing saev's trainer, whose
    Config names the config class it was imported with (its loaders accept
    saev's own configs too). Idempotent; ImportError without saev."""
    if address is not None:
        _loaders._address = address
    data = importlib.import_module("saev.data")
    for name, (module, attr) in _NAMES.items():
        ours = getattr(_loaders, name)
        theirs = getattr(data, name)
        if theirs is not ours:
            _replaced[id(theirs)] = (theirs, ours)
        if module is not None:
            theirs = getattr(importlib.import_module(f"saev.data.{module}"), attr)
            if theirs is not ours:
                _replaced[id(theirs)] = (theirs, ours)
    for module_name, module in list(sys.modules.items()):
        if module is None or not (module_name == "saev" or module_name.startswith("saev.")):
            continue
        for attr, value in list(vars(module).items()):
            pair = _replaced.get(id(value))
            if pair is not None and pair[0] is value:
                setattr(module, attr, pair[1])
