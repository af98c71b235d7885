"""The child process that runs one SGLang release's code for the test session (see ../releases.py).

It reads one request per line on stdin, {"probe": module beside this file, "job": {...}}, and answers
each with one line, RESULT_PREFIX + {"answer": the module's run(job)} or {"error": the traceback};
anything else SGLang prints is ignored by the reader. Placeholders are installed by sitecustomize.py.
"""

import importlib
import json
import sys
import traceback

RESULT_PREFIX = "EAGLE3-PROBE-RESULT "


def main() -> None:
    for line in sys.stdin:
        request = json.loads(line)
        try:
            reply = {"answer": importlib.import_module(request["probe"]).run(request["job"])}
        except Exception:  # reported to the test, which fails with it; the process serves the next probe
            reply = {"error": traceback.format_exc()}
        print(RESULT_PREFIX + json.dumps(reply), flush=True)


if __name__ == "__main__":
    main()
