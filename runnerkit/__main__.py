import sys

from runnerkit.infer import main

sys.exit(main())
