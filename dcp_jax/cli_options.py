"""What the ``dcp-jax`` commands share: refusing a bad option before any work (as
`typer.BadParameter`, exit status 2), the main job's `JobConfig` from the options, JSON encoding."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Optional, Sequence

import typer

__all__ = ["check_out_path", "parse_paths"]

_MODES = {"direct": ("direct",), "packed": ("packed",), "both": ("direct", "packed")}


def uses_hetero_job(model: str, *, prefill_tp_size: int, tp_size: int, prefill_layout, decode_layout) -> bool:
    """The one switch ``transfer`` and ``plan`` share: True when the options need the
    heterogeneous (TP / cache layout) job and plan, `dcp_jax.cli_hetero`: a TP size other than 1
    on either side, a named cache layout, or a model only that plan knows. A differing page size
    alone stays on the main job (its prefill side takes its own page size)."""
    from dcp_jax.geometry import geometry_names
    from dcp_jax.hetero.cost import HETERO_MODELS

    return bool(prefill_tp_size != 1 or tp_size != 1 or prefill_layout or decode_layout
                or (model in HETERO_MODELS and model not in geometry_names()))


def _fail(msg: str) -> None:
    raise typer.BadParameter(msg)


def _rank_failed(exc: BaseException) -> None:
    """A rank process failed or did not answer in time: its message (the rank's traceback when
    it sent one) on stderr and exit status 1, not this process's traceback."""
    from rich.console import Console
    from rich.markup import escape  # a traceback's brackets are not markup

    Console(stderr=True).print(f"[red bold]error[/]: {escape(str(exc))}", highlight=False)
    raise typer.Exit(1)


def check_out_path(path: Optional[Path], option: str) -> None:
    """Refuses an output path that cannot be written, before any work: its folder must exist.

    Args:
        path: the file to be written, or None (nothing to check).
        option: the option that gave it (``"--json"``), named in the message.

    Raises:
        ValueError: its folder is missing, it is a folder, or it is not writable.
    """
    if path is None:
        return
    if str(path) in ("", "."):  # Path("") is "."; an empty argument names no file
        raise ValueError(f"{option} needs a file name (an empty argument or '.' names the current folder)")
    parent = path.parent if str(path.parent) else Path(".")
    if not parent.is_dir():
        what = "is a file, not a folder" if parent.exists() else "does not exist"
        raise ValueError(f"{option} {str(path)!r}: folder {str(parent)!r} {what}")
    if path.is_dir():
        raise ValueError(f"{option} {str(path)!r} is a folder, not a file")
    if not os.access(parent, os.W_OK) or (path.exists() and not os.access(path, os.W_OK)):
        raise ValueError(f"{option} {str(path)!r}: not writable")
    # os.access says yes to root everywhere (a read-only mount, /proc): open it for real, once.
    existed = os.path.lexists(path)  # a dangling link counts: its target is written later anyway
    try:
        with open(path, "a"):
            pass
    except OSError as exc:
        raise ValueError(f"{option} {str(path)!r}: not writable ({exc.strerror or exc})") from None
    if not existed:
        path.unlink(missing_ok=True)


def check_plot_path(path: Optional[Path], option: str) -> None:
    """`check_out_path`, and a file name whose suffix names a format matplotlib writes (it picks
    the format by the suffix, and refused an unknown one only after the whole run).

    Raises:
        ValueError: as `check_out_path`, an unknown or missing suffix (the formats listed), or
            no matplotlib.
    """
    if path is None:
        return
    check_out_path(path, option)
    try:
        from matplotlib.backend_bases import FigureCanvasBase
    except ImportError:
        raise ValueError(f"{option} draws with matplotlib: pip install 'dcp-jax[plot]'") from None

    kinds = sorted(FigureCanvasBase.get_supported_filetypes())
    if path.suffix[1:].lower() not in kinds:
        raise ValueError(f"{option} {str(path)!r}: the suffix picks the image format, one of "
                         f"{', '.join('.' + k for k in kinds)}")


def _check_out_path(path: Optional[Path], option: str) -> None:
    """`check_out_path` as a bad option (exit status 2)."""
    try:
        check_out_path(path, option)
    except ValueError as exc:
        _fail(str(exc))


def parse_paths(text: str, names: Sequence[str]) -> tuple[str, ...]:
    """``--path``'s comma list: every entry exactly one of ``names``, each once. Nothing is
    stripped or case-folded: a near miss (``" packed"``, ``"Packed"``, ``"packed,"``) is
    refused rather than read as the name it resembles.

    Raises:
        ValueError: an entry not in ``names`` or given twice; the message names ``--path``, the
            entry and the valid names.
    """
    items = tuple(text.split(","))
    valid = f"--path takes a comma list (no spaces) of distinct names of {', '.join(names)}"
    for x in items:
        if x not in names:
            raise ValueError(f"--path={text!r}: {x!r} is not a path name; {valid}")
        if items.count(x) > 1:
            raise ValueError(f"--path={text!r} names {x!r} twice; {valid}")
    return items


def _one_list(values: Optional[Sequence[str]], option: str) -> Optional[str]:
    """A comma-list option declared repeatable only to catch a repeat: click keeps the last of a
    repeated plain option, silently dropping the others."""
    if values and len(values) > 1:
        _fail(f"{option} given {len(values)} times ({', '.join(map(repr, values))}): give it once, "
              f"as one comma list (e.g. {option} {','.join(values)})")
    return values[0] if values else None


def _job_config(mode: str, path: Optional[str] = None, **kwargs):
    """The main job's JobConfig for these options: the one validation ``transfer`` and ``plan`` share.
    ``path`` (``--path``, a comma list, `parse_paths`) wins over ``mode``."""
    from dcp_jax.job import JobConfig
    from dcp_jax.job.config import PATHS

    if mode not in _MODES:
        _fail(f"--mode={mode!r} must be one of {', '.join(_MODES)}")
    modes = _MODES[mode]
    if path is not None:
        try:
            modes = parse_paths(path, PATHS)
        except ValueError as exc:
            _fail(str(exc))
    try:
        return JobConfig(modes=modes, **kwargs)
    except ValueError as exc:
        _fail(str(exc))


def _json_default(o):
    import numpy as np

    if isinstance(o, np.integer):
        return int(o)
    if isinstance(o, np.floating):
        return float(o)
    if isinstance(o, np.ndarray):
        return o.tolist()
    if isinstance(o, (set, tuple)):
        return list(o)
    return str(o)

