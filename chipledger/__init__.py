"""chipledger: the command line and the wiring of the embedded run (files in, lake and store out)."""

__version__ = "0.1.0"
