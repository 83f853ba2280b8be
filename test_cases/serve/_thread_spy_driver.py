"""`runnerkit serve` with a spy on the threads that run `init_modules`, warmup and each request.

    python -m test_cases.serve._thread_spy_driver SERVE_ARGV...

Before the server starts, `BaseRunner.init_modules`, `BaseRunner.warmup` and `BaseRunner.run_pipeline`
are wrapped to append one line `<what> <thread ident> <thread name>` to the file named by the
environment variable `THREAD_SPY` (the thread as `threading` sees it, not as the runner records it).
Used by test_serving_thread.py only.
"""

from __future__ import annotations

import os
import sys
import threading
from typing import Any

from runnerkit.runners.base import BaseRunner
from runnerkit.serve.server import main

SPY = os.environ["THREAD_SPY"]


def spy(name: str) -> None:
    real = getattr(BaseRunner, name)

    def wrapped(self: Any, *args: Any, **kwargs: Any) -> Any:
        t = threading.current_thread()
        with open(SPY, "a", encoding="utf-8") as f:
            f.write(f"{name} {threading.get_ident()} {t.name}\n")
        return real(self, *args, **kwargs)

    setattr(BaseRunner, name, wrapped)


for method in ("init_modules", "warmup", "run_pipeline"):
    spy(method)

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
