"""State trees (what ``state_dict()`` returns: dicts, lists, tuples, numbers, strings, tensors) to
and from JSON, without pickle.

Two shapes: :func:`to_json` puts tensors inline (base64 of their bytes; for small state: an LR
scheduler, a data loader's position, an RNG state), :func:`flatten` takes them out into a flat
``{key: tensor}`` dict beside a JSON skeleton (for formats that store tensors natively: a
safetensors file, a DCP checkpoint). Decoding accepts only real torch dtypes and shapes that match
the bytes, so a tampered file cannot make it run code or allocate what its bytes do not hold.

Example::

    >>> tree = {"step": 3, "betas": (0.9, 0.99), "gen": torch.arange(3, dtype=torch.uint8)}
    >>> back = from_json(json.loads(json.dumps(to_json(tree))))
    >>> back["betas"], back["gen"].tolist()
    ((0.9, 0.99), [0, 1, 2])
    >>> skeleton, tensors = flatten(tree)
    >>> unflatten(skeleton, tensors)["gen"] is tensors["t0"]
    True
"""

from __future__ import annotations

import base64
import json
from collections.abc import Callable, Mapping
from typing import Any

import torch

__all__ = ["StateCodecError", "flatten", "from_json", "json_bytes", "to_json", "unflatten"]


class StateCodecError(ValueError):
    """A state that cannot be encoded (an object that is not plain data) or decoded (malformed)."""


_TAGS = ("@tensor", "@t", "@tuple", "@dict", "@bytes", "@dtype")


def _encode(x: Any, tensor: Callable[[torch.Tensor], Any], path: str) -> Any:
    if x is None or isinstance(x, (bool, int, float, str)):
        return x
    if isinstance(x, torch.Tensor):
        return tensor(x)
    if isinstance(x, torch.dtype):
        return {"@dtype": str(x).removeprefix("torch.")}
    if isinstance(x, (bytes, bytearray)):
        return {"@bytes": base64.b64encode(bytes(x)).decode()}
    if isinstance(x, torch.Size):
        x = tuple(x)
    if isinstance(x, tuple):
        return {"@tuple": [_encode(v, tensor, f"{path}[{i}]") for i, v in enumerate(x)]}
    if isinstance(x, list):
        return [_encode(v, tensor, f"{path}[{i}]") for i, v in enumerate(x)]
    if isinstance(x, Mapping):
        if all(isinstance(k, str) and k not in _TAGS for k in x):
            return {k: _encode(v, tensor, f"{path}.{k}") for k, v in x.items()}
        return {"@dict": [[_encode(k, tensor, path), _encode(v, tensor, f"{path}[{k!r}]")]
                          for k, v in x.items()]}
    if hasattr(x, "item") and hasattr(x, "dtype"):  # a numpy scalar
        return x.item()
    raise StateCodecError(
        f"{path} is a {type(x).__module__}.{type(x).__qualname__}: a saved state may hold "
        "only tensors, numbers, strings, bytes, lists, tuples and dicts (varuna never pickles objects); "
        "return plain data from state_dict()"
    )


def _dtype(name: Any) -> torch.dtype:
    dt = getattr(torch, name, None) if isinstance(name, str) else None
    if not isinstance(dt, torch.dtype):
        raise StateCodecError(f"bad dtype {name!r} in a saved state")
    return dt


def _decode(x: Any, tensor: Callable[[Any], torch.Tensor]) -> Any:
    if isinstance(x, list):
        return [_decode(v, tensor) for v in x]
    if not isinstance(x, dict):
        return x
    if len(x) == 1:
        (tag, v), = x.items()
        if tag in ("@tensor", "@t"):
            return tensor(v)
        if tag == "@tuple":
            return tuple(_decode(e, tensor) for e in v)
        if tag == "@dict":
            return {_decode(k, tensor): _decode(e, tensor) for k, e in v}
        if tag == "@bytes":
            return base64.b64decode(v)
        if tag == "@dtype":
            return _dtype(v)
    return {k: _decode(v, tensor) for k, v in x.items()}


def to_json(tree: Any) -> Any:
    """``tree`` as JSON-able data, tensors inline (moved to the host).

    >>> to_json({"x": (1, torch.tensor([1.0]))})["x"]["@tuple"][1]["@tensor"]["shape"]
    [1]
    """

    def tensor(t: torch.Tensor) -> dict:
        t = t.detach().to("cpu").contiguous()
        raw = t.reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b""
        return {"@tensor": {"dtype": str(t.dtype).removeprefix("torch."), "shape": list(t.shape),
                            "data": base64.b64encode(raw).decode()}}

    return _encode(tree, tensor, "state")


def from_json(data: Any) -> Any:
    """Inverse of :func:`to_json` (raises :class:`StateCodecError` on a malformed tensor)."""

    def tensor(v: Any) -> torch.Tensor:
        try:
            dt, shape, raw = _dtype(v["dtype"]), [int(s) for s in v["shape"]], base64.b64decode(v["data"])
        except (KeyError, TypeError, ValueError) as e:
            raise StateCodecError(f"malformed tensor in a saved state ({e})") from None
        n = 1
        for s in shape:
            n *= s
        if any(s < 0 for s in shape) or n * torch.empty((), dtype=dt).element_size() != len(raw):
            raise StateCodecError(f"a saved tensor of shape {shape} {dt} does not match its {len(raw)} bytes")
        if not raw:
            return torch.empty(shape, dtype=dt)
        return torch.frombuffer(bytearray(raw), dtype=dt).reshape(shape)

    return _decode(data, tensor)


def json_bytes(tree: Any) -> bytes:
    """``to_json(tree)`` serialised (what a size limit is checked on)."""
    return json.dumps(to_json(tree), separators=(",", ":")).encode()


def flatten(tree: Any, prefix: str = "t") -> tuple[Any, dict[str, torch.Tensor]]:
    """``(skeleton, tensors)``: ``tree`` as JSON-able data whose tensors are ``{"@t": key}``
    references into ``tensors`` (keys ``prefix0``, ``prefix1``, ...; the tensors themselves, not
    copies)."""
    tensors: dict[str, torch.Tensor] = {}

    def tensor(t: torch.Tensor) -> dict:
        key = f"{prefix}{len(tensors)}"
        tensors[key] = t
        return {"@t": key}

    return _encode(tree, tensor, "state"), tensors


def unflatten(skeleton: Any, tensors: Mapping[str, torch.Tensor] | Callable[[str], torch.Tensor]) -> Any:
    """Inverse of :func:`flatten`; ``tensors`` may be a function (key -> tensor) that loads lazily."""
    get = tensors if callable(tensors) else tensors.__getitem__

    def tensor(key: Any) -> torch.Tensor:
        try:
            return get(key)
        except KeyError:
            raise StateCodecError(f"a saved state refers to tensor {key!r}, which is not there") from None

    return _decode(skeleton, tensor)
