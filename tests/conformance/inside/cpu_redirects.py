"""Redirect sets: SGLang entry points with no CPU path, pointed at SGLang's own alternative code.

SGLang's EAGLE3 worker has no CPU path in the releases under test: it calls CUDA (`torch.cuda.synchronize`)
and sgl_kernel ops (tree build, greedy verify) that have no CPU build. A redirect set replaces exactly
those entry points, each by an SGLang implementation that runs here: its Triton kernels under Triton's
interpreter (TRITON_INTERPRET=1), or its own code for another platform. No replacement is a computation of
this project's: each is a function taken from an SGLang wheel as published (the served release's own, or a
newer release's where the served one has none; see `kernels_site`), located by file and name, and run on the
branch SGLang takes on the platform that has that path (XPU or CUDA: the platform flags of its module). The one
wrapper here, `_torch_cpu_synchronize`, only gives torch's own no-op CPU synchronize a name of its own.

A set is applied in every SGLang process (the scheduler is a spawned process) by sitecustomize when
EAGLE3_SGLANG_REDIRECTS names it: each redirect is installed right after its module is first imported,
before any other module copies the name, and one line `EAGLE3 redirect: ...` per redirect goes to stderr
(the server log) when it is installed.
"""

from __future__ import annotations

import ast
import importlib.abc
import os
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

SET_VARIABLE = "EAGLE3_SGLANG_REDIRECTS"
KERNELS_VARIABLE = "EAGLE3_SGLANG_KERNELS_SITE"  # site directory of the SGLang wheel the Triton kernels come from
LOG_PREFIX = "EAGLE3 redirect: "


@dataclass(frozen=True)
class Redirect:
    module: str  # the module whose attribute is replaced (after it is imported)
    attribute: str
    source: str  # the SGLang function that replaces it, as "module.function" (wheel:... for a newer wheel's)
    why: str
    resolve: Callable[[], object]  # returns the replacement, called when `after` has been imported
    after: str = ""  # the module whose import installs it (default: `module`)

    def line(self) -> str:
        return f"{self.module}.{self.attribute} -> {self.source}"


def kernels_site() -> Path:
    """The SGLang wheel whose XPU path supplies the Triton tree kernels (spec_tree.py, 0.5.23 layout)."""
    site = os.environ.get(KERNELS_VARIABLE)
    if not site:
        raise RuntimeError(f"{KERNELS_VARIABLE} must name the site directory of an SGLang wheel with "
                           "sglang/kernels/ops/speculative/spec_tree.py (0.5.23 onwards)")
    return Path(site)


def _sglang_import(node: ast.stmt) -> bool:
    if isinstance(node, ast.Import):
        return any(alias.name.split(".")[0] == "sglang" for alias in node.names)
    return node.level > 0 or (node.module or "").split(".")[0] == "sglang"


def definitions_from(path: Path, names: tuple[str, ...], namespace: dict) -> dict:
    """Run the top-level definitions `names` of the SGLang source file `path`, after the file's own imports
    of other packages (torch, triton, enum), in `namespace`, which supplies the module-level names they use
    besides. The code is compiled from the file itself, so tracebacks, line numbers and Triton's source
    lookup point into the wheel. The file's imports of sglang are not run: they bind the newer release's own
    modules, which do not exist beside an older release's package."""
    tree = ast.parse(path.read_text(), filename=str(path))
    imports = [node for node in tree.body
               if isinstance(node, (ast.Import, ast.ImportFrom)) and not _sglang_import(node)]
    chosen = [node for node in tree.body
              if isinstance(node, (ast.FunctionDef, ast.ClassDef)) and node.name in names]
    missing = set(names) - {node.name for node in chosen}
    if missing:
        raise RuntimeError(f"{path} defines no {sorted(missing)}")
    exec(compile(ast.Module(body=imports + chosen, type_ignores=[]), str(path), "exec"), namespace)
    return namespace


_SPEC_TREE: dict | None = None


def spec_tree() -> dict:
    """sglang/kernels/ops/speculative/spec_tree.py of the kernels wheel, on its XPU path: the two Triton
    kernels, their launchers and the dispatching verify_tree_greedy_func, with the platform flags of an XPU
    machine (whose path there is those Triton kernels)."""
    global _SPEC_TREE
    if _SPEC_TREE is None:
        path = kernels_site() / "sglang" / "kernels" / "ops" / "speculative" / "spec_tree.py"
        flags = {"_is_cuda": False, "_is_hip": False, "_is_musa": False, "_is_npu": False, "_is_cpu": False,
                 "_is_xpu": True}
        namespace = {"__name__": "eagle3_sglang_kernels.spec_tree", **flags}
        _SPEC_TREE = definitions_from(path, ("TreeMaskMode", "sgl_build_tree_kernel_efficient_triton",
                                             "verify_tree_greedy_kernel_triton", "sgl_build_tree_kernel_triton",
                                             "verify_tree_greedy_triton", "verify_tree_greedy_func"), namespace)
    return _SPEC_TREE


