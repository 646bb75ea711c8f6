"""vLLM 0.34's `SpeculatorConfig` for `method: "tree"` (patch record P14; imported only on vLLM with the
speculator registry: `register()` in this package's `__init__` registers it by qualified name).

It describes the tree speculator to vLLM as a speculator without a draft checkpoint of vLLM's (the tree
drafters load their own networks), whose options travel in `speculator_options` (the one
method-specific option 0.34 lets a custom method declare), validated here with `TreeSpecConfig`. The
config route (patch P1) writes a user's `{"method": "tree", <tree keys>}` in that form.
"""

from __future__ import annotations

from typing import ClassVar

from vllm.v1.worker.gpu.spec_decode.speculator_config import SpeculatorConfig

SPECULATOR_CLASS = "vllm_tree_spec.integration.v2.speculator.TreeSpeculator"


class TreeSpeculatorConfig(SpeculatorConfig):
    base_method: ClassVar[str | None] = None  # not based on a built-in method
    speculator_class: ClassVar[str | None] = SPECULATOR_CLASS
    supported_options: ClassVar[frozenset[str]] = frozenset({"speculator_options"})

    @classmethod
    def apply_options(cls, spec) -> None:
        """Validate the tree options (`TreeSpecConfig`: each error names the key and the fix) and that the
        draft rows vLLM schedules per request are the tree's slots."""
        from vllm_tree_spec.config import TreeSpecError, parse_tree_config

        options = dict(spec.speculator_options or {})
        if not options:
            raise TreeSpecError('method "tree" needs its options: --speculative-config \'{"method": "tree", '
                                '"drafter": "suffix", ...}\' (see docs/configuration.md)')
        cfg = parse_tree_config(options)
        if spec.num_speculative_tokens != cfg.num_slots:
            raise TreeSpecError(f"num_speculative_tokens={spec.num_speculative_tokens} but the tree needs "
                                f"{cfg.num_slots} draft slots (its `tree` / `budgets`); leave "
                                f"num_speculative_tokens out, the plugin sets it")
