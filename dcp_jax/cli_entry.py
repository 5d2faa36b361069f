"""The ``dcp-jax`` command's entry point (``[project.scripts]``).

Some ``DCP_JAX_*`` switches are read when their module is imported (``DCP_JAX_DIRECT_LAUNCH``,
``DCP_JAX_DIRECT_OFF``/``_ON``, ``DCP_JAX_FUSED_FLAG_GATE``, ``DCP_JAX_PACK_TICKET_EACH``), so a
typo in one fails the CLI's own import (and a library import of the module: a switch's bad value
is refused where it is read, never guessed), before typer can report it. This module imports the
CLI inside a guard that prints such an error as one line, exit status 2 (typer's status for a bad
parameter), instead of a traceback.
"""

from __future__ import annotations

import sys


def main() -> None:
    """Run the ``dcp-jax`` typer app (`dcp_jax.cli.app`).

    Raises:
        SystemExit: 2 with one line on stderr when a ``DCP_JAX_*`` switch is unknown
            (`pallas_kernels.config.EnvSwitchError`); otherwise the app's own exit status."""
    try:
        from dcp_jax.cli import app
    except ValueError as exc:
        # Not imported at the top: importing pallas_kernels already reads the switches. When the
        # error is a switch's, pallas_kernels.config was loaded before it was raised.
        config = sys.modules.get("pallas_kernels.config")
        if config is None or not isinstance(exc, config.EnvSwitchError):
            raise
        print(f"dcp-jax: error: {exc}", file=sys.stderr)
        raise SystemExit(2) from None
    app()


if __name__ == "__main__":  # python -m dcp_jax.cli_entry
    main()
