"""`python -m training ...`: the `shuttle train` command (what torchrun runs with `-m training`)."""
import sys

from training.cli import main

if __name__ == "__main__":
    sys.exit(main())
