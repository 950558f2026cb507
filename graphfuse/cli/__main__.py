"""`python -m graphfuse.cli`: the `graphfuse` command."""

import sys

from graphfuse.cli import main

sys.exit(main())
