import sys

from chipledger.cli import app

sys.exit(app())
