"""Random-number-generator states as tensors and plain values.

Checkpoints are loaded with ``torch.load(weights_only=True)``, which accepts
tensors, dicts, lists, tuples, numbers and strings only, so numpy's state
(an ndarray inside a tuple) travels as a tensor plus numbers.
"""

from __future__ import annotations

import random
import sys

import torch


def capture() -> dict:
    state: dict = {"torch": torch.get_rng_state(), "python": _python_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    numpy = sys.modules.get("numpy")
    if numpy is not None:  # only if the program uses numpy at all
        name, keys, pos, has_gauss, cached = numpy.random.get_state()
        state["numpy"] = {
            "name": str(name),
            "keys": torch.from_numpy(keys.astype("int64")),
            "pos": int(pos),
            "has_gauss": int(has_gauss),
            "cached": float(cached),
        }
    return state


def restore(state: dict) -> None:
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    if "numpy" in state:
        import numpy

        s = state["numpy"]
        numpy.random.set_state(
            (s["name"], s["keys"].numpy().astype("uint32"), s["pos"], s["has_gauss"], s["cached"])
        )


def _python_state() -> list:
    version, internal, gauss = random.getstate()
    return [version, list(internal), gauss]
