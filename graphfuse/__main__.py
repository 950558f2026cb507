"""`python -m graphfuse`: the `graphfuse` command."""

import sys

from graphfuse.cli import main

sys.exit(main())
