"""saev's argument and path checks, made here before the daemon is asked.

Type checks: saev validates its configs and Metadata with beartype. Where
beartype is installed (it always is beside saev) the same decorator checks
ours, so a bad value raises the same BeartypeCallHintParamViolation; without
it, `checked` compares each field with its annotation and raises TypeError.

Path checks: saev reads a shards directory only at .../saev/shards/<hash>
(AssertionError otherwise), with metadata.json, shards.json and every shard
file listed there present and non-empty (FileNotFoundError, with saev's
messages). They run on the path the user gave, so the messages name it.
"""

import dataclasses
import functools
import inspect
import json
import os
import pathlib
import stat
import typing

try:
    import beartype as _beartype
except ImportError:  # saev is not installed either: our own check
    _beartype = None


def _matches(value, hint):
    """Whether `value` satisfies annotation `hint` (the forms saev uses)."""
    if hint is typing.Any:
        return True
    origin = typing.get_origin(hint)
    args = typing.get_args(hint)
    if origin is typing.Union:
        return any(_matches(value, a) for a in args)
    if origin is typing.Literal:
        return any(type(value) is type(a) and value == a for a in args)
    if origin is list:
        return isinstance(value, list) and all(_matches(v, args[0]) for v in value)
    if origin is tuple:
        if not isinstance(value, tuple):
            return False
        if len(args) == 2 and args[1] is Ellipsis:
            return all(_matches(v, args[0]) for v in value)
        return len(args) == len(value) and all(map(_matches, value, args))
    if isinstance(hint, type):
        return isinstance(value, hint)
    return True


def checked(obj):
    """Validates a dataclass's fields at construction, or a function's
    annotated arguments at each call, as saev's are."""
    if _beartype is not None:
        return _beartype.beartype(obj)
    if not isinstance(obj, type):
        signature = inspect.signature(obj)
        hints = typing.get_type_hints(obj)

        @functools.wraps(obj)
        def call(*args, **kwargs):
            for name, value in signature.bind(*args, **kwargs).arguments.items():
                if name in hints and signature.parameters[name].kind not in (
                        inspect.Parameter.VAR_KEYWORD, inspect.Parameter.VAR_POSITIONAL) \
                        and not _matches(value, hints[name]):
                    raise TypeError(f"{obj.__qualname__}() parameter {name}={value!r} "
                                    f"violates type hint {hints[name]}")
            return obj(*args, **kwargs)
        return call
    init = obj.__init__
    hints = typing.get_type_hints(obj)

    def __init__(self, *args, **kwargs):
        init(self, *args, **kwargs)
        for f in dataclasses.fields(obj):
            value = getattr(self, f.name)
            if not _matches(value, hints[f.name]):
                raise TypeError(f"{obj.__qualname__}.__init__() parameter "
                                f"{f.name}={value!r} violates type hint {hints[f.name]}")

    __init__.__wrapped__ = init
    obj.__init__ = __init__
    return obj


def is_shards_dir(path):
    """saev's test for a shards directory: an existing directory whose path
    ends in saev/shards/<hash>."""
    path = pathlib.Path(path)
    return path.is_dir() and len(path.parts) >= 3 and path.parts[-3:-1] == ("saev", "shards")


def require_shards_dir(path):
    """AssertionError (saev's, which has no message; ours names `path`)
    unless `path` is a shards directory."""
    if not is_shards_dir(path):
        raise AssertionError(f"'{path}' is not a saev shards directory (an existing "
                             "directory .../saev/shards/<hash>)")


def _missing_shards_json(path, fpath):
    """What saev says when shards.json cannot be opened."""
    lines = [f"Could not load shard metadata at '{fpath.resolve(strict=False)}'."]
    where = path.resolve(strict=False)
    if not path.exists():
        lines += [f"Shard directory is missing: '{where}'.",
                  "Scratch shards may have been cleaned. Re-run inference to "
                  "regenerate shards on /fs/scratch."]
        return "\n".join(lines)
    if not path.is_dir():
        lines.append(f"Expected shard directory at '{where}', but it is not a directory.")
        return "\n".join(lines)
    acts = sorted(path.glob("acts*.bin"))
    lines += [f"Shard directory exists: '{where}'.",
              f"metadata.json exists: {(path / 'metadata.json').exists()}.",
              f"labels.bin exists: {(path / 'labels.bin').exists()}.",
              f"acts*.bin files found: {len(acts)}."]
    if acts:
        preview = ", ".join(p.name for p in acts[:5]) + ("" if len(acts) <= 5 else ", ...")
        lines += [f"Example shard files: {preview}",
                  "This looks like an incomplete or older shard layout without "
                  "shards.json. Re-run inference to regenerate shards on /fs/scratch."]
    else:
        lines += ["No shard binaries were found. This shard directory may be partially "
                  "deleted or never fully written.",
                  "Re-run inference to regenerate shards on /fs/scratch."]
    return "\n".join(lines)


@dataclasses.dataclass(frozen=True)
class ShardEntry:
    """One entry of shards.json."""
    name: str
    n_examples: int


def load_shard_entries(path):
    """shards.json of shards directory `path` (a pathlib.Path), as saev
    loads it: AssertionError for a path not ending saev/shards/<hash>,
    FileNotFoundError with saev's explanation when the file is missing,
    TypeError for an entry with other keys."""
    msg = f"Invalid shards path '{path}'. Expected .../saev/shards/<hash>."
    if len(path.parts) < 3 or path.parts[-3:-1] != ("saev", "shards"):
        raise AssertionError(msg)
    fpath = path / "shards.json"
    try:
        with open(fpath) as f:
            entries = json.load(f)
    except FileNotFoundError as e:
        raise FileNotFoundError(_missing_shards_json(path, fpath)) from e
    return [ShardEntry(**entry) for entry in entries]


def validate_shard_files(path, entries):
    """FileNotFoundError naming every listed shard file that is missing,
    empty, unreadable or not a regular file (saev's message and order)."""
    require_shards_dir(path)
    kinds = {"Missing files": [], "Empty files": [], "Unreadable files": [],
             "Not regular files": []}
    for entry in entries:
        fpath = path / entry.name
        where = str(fpath.resolve())
        try:
            st = os.stat(fpath)
        except FileNotFoundError:
            kinds["Missing files"].append(where)
            continue
        except OSError:
            kinds["Unreadable files"].append(where)
            continue
        if not stat.S_ISREG(st.st_mode):
            kinds["Not regular files"].append(where)
        elif st.st_size == 0:
            kinds["Empty files"].append(where)
    if not any(kinds.values()):
        return
    lines = [f"Shard validation failed in '{path.resolve()}':", ""]
    for title, paths in kinds.items():
        if paths:
            lines.append(f"{title} ({len(paths)}):")
            lines.extend(f"  - {p}" for p in paths)
            lines.append("")
    if lines[-1] == "":
        lines.pop()
    raise FileNotFoundError("\n".join(lines))
