import sys

from runnerkit.cli import main

sys.exit(main())
