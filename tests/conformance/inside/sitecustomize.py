"""Imported by every Python process started with this directory on PYTHONPATH (SGLang's scheduler and
detokenizer are spawned processes): installs the import placeholders before anything else runs."""

import placeholders

# Packages with no usable CPU build on the package index, imported at module level by SGLang but never
# called on the tested paths: torchvision (its wheels are CUDA builds that fail beside the CPU torch) and
# sgl_kernel (a CUDA extension; 0.5.16 onwards import it unconditionally).
placeholders.install(("torchvision", "sgl_kernel"))

import os  # noqa: E402

if os.environ.get("EAGLE3_SGLANG_REDIRECTS"):  # a named set of cpu_redirects.py (the EAGLE3 server on the CPU)
    import cpu_redirects

    cpu_redirects.install(os.environ["EAGLE3_SGLANG_REDIRECTS"])
