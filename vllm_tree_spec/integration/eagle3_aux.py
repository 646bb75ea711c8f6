"""The target's auxiliary hidden states for the EAGLE-3 tree drafter (patch record P7).

vLLM's runner makes the target return (hidden_states, aux_hidden_states) only
for its own `eagle3` / `dflash` / `extract_hidden_states` methods: the
proposer constructor sets `runner.use_aux_hidden_state_outputs`, and after
loading `_setup_eagle3_aux_hidden_state_outputs()` tells the model which
layers to tap (the draft config's `eagle_aux_hidden_state_layer_ids`, else
`model.get_eagle3_default_aux_hidden_state_layers()`). The runner then hands
the list to `propose_draft_token_ids` (its 6th argument), which the tree
runner forwards to the drafter's `observe_target`.

P7  runner.use_aux_hidden_state_outputs = True and model.set_aux_hidden_state_layers(layers), on tree
    runners whose drafter reads the target's features (drafter 'eagle3'), right after load_model.
    Why: method 'tree' reaches vLLM as 'custom_class', for which vLLM never turns aux outputs on.
    What: exactly what `_setup_eagle3_aux_hidden_state_outputs` does for method 'eagle3', with the same
          layer choice (the head's config, else the model's default).
    Removal: a proposer-side flag in vLLM's custom_class route ("needs aux hidden states: layers ...").
P7b drafter 'eagle' (EAGLE-1) reads the target's output hidden states instead: no aux layers are tapped;
    the tree runner hands `propose_draft_token_ids`' 4th argument (hidden_states, [T, H], the rows
    vLLM's own EAGLE proposer reads) to `observe_target` with the committed rows.
    Why: vLLM passes it only to its own proposers. What: a read of the argument, nothing changed.
    Removal: hidden states in the custom_class proposer interface.
"""

from __future__ import annotations

from vllm.logger import init_logger

logger = init_logger(__name__)


def enable_aux_hidden_states(runner, layer_ids: tuple[int, ...] | None) -> tuple[int, ...]:
    """Make the runner's target return its auxiliary hidden states; returns the layers tapped."""
    from vllm.model_executor.models.interfaces import supports_eagle3

    model = runner.get_model()
    if not supports_eagle3(model):
        raise RuntimeError(
            f"drafter 'eagle3' reads the target's auxiliary hidden states, but {type(model).__name__} does not "
            f"implement vLLM's SupportsEagle3 interface; use a target vLLM's own eagle3 method supports")
    layers = tuple(layer_ids) if layer_ids else tuple(model.get_eagle3_default_aux_hidden_state_layers())
    model.set_aux_hidden_state_layers(layers)
    runner.use_aux_hidden_state_outputs = True
    logger.info("EAGLE-3 tree drafter: target auxiliary hidden states from layers %s", layers)
    return layers
