"""The package's environment variables: read once into a frozen Settings,
each value checked against what its variable accepts."""

from __future__ import annotations

import dataclasses

import pytest

from sglang_mxfp8_hicache import settings
from sglang_mxfp8_hicache.errors import BlockScaledHiCacheConfigError
from sglang_mxfp8_hicache.settings import VARIABLES, Settings

NAMES = [variable.name for variable in VARIABLES]


def test_defaults(monkeypatch):
    monkeypatch.setattr(settings.os, "sched_getaffinity", lambda pid: set(range(16)))
    assert Settings.from_environ({}) == Settings(
        disable=False, staging_mb=512, seal_threads=4, l3_chunk_pages=0
    )
    assert Settings.from_environ({}).staging_bytes == 512 << 20


@pytest.mark.parametrize(("cores", "expected"), [(1, 1), (2, 2), (16, 4)])
def test_seal_threads_default_to_four_or_the_cores(monkeypatch, cores, expected):
    monkeypatch.setattr(settings.os, "sched_getaffinity", lambda pid: set(range(cores)))
    assert Settings.from_environ({}).seal_threads == expected
    given = {"SGLANG_MXFP8_HICACHE_SEAL_THREADS": "8"}
    assert Settings.from_environ(given).seal_threads == 8


@pytest.mark.parametrize(
    ("name", "text", "value"),
    [
        ("SGLANG_MXFP8_HICACHE_DISABLE", "1", True),
        ("SGLANG_MXFP8_HICACHE_DISABLE", " Off ", False),
        ("SGLANG_MXFP8_HICACHE_DISABLE", "", False),
        ("SGLANG_MXFP8_HICACHE_STAGING_MB", "0", 0),
        ("SGLANG_MXFP8_HICACHE_STAGING_MB", "65536", 65536),
        ("SGLANG_MXFP8_HICACHE_SEAL_THREADS", "256", 256),
        ("SGLANG_MXFP8_HICACHE_L3_CHUNK_PAGES", " 8 ", 8),
    ],
)
def test_accepted_values(name, text, value):
    setting = name.removeprefix(settings.PREFIX).lower()
    assert getattr(Settings.from_environ({name: text}), setting) == value


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize(
    "text", ["-1", "abc", "banana", "\u00b2", "1.5", "100000000000", "0x10"]
)
def test_refused_values_name_the_variable_in_one_line(name, text):
    with pytest.raises(BlockScaledHiCacheConfigError) as refused:
        Settings.from_environ({name: text})
    said = str(refused.value)
    assert said.startswith(f"{name}={text!r} is not accepted: give ")
    assert "\n" not in said


def test_zero_seal_threads_refused():
    with pytest.raises(BlockScaledHiCacheConfigError, match="1-256"):
        Settings.from_environ({"SGLANG_MXFP8_HICACHE_SEAL_THREADS": "0"})


def test_every_variable_is_a_setting_and_frozen():
    assert [v.setting for v in VARIABLES] == [
        f.name for f in dataclasses.fields(Settings)
    ]
    with pytest.raises(dataclasses.FrozenInstanceError):
        Settings.from_environ({}).staging_mb = 1


def test_read_once_per_process(monkeypatch):
    monkeypatch.setenv("SGLANG_MXFP8_HICACHE_STAGING_MB", "64")
    first = settings.current()
    monkeypatch.setenv("SGLANG_MXFP8_HICACHE_STAGING_MB", "32")
    assert settings.current() is first and first.staging_mb == 64


@pytest.mark.parametrize(
    ("given", "closest"),
    [
        ("SGLANG_MXFP8_HICACHE_STAGING", "SGLANG_MXFP8_HICACHE_STAGING_MB"),
        ("SGLANG_MXFP8_HICACHE_DISABLED", "SGLANG_MXFP8_HICACHE_DISABLE"),
        ("SGLANG_MXFP8_HICACHE_SEAL_THREAD", "SGLANG_MXFP8_HICACHE_SEAL_THREADS"),
        ("SGLANG_MXFP8_HICACHE_L3_CHUNKS", "SGLANG_MXFP8_HICACHE_L3_CHUNK_PAGES"),
        ("sglang_mxfp8_hicache_staging_mb", "SGLANG_MXFP8_HICACHE_STAGING_MB"),
    ],
)
def test_misspelt_variable_refused_naming_the_closest(given, closest):
    """A name with the package's prefix (in any case) that no variable has is
    refused in one line naming the closest variable, even beside good ones."""
    environ = {given: "128", "SGLANG_MXFP8_HICACHE_DISABLE": "0"}
    with pytest.raises(BlockScaledHiCacheConfigError) as refused:
        Settings.from_environ(environ)
    assert str(refused.value) == (
        f"{given} is not a variable sglang-mxfp8-hicache reads: did you mean "
        f"{closest}? Rename or unset it."
    )


def test_other_variables_are_not_the_packages():
    others = {"SGLANG_HICACHE_STAGING": "1", "MXFP8_HICACHE_X": "1", "HOME": "/"}
    assert Settings.from_environ(others) == Settings.from_environ({})


def test_disabled_reads_no_other_name():
    """The off switch leaves SGLang's own pool in force whatever else is set:
    a misspelt name of the package's does not stop that launch."""
    environ = {"SGLANG_MXFP8_HICACHE_DISABLE": "1", "SGLANG_MXFP8_HICACHE_X": "1"}
    assert Settings.from_environ(environ).disable