def on_branch(module_name: str, function: str, **flags):
    """`function` of the already imported SGLang module `module_name`, defined again from the module's own
    source over a copy of its globals in which the platform flags `flags` are set: the same code, taking the
    branch SGLang takes on that platform (its Triton kernel launch, under the interpreter here)."""
    module = sys.modules[module_name]
    return definitions_from(Path(module.__file__), (function,), {**vars(module), **flags})[function]


def _torch_cpu_synchronize():
    """torch.cpu.synchronize under a name of its own: torch.compile keys its handlers by function and refuses
    one function registered as both torch.cuda.synchronize and torch.cpu.synchronize."""
    import torch

    def synchronize(device=None):
        torch.cpu.synchronize(device)

    return synchronize


EAGLE_UTILS = "sglang.srt.speculative.eagle_utils"
CACHE_LOCS = "sglang.srt.speculative.triton_ops.cache_locs"
NEWER = "wheel:sglang.kernels.ops.speculative.spec_tree"

REDIRECT_SETS: dict[str, tuple[Redirect, ...]] = {
    "eagle3-cpu": (
        Redirect("torch.cuda", "synchronize", "torch.cpu.synchronize",
                 "LlamaForCausalLM.set_embed / set_embed_and_head, through which the EAGLE worker hands the "
                 "target's embedding (and head) to the draft, synchronize CUDA, which the CPU build of torch "
                 "refuses; torch's own CPU synchronize is its no-op counterpart",
                 _torch_cpu_synchronize, after="torch"),  # torch.cpu exists once torch is imported
        Redirect(EAGLE_UTILS, "sgl_build_tree_kernel_efficient", f"{NEWER}.sgl_build_tree_kernel_triton",
                 "build_tree_kernel_efficient calls sgl_kernel's CUDA tree build, unbound off CUDA (NameError); "
                 "newer releases build the tree with this Triton kernel on XPU (same arguments)",
                 lambda: spec_tree()["sgl_build_tree_kernel_triton"]),
        Redirect(EAGLE_UTILS, "verify_tree_greedy_func", f"{NEWER}.verify_tree_greedy_func (its XPU branch)",
                 "off CUDA and NPU this release's greedy verify returns its inputs unchanged (no error, wrong "
                 "counts); newer releases verify with verify_tree_greedy_triton on XPU (same arguments, result)",
                 lambda: spec_tree()["verify_tree_greedy_func"]),
        Redirect(CACHE_LOCS, "assign_extend_cache_locs_func",
                 f"{CACHE_LOCS}.assign_extend_cache_locs_func (its CUDA branch)",
                 "off CUDA, HIP, MUSA and NPU it returns None (the verify pass then writes the KV cache at "
                 "cache[None]); on CUDA it launches this release's own Triton kernel assign_extend_cache_locs",
                 lambda: on_branch(CACHE_LOCS, "assign_extend_cache_locs_func", _is_cuda=True)),
    ),
}


class _AfterImport(importlib.abc.MetaPathFinder):
    """Installs redirects into a module right after it is executed, whichever process imports it."""

    def __init__(self, redirects: tuple[Redirect, ...]):
        self.by_module: dict[str, list[Redirect]] = {}
        for redirect in redirects:
            self.by_module.setdefault(redirect.after or redirect.module, []).append(redirect)

    def find_spec(self, fullname, path, target=None):
        if fullname not in self.by_module:
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(fullname, path, target)
            if spec is not None:
                break
        else:
            return None
        original = spec.loader.exec_module
        redirects = self.by_module[fullname]

        def exec_module(module):
            original(module)
            for redirect in redirects:
                setattr(sys.modules[redirect.module], redirect.attribute, redirect.resolve())
                print(LOG_PREFIX + redirect.line(), file=sys.stderr, flush=True)

        spec.loader.exec_module = exec_module
        return spec


def install(name: str) -> None:
    if name not in REDIRECT_SETS:
        raise RuntimeError(f"{SET_VARIABLE}={name!r}: no such redirect set (known: {sorted(REDIRECT_SETS)})")
    sys.meta_path.insert(0, _AfterImport(REDIRECT_SETS[name]))
