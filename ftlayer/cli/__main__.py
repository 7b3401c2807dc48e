"""`python -m ftlayer.cli`: the `ftlayer` command line."""

import sys

from ftlayer.cli import main

sys.exit(main())
