"""Final composers: the methods of the kernel backend and frontend bases that call the arch and format hooks in
order. Arch and format code fills in hooks; it must not replace a composer by accident (a method of the same name
in a subclass would silently skip the base's order, its guard or its cache), so a class that does is refused when
it is defined.
"""

from __future__ import annotations

import typing

__all__ = ["final", "Composed"]


def final(fn):
    """Mark a composer (typing.final, which also tells a type checker). Works on functions and properties."""
    target = fn.fget if isinstance(fn, property) else fn
    typing.final(target)
    target.__final__ = True  # typing.final sets it from Python 3.11 only
    return fn


def _is_final(value) -> bool:
    if isinstance(value, property):
        value = value.fget
    return getattr(value, "__final__", False) is True


class Composed:
    """Base of a class with final composers: a subclass that defines a name a base marked final is a TypeError."""

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        for base in cls.__mro__[1:]:
            for name, value in vars(base).items():
                if _is_final(value) and name in vars(cls):
                    raise TypeError(f"{cls.__module__}.{cls.__qualname__} overrides {base.__qualname__}.{name}, a final "
                                    "composer; fill in the hooks it calls instead")
