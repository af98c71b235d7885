"""Entry point of a child process that runs one SGLang release's code (see ../releases.py).

Usage: run.py PROBE < job.json. Imports `PROBE` (a module beside this file) and prints its
`run(job)` answer as one JSON line after RESULT_PREFIX; anything else SGLang prints is ignored.
"""

import importlib
import json
import sys

import placeholders

RESULT_PREFIX = "EAGLE3-PROBE-RESULT "
# Packages with no usable CPU build on the package index, imported at module level by SGLang but never
# called on the tested paths: torchvision (its wheels are CUDA builds that fail beside the CPU torch) and
# sgl_kernel (a CUDA extension; 0.5.16 onwards import it unconditionally).
placeholders.install(("torchvision", "sgl_kernel"))


def main() -> None:
    job = json.load(sys.stdin)
    answer = importlib.import_module(sys.argv[1]).run(job)
    print(RESULT_PREFIX + json.dumps(answer), flush=True)


if __name__ == "__main__":
    main()
