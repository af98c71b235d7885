"""The reference server (`eagle3 serve`, eagle3/serve/reference.py): this project's own, in this interpreter, on the
CPU or one GPU. It stands for the SGLang release serving.release names: SGLang's API, telemetry flags and loader
rules for that release."""

from __future__ import annotations

import sys

from eagle3.algorithms import DraftAlgorithm
from eagle3.config.deployment import TelemetrySection
from eagle3.procs import cpu_threads
from eagle3.serving.base import LaunchSpec
from eagle3.serving.sglang import SGLang, telemetry_flags


class Reference(SGLang):
    """SGLang's API (health probe, /server_info), its own command line."""

    name = "reference"
    title = "the reference server"
    forks_warm = True

    def command(self, spec: LaunchSpec, target, draft, telemetry: TelemetrySection | None = None,
                entry: DraftAlgorithm | None = None) -> list[str]:
        s = spec.serving  # the server reads the draft's algorithm from the draft itself
        command = [sys.executable, "-m", "eagle3.cli", "serve", "--target", str(target)]
        command += ["--draft", str(draft)] if draft is not None else []
        command += ["--num-steps", str(s.num_steps), "--eagle-topk", str(s.eagle_topk),
                    "--num-draft-tokens", str(s.num_draft_tokens)]
        command += ["--release", s.release] if s.release else []
        command += ["--trust-remote-code"] if spec.target.trust_remote_code else []
        command += ["--dtype", spec.target.dtype, "--threads", str(cpu_threads(spec.cpu_threads))]
        return command + ["--host", s.host, "--port", str(s.port)] + telemetry_flags(telemetry)

    def served_release(self, reported: str, configured: str | None) -> str | None:
        return configured  # the release it stands for (None: the strictest rules)


REFERENCE = Reference()
