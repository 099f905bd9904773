"""`python -m trainyard.sdk.cli ...`: the `trainyard` command."""
import sys

from trainyard.sdk.cli import main

sys.exit(main())
