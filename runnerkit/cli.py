"""The `runnerkit` command (console script, and `python -m runnerkit`): its subcommands, dispatched
before anything heavy is imported.

    runnerkit [flags]        the launch script (runnerkit/infer.py): load, warm up, run requests
    runnerkit serve [flags]  the HTTP server (runnerkit/serve/server.py; dispatched by infer.main)
    runnerkit plan [flags]   the memory plan of a config, without loading (runnerkit/tools/plan.py)
"""

from __future__ import annotations

import sys


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["plan"]:
        from runnerkit.tools.plan_args import build_parser as plan_parser

        plan_parser().parse_args(argv[1:])  # --help and bad flags are answered before torch loads
        from runnerkit.tools.plan import main as plan_main

        return plan_main(argv[1:])
    from runnerkit.infer import main as infer_main

    return infer_main(argv)


if __name__ == "__main__":
    sys.exit(main())
