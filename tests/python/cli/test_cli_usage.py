"""Exit-code contract: 0 ok, 1 error, 2 usage error; every command has --help."""

import numpy as np
import pytest

import saev_reference as ref

COMMANDS = ["synth", "write", "info", "verify", "get"]


def test_top_level(cli):
    assert cli.run().returncode == 2
    proc = cli.ok("--help")
    for c in COMMANDS:
        assert c in proc.out
    cli.fails("no-such-command", code=2)


@pytest.mark.parametrize("command", COMMANDS)
def test_every_command_has_help(cli, command):
    proc = cli.ok(command, "--help")
    assert proc.out.strip(), "help text goes to stdout"


@pytest.mark.parametrize("command", ["info", "verify", "get", "synth", "write"])
def test_missing_positional_is_usage_error(cli, command):
    cli.fails(command, code=2)


@pytest.fixture
def small(tmp_path):
    acts = np.zeros((2, 1, 3, 4), np.float32)
    path, _, _ = ref.write_dataset(tmp_path, "2.1", acts, [6], True, 100)
    return path


@pytest.mark.parametrize("argv", [
    ["info", "{ds}", "--no-such-flag"],
    ["verify", "{ds}", "--bogus=1"],
    ["get", "{ds}", "--layer", "6", "--token", "0"],            # no --example
    ["get", "{ds}", "--example", "0", "--token", "0"],          # no --layer
    ["get", "{ds}", "--example", "0", "--layer", "6"],          # neither --token nor --all-tokens
    ["get", "{ds}", "--example", "zero", "--layer", "6", "--token", "0"],
    ["get", "{ds}", "--example", "0", "--layer", "6", "--token", "1.5"],
    ["get", "{ds}", "--example"],
])
def test_usage_errors(cli, small, argv):
    argv = [a.replace("{ds}", small) for a in argv]
    cli.fails(*argv, code=2)


def test_token_and_all_tokens_conflict(cli, small):
    proc = cli.run("get", small, "--example", 0, "--layer", 6, "--token", 0, "--all-tokens")
    assert proc.returncode in (1, 2), cli.describe(proc)
    assert proc.err.strip()


def test_synth_bad_variant(cli, tmp_path):
    proc = cli.run("synth", tmp_path, "--layers", "6", "--tokens", 2, "--d-model", 4,
                   "--examples", 2, "--variant", "9.9")
    assert proc.returncode in (1, 2), cli.describe(proc)
    assert "9.9" in proc.err
