"""Route the plugin's log records through vLLM's handlers (patch record P9).

Why: vLLM configures only its own "vllm" logger (handler, format, VLLM_LOGGING_LEVEL);
loggers named "vllm_tree_spec.*" fall through to Python's root logger, whose default
level drops INFO, so plan changes, the CPU tree-attention path and per-request
"speculation off" notes never reached a server's log.
What it changes: the "vllm_tree_spec" logger gets the "vllm" logger's handlers and
level, and stops propagating (no duplicate lines). Called in tree workers and the
tree config route only, once per process.
Upstream change that removes it: a documented way for plugins to log under vLLM's
logging configuration (or VLLM_LOGGING_CONFIG_PATH covering plugin loggers).
"""

from __future__ import annotations

import logging

PLUGIN_LOGGER = "vllm_tree_spec"


def route_to_vllm_handlers() -> None:
    ours, theirs = logging.getLogger(PLUGIN_LOGGER), logging.getLogger("vllm")
    if getattr(ours, "_tree_routed", False) or not theirs.handlers:
        return  # done, or vLLM's logging is not configured (VLLM_CONFIGURE_LOGGING=0): leave it to the user
    for h in theirs.handlers:
        ours.addHandler(h)
    ours.setLevel(theirs.level)
    ours.propagate = False
    ours._tree_routed = True
