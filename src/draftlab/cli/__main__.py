"""`python -m draftlab.cli`."""

import sys

from draftlab.cli.main import main

sys.exit(main())
