"""graphfuse.compiler.use_inductor_defaults: what tools/check_compile_speed.py and
tools/bench_first_step.py turn off to measure graphfuse's inductor settings against inductor's own."""

from __future__ import annotations

import pytest

import graphfuse.compiler.inductor as inductor
from graphfuse.compiler import settings as compile_settings
from graphfuse.compiler import use_inductor_defaults
from graphfuse.errors import UnsupportedError


def test_a_dropped_table_is_empty_for_the_compile_and_the_cache_key(monkeypatch):
    # monkeypatch puts the module's tables back after the test
    monkeypatch.setattr(inductor, "FIRST_STEP", dict(inductor.FIRST_STEP))
    monkeypatch.setattr(inductor, "COMPILE_SPEED", dict(inductor.COMPILE_SPEED))
    speed = dict(inductor.COMPILE_SPEED)
    assert inductor.FIRST_STEP and speed
    use_inductor_defaults("FIRST_STEP")
    assert inductor.FIRST_STEP == {} and inductor.COMPILE_SPEED == speed
    assert compile_settings.settings()["programs"] == {"COMPILE_SPEED": speed, "FIRST_STEP": {}}
    use_inductor_defaults("COMPILE_SPEED")
    assert compile_settings.settings()["programs"] == {"COMPILE_SPEED": {}, "FIRST_STEP": {}}


def test_the_workarounds_and_unknown_tables_are_refused_by_name():
    before = dict(inductor.WORKAROUNDS)
    for name in ("WORKAROUNDS", "FIRST_STEPS"):
        with pytest.raises(
            UnsupportedError, match=f"use_inductor_defaults\\('{name}'\\).*'COMPILE_SPEED' or 'FIRST_STEP'"
        ):
            use_inductor_defaults(name)
    assert inductor.WORKAROUNDS == before


def test_an_export_result_of_compile_fx_is_refused_and_a_function_passes_through():
    def compiled(*args):
        return args

    assert inductor._runnable(compiled) is compiled
    with pytest.raises(UnsupportedError, match=r"inductor returned list instead of a compiled function.*aot_inductor"):
        inductor._runnable(["/tmp/model.so"])  # what AOTInductor's mode returns: file names
