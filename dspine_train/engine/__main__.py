"""`python -m dspine_train.engine`: see `dspine_train.engine.cli`."""

import sys

from dspine_train.engine.cli import main

sys.exit(main())
