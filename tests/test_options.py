"""llmrs/options.py and the table llmrs/cliutil.py makes of it: one flag per option field, the same
name with dashes, the same default, read back into the same options; an error worded either way."""
from __future__ import annotations

import argparse
import dataclasses

import pytest

from llmrs.cliutil import add_option_flags, error_line, flag_of, options_from
from llmrs.options import OptionError, OptionTypeError
from llmrs.runtime.backends import BackendOptionError, BackendOptions
from llmrs.runtime.cli import parser as run_parser
from llmrs.runtime.kv import KVOptions
from llmrs.runtime.sampler import SamplerConfig
from llmrs.runtime.serve import parser as serve_parser

OPTIONS = (KVOptions, SamplerConfig, BackendOptions)


@pytest.mark.parametrize("options_class", OPTIONS)
def test_every_field_is_a_flag_of_the_same_name_and_default(options_class):
    ap = argparse.ArgumentParser()
    add_option_flags(ap, options_class)
    flags = {a.option_strings[0]: a for a in ap._actions if a.option_strings and a.dest != "help"}
    fields = dataclasses.fields(options_class)
    assert sorted(flags) == sorted("--" + f.name.replace("_", "-") for f in fields)
    assert all(flags[flag_of(f.name)].help for f in fields)     # every flag says what it does
    assert options_from(ap.parse_args([]), options_class) == options_class()


def test_flags_parse_into_the_options_of_the_same_names():
    ap = argparse.ArgumentParser()
    add_option_flags(ap, KVOptions)
    args = ap.parse_args(["--eviction-policy", "h2o", "--eviction-window", "40", "--h2o-recent", "3",
                          "--memory-threshold-mb", "512.5", "--log-evictions"])
    kv = options_from(args, KVOptions).check()
    assert kv == KVOptions(eviction_policy="h2o", eviction_window=40, h2o_recent=3, memory_threshold_mb=512.5,
                           log_evictions=True)
    with pytest.raises(SystemExit):     # choices come from the field
        ap.parse_args(["--snapkv-pooling", "min"])


@pytest.mark.parametrize("command_parser, options", [
    (run_parser, OPTIONS), (serve_parser, (KVOptions, BackendOptions))])
def test_the_command_lines_offer_every_option_of_theirs(command_parser, options):
    dests = {a.dest for a in command_parser()._actions}
    for options_class in options:
        missing = {f.name for f in dataclasses.fields(options_class)} - dests
        assert not missing, (command_parser, options_class, missing)


def test_an_option_error_is_worded_by_python_name_or_by_flag():
    e = OptionError("{0} {1} must come after {2}", "switch_back_at", "max_tokens", "top_p")
    assert str(e) == "switch_back_at max_tokens must come after top_p"
    assert error_line(e, {"max_tokens": "-n"}) == "--switch-back-at -n must come after --top-p"
    assert str(OptionError("a {literal} brace")) == "a {literal} brace"     # no names: the text as it is
    assert error_line(ValueError("plain")) == "plain"
    assert issubclass(BackendOptionError, OptionError) and issubclass(OptionTypeError, TypeError)
    with pytest.raises(BackendOptionError) as caught:
        BackendOptions(switch_threshold=9, switch_back_at=4)
    assert error_line(caught.value) == "--switch-back-at 4 must come after --switch-threshold 9"
    assert str(caught.value) == "switch_back_at 4 must come after switch_threshold 9"
