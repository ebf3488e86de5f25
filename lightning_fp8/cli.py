"""LightningCLI helpers: parse errors that say what *is* accepted.

jsonargparse reports a misspelled ``init_args`` key as ``Option 'amax_histroy_len' is not accepted``
inside a long report, without the accepted keys, and a ``torch.dtype`` written without its module
(``compute_dtype: bfloat16``) as ``Expected a dot import path string``. :class:`FP8ArgumentParser`
appends, to every such error, the closest accepted argument and the full list (or the right dtype
spelling)::

    from lightning.pytorch.cli import LightningCLI
    from lightning_fp8.cli import FP8ArgumentParser

    LightningCLI(MyModel, MyData, parser_class=FP8ArgumentParser)
"""

from __future__ import annotations

import difflib
import importlib
import inspect
import re
from typing import NoReturn

import torch
from lightning.pytorch.cli import LightningArgumentParser

_UNKNOWN_OPTION = re.compile(r"class_path '([\w.]+)':\s*Option '([\w.]+)' is not accepted")
_IMPORT_PATH = re.compile(r"Expected a dot import path string: (\w+)")


def _accepted_arguments(class_path: str) -> list[str] | None:
    module, _, name = class_path.rpartition(".")
    try:
        cls = getattr(importlib.import_module(module), name)
        parameters = inspect.signature(cls.__init__).parameters.values()
    except (ImportError, AttributeError, TypeError, ValueError):
        return None
    return [p.name for p in parameters if p.name != "self" and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]


def explain_parse_error(message: str) -> str:
    """``message`` plus one hint line per unknown ``init_args`` key and per dtype missing ``torch.``."""
    hints = []
    for class_path, key in dict.fromkeys(_UNKNOWN_OPTION.findall(message)):
        accepted = _accepted_arguments(class_path)
        if accepted is None:
            continue
        close = difflib.get_close_matches(key, accepted, n=1)
        guess = f"; did you mean {close[0]!r}?" if close else "."
        hints.append(f"{class_path} does not accept {key!r}{guess} Accepted: {', '.join(accepted)}.")
    for name in dict.fromkeys(_IMPORT_PATH.findall(message)):
        if isinstance(getattr(torch, name, None), torch.dtype):
            hints.append(f"{name!r} is a torch dtype: write it as torch.{name} (for example compute_dtype: torch.{name}).")
    return message if not hints else message.rstrip("\n") + "\n" + "\n".join(hints)


class FP8ArgumentParser(LightningArgumentParser):
    """``LightningArgumentParser`` whose errors also name what is accepted (see :func:`explain_parse_error`).

    Pass it as ``LightningCLI(..., parser_class=FP8ArgumentParser)``.
    """

    def error(self, message: str, ex: Exception | None = None) -> NoReturn:  # type: ignore[override]
        super().error(explain_parse_error(message), ex)
        raise AssertionError("unreachable")  # pragma: no cover
