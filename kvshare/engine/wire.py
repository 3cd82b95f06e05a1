"""Plain-data dataclasses as nested lists for msgpack, derived from their fields.

`codec(cls)` reads `dataclasses.fields(cls)` and the field types once and returns an (encode,
decode) pair: a dataclass becomes the list of its fields in declaration order, lists and tuples
become lists, numbers, strings, bytes, booleans and None stay as they are; decoding rebuilds
each field by its declared type (tuples as tuples, nested dataclasses as themselves). A field
added to a dataclass therefore travels with no edit here, and a field of a type that has no
plain form (a live record, a tensor) is refused when the codec is built, not on some step.
"""
from __future__ import annotations

import dataclasses
import operator
import types
import typing
from typing import Any, Callable

Encode = Callable[[Any], Any]
Decode = Callable[[Any], Any]

_SCALARS = (int, float, bool, str, bytes, type(None))


def _same(value):
    return value


def codec(tp) -> tuple[Encode, Decode]:
    """(encode, decode) for values of type `tp`: a plain dataclass, or a list, tuple, optional or
    scalar type built from them. Raises TypeError for a type with no plain form."""
    if tp in _SCALARS:
        return _same, _same
    if dataclasses.is_dataclass(tp) and isinstance(tp, type):
        return _dataclass_codec(tp)
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin is list:
        enc, dec = codec(args[0])
        if enc is _same and dec is _same:
            return _same, _same  # msgpack packs and unpacks the list as it is
        return (lambda xs: [enc(x) for x in xs]), (lambda xs: [dec(x) for x in xs])
    if origin is tuple:
        if len(args) == 2 and args[1] is Ellipsis:
            enc, dec = codec(args[0])
            if enc is _same and dec is _same:
                return _same, tuple
            return (lambda xs: [enc(x) for x in xs]), (lambda xs: tuple(dec(x) for x in xs))
        parts = [codec(a) for a in args]
        return ((lambda xs: [e(x) for (e, _), x in zip(parts, xs)]),
                (lambda xs: tuple(d(x) for (_, d), x in zip(parts, xs))))
    if origin in (typing.Union, types.UnionType):
        options = [a for a in args if a is not type(None)]
        if all(a in _SCALARS for a in options):
            return _same, _same
        if len(options) == 1:
            enc, dec = codec(options[0])
            if enc is _same and dec is _same:
                return _same, _same
            return (lambda v: None if v is None else enc(v)), (lambda v: None if v is None else dec(v))
    raise TypeError(f"{tp!r} has no plain wire form (plain dataclasses, lists, tuples, optionals, numbers, "
                    f"strings and bytes only)")


def _dataclass_codec(cls: type) -> tuple[Encode, Decode]:
    hints = typing.get_type_hints(cls)
    fields = dataclasses.fields(cls)
    for f in fields:
        if not f.init:
            raise TypeError(f"{cls.__name__}.{f.name} is not an __init__ field: the decoder could not restore it")
    names = [f.name for f in fields]
    parts = [codec(hints[n]) for n in names]
    # Plans go out every step: read the fields in one call and convert only those that need it.
    read = operator.attrgetter(*names) if len(names) > 1 else (lambda obj: (getattr(obj, names[0]),))
    encoders = [(i, enc) for i, (enc, _) in enumerate(parts) if enc is not _same]
    decoders = [(i, dec) for i, (_, dec) in enumerate(parts) if dec is not _same]
    name, count = cls.__name__, len(names)
    positional = not any(f.kw_only for f in fields)  # then __init__ takes the fields in this order

    def encode(obj) -> list:
        values = list(read(obj))
        for i, enc in encoders:
            values[i] = enc(values[i])
        return values

    def decode(data: list):
        if len(data) != count:
            raise ValueError(f"{name}: {len(data)} fields on the wire, {count} declared (both sides must "
                             f"run the same kvshare)")
        values = list(data)
        for i, dec in decoders:
            values[i] = dec(values[i])
        return cls(*values) if positional else cls(**dict(zip(names, values)))

    return encode, decode
