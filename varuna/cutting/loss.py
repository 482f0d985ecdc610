"""The loss the engine takes from a model's output when the user gives no ``loss_fn``.

A model either returns its scalar loss, or (the Hugging Face convention) an output object with a
``loss`` field: a ``ModelOutput`` or a dict holding a scalar tensor under ``"loss"``, which HF
models fill when the batch has ``labels``. Anything else needs ``loss_fn(output, batch)``.

    >>> import torch
    >>> default_loss({"loss": torch.tensor(2.0), "logits": torch.zeros(2, 3)}, None)
    tensor(2.)
    >>> loss_field(torch.zeros(2))   # not a loss: None
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

__all__ = ["default_loss", "loss_field", "describe_output"]


def loss_field(output) -> torch.Tensor | None:
    """The scalar loss ``output`` carries (itself, its ``"loss"`` key or ``loss`` attribute), or None."""
    if isinstance(output, torch.Tensor):
        return output if output.dim() == 0 else None
    if isinstance(output, Mapping):  # ModelOutput is an OrderedDict too
        value = output.get("loss")
    else:
        value = getattr(output, "loss", None)
    return value if isinstance(value, torch.Tensor) and value.dim() == 0 else None


def describe_output(output) -> str:
    """A few words on ``output`` for error messages."""
    if isinstance(output, torch.Tensor):
        return f"a tensor of shape {list(output.shape)}"
    if isinstance(output, Mapping):
        return f"a {type(output).__name__} with keys {list(output.keys())[:4]} (no scalar 'loss')"
    return f"a {type(output).__name__}"


def default_loss(output, batch) -> torch.Tensor:
    """``loss_fn`` used when none is given: the scalar loss the model returned (see the module
    docstring). Raises ``TypeError`` (one line, with the fix) otherwise."""
    loss = loss_field(output)
    if loss is None:
        raise TypeError(
            f"the model's forward returned {describe_output(output)}, not a scalar loss nor an output with "
            "a scalar 'loss' (Hugging Face models set it when the batch has 'labels'); pass "
            "loss_fn=lambda output, batch: ... to Engine"
        )
    return loss
