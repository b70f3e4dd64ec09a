"""Config values against the annotations of the component they configure.

Losses, corrections, advantage estimators and tasks are chosen by name and
take free-form `*_kwargs` from YAML; a wrong type there (`eps_low: abc`)
must be a ValueError naming the component and the argument, not a TypeError
deep inside the first step.
"""

from __future__ import annotations

import collections.abc
import math
import types
import typing
from collections.abc import Callable
from typing import Annotated, Any

from pydantic import AfterValidator


def _not_blank(path: str) -> str:
    if not path.strip():
        raise ValueError("a path must not be empty or only spaces")
    return path


PathText = Annotated[str, AfterValidator(_not_blank)]
"""A config field naming a file or directory: `""` or `"  "` is a mistake, not the current directory."""


def _plain(value: Any, where: str = "") -> Any:
    """`value` if it is plain data: text, finite numbers, true/false, null, and lists and mappings of these."""
    if isinstance(value, dict):
        for k, v in value.items():
            _plain(v, f"{where}.{k}" if where else str(k))
    elif isinstance(value, list):
        for i, v in enumerate(value):
            _plain(v, f"{where}[{i}]")
    elif isinstance(value, float) and not math.isfinite(value):
        raise ValueError(f"{where or 'the value'} is {value}, not a finite number")
    elif not isinstance(value, (str, int, float, type(None))):  # bool is an int
        raise ValueError(
            f"{where or 'the value'} is a {type(value).__name__} ({value!r:.40}), not text, a number, "
            f"true/false, null, a list or a mapping; quote it in YAML to pass it as text"
        )
    return value


PlainData = Annotated[dict[str, Any], AfterValidator(_plain)]
"""A free-form config mapping (a component's `*_kwargs`): plain data only, as a run's config.json holds it
and a resume compares it. Bytes (`!!binary`), sets and dates cannot be saved, and NaN never equals itself."""

_TYPE_NAMES = {float: "a finite number", int: "an integer", bool: "true or false", str: "a string", type(None): "null"}


def check_arg_types(factory: Callable, kwargs: dict[str, Any], what: str) -> None:
    """Raises a ValueError naming `what` and the argument when a config value does not fit the
    factory's annotation, e.g. `loss 'ppo' argument eps_low: expected a finite number, got 'abc'`.

    Checks the annotations config values can have (int, float, bool, str, None, unions and
    sequences of these); others are left to the constructor. Argument names must already be valid.
    Shared by every "component chosen by name + free-form kwargs" (tasks, losses, corrections,
    advantage estimators).
    """
    if not kwargs:
        return
    hints = typing.get_type_hints(factory.__init__ if isinstance(factory, type) else factory)
    for name, value in kwargs.items():
        if name in hints and not _fits(value, hints[name]):
            raise ValueError(f"{what} argument {name}: expected {_describe(hints[name])}, got {value!r}")


def _fits(value: Any, hint: Any) -> bool:
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin in (typing.Union, types.UnionType):
        return any(_fits(value, a) for a in args)
    if origin in (list, tuple, collections.abc.Sequence):  # YAML gives lists; a str is a Sequence[str]
        is_seq = isinstance(value, (list, tuple)) or (origin is collections.abc.Sequence and isinstance(value, str))
        return is_seq and all(_fits(v, _item(args)) for v in value)
    if hint is int:  # true is not a number
        return isinstance(value, int) and not isinstance(value, bool)
    if hint is float:  # YAML's 1 is a fine float; .nan and .inf would pass every comparison silently wrong
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            return False
        try:
            return math.isfinite(value)
        except OverflowError:  # an int beyond every float
            return False
    if hint in _TYPE_NAMES:
        return isinstance(value, hint)
    return True


def _item(args: tuple) -> Any:
    """The element type of a homogeneous sequence annotation (list[X], Sequence[X], tuple[X, ...]), else Any."""
    return args[0] if len(args) == 1 or args[1:] == (...,) else Any


def _describe(hint: Any) -> str:
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin in (typing.Union, types.UnionType):
        return " or ".join(_describe(a) for a in args)
    if origin in (list, tuple, collections.abc.Sequence):
        item = _item(args)
        return "a list" if item is Any else f"a list ({_describe(item)} each)"
    return _TYPE_NAMES.get(hint, str(hint))
