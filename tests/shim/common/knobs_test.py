"""Knob resolution in one pass (shim/common/knobs.py): explicit > the user's cache > the shipped table > ("auto") a
tune > the heuristic, the cache and the table each read at most once."""

import sys
from dataclasses import dataclass

import pytest

from shim.common.knob_cache import KnobCache
from shim.common.knobs import InvalidKnobsError, KnobSet, resolve_knob_set


@dataclass(frozen=True)
class K(KnobSet):
    a: int = 1
    b: int = 2


class CountingCache(KnobCache):
    def __init__(self, entries):
        super().__init__("")
        self.entries, self.reads = entries, 0

    def get(self, key):
        self.reads += 1
        return self.entries.get(key)


def _resolve(knobs, *, cache_hit=None, table_hit=None, tuned=K(a=7)):
    cache = CountingCache({"k": cache_hit} if cache_hit else {})
    calls = {"table": 0, "tune": 0, "validate": 0}

    def shipped():
        calls["table"] += 1
        return table_hit

    def tune():
        calls["tune"] += 1
        return tuned

    def validate(k):
        calls["validate"] += 1
        if k.a < 0:
            raise InvalidKnobsError("a", "negative")
        return k

    got = resolve_knob_set(knobs, knob_type=K, heuristic=lambda: K(), validate=validate, cache_key="k", cache=cache,
                           shipped=shipped, tune=tune)
    return got, cache.reads, calls


@pytest.mark.parametrize("knobs", [None, "auto"])
def test_the_order_and_each_source_read_once(knobs):
    assert _resolve(knobs, cache_hit={"a": 3})[0] == (K(a=3), "cache")
    (got, reads, calls) = _resolve(knobs, table_hit={"a": 4})
    assert got == (K(a=4), "table") and reads == 1 and calls["table"] == 1 and calls["tune"] == 0
    (got, reads, calls) = _resolve(knobs)
    assert reads == 1 and calls["table"] == 1 and calls["validate"] == 1
    if knobs == "auto":  # a miss of both tunes, once
        assert got == (K(a=7), "autotune") and calls["tune"] == 1
    else:
        assert got == (K(), "heuristic") and calls["tune"] == 0


def test_explicit_knobs_read_nothing():
    (got, reads, calls) = _resolve(K(a=5), cache_hit={"a": 3})
    assert got == (K(a=5), "explicit") and reads == 0 and calls["table"] == calls["tune"] == 0
    (got, reads, _) = _resolve({"b": 9})
    assert got == (K(b=9), "explicit") and reads == 0


def test_every_source_is_validated():
    for kw in (dict(cache_hit={"a": -1}), dict(table_hit={"a": -1}), dict(tuned=K(a=-1))):
        with pytest.raises(InvalidKnobsError):
            _resolve("auto", **kw)
    with pytest.raises(InvalidKnobsError, match="expected None, 'auto'"):
        _resolve(7)


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-v", "-p", "no:cacheprovider"]))
