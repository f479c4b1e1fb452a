"""`python -m dspine_train.serving`: see `dspine_train.serving.cli`."""

import sys

from dspine_train.serving.cli import main

sys.exit(main())
