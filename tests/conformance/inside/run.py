"""Entry point of a child process that runs one SGLang release's code (see ../releases.py).

Usage: run.py PROBE < job.json. Imports `PROBE` (a module beside this file) and prints its
`run(job)` answer as one JSON line after RESULT_PREFIX; anything else SGLang prints is ignored.
"""

import importlib
import json
import sys

RESULT_PREFIX = "EAGLE3-PROBE-RESULT "  # placeholders are installed by sitecustomize.py beside this file


def main() -> None:
    job = json.load(sys.stdin)
    answer = importlib.import_module(sys.argv[1]).run(job)
    print(RESULT_PREFIX + json.dumps(answer), flush=True)


if __name__ == "__main__":
    main()
