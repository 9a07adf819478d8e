"""The `chipledger` command line (typer + rich), one module per command group; the app is assembled here.

Wiring only: the rules live in the ledger core. `chipledger.cli._common` holds the app, its groups and the
helpers every group shares; importing each group's module registers its commands.
"""

from __future__ import annotations

import sys

from chipledger.cli._common import app, console
# each group's module registers its commands on import, in the order `chipledger --help` lists them
from chipledger.cli import run, lake, reports, usage, imports, kafka, monitoring, serve  # noqa: F401,E402
from chipledger.cli.slurm import slurm_app  # `chipledger slurm watch|actuate` (docs/slurm.md)

from chipledger.cli.kube import kube_app  # `chipledger kube watch|actuate` (docs/kube.md)

app.add_typer(slurm_app, name="slurm")
app.add_typer(kube_app, name="kube")


@app.command()
def version():
    """Print the version."""
    from chipledger import __version__

    console.print(__version__)


def main():  # pragma: no cover - console script entry
    app()


if __name__ == "__main__":  # pragma: no cover
    sys.exit(app())
