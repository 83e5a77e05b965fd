"""flashllm.options owns the names of modes, predictors and expert policies; every registry the runtime builds
from is keyed by exactly those names (so the API, the CLI and the runtime cannot drift apart)."""

import numpy as np
import pytest

import flashllm
from flashllm import options
from flashllm.modes import registry
from flashllm.modes.experts import ExpertCache
from flashllm.modes.moe import MOE_MODES
from flashllm.modes.sparse.predictor import PREDICTORS


def test_mode_registry_is_keyed_by_the_mode_names():
    assert tuple(registry.MODES) == options.MODES
    assert set(MOE_MODES) < set(options.MODES)  # MoE models take dense and sparse
    for name, mode in {**registry.MODES, **{f"moe {k}": v for k, v in MOE_MODES.items()}}.items():
        assert mode.__doc__ and mode.__doc__.strip(), name  # the CLI's help describes each mode by it


def test_predictor_registry_is_keyed_by_the_predictor_names():
    assert ("auto", *PREDICTORS) == options.PREDICTORS  # "auto" picks one of the others at load


def test_unknown_names_are_refused_with_the_known_ones():
    for field, known in (("mode", options.MODES), ("predictor", options.PREDICTORS),
                         ("expert_policy", options.EXPERT_POLICIES)):
        with pytest.raises(flashllm.FlashLLMError, match=", ".join(known)):
            options.LoadOptions(**{field: "nonesuch"})
    with pytest.raises(flashllm.FlashLLMError, match=", ".join(options.EXPERT_POLICIES)):
        ExpertCache(capacity=2, n_experts=4, window=1, policy="nonesuch")


def test_every_expert_policy_name_is_a_distinct_policy():
    """Each name builds an expert cache, and no two names evict alike on a sequence that tells them apart."""
    evicted = {}
    for policy in options.EXPERT_POLICIES:
        cache = ExpertCache(capacity=3, n_experts=6, window=2, policy=policy)
        held = []
        for experts in ([0, 1], [0, 1], [2], [3], [4]):  # 0 and 1 used twice; then new experts keep coming
            active = cache.start(np.array([experts]))
            missing = np.array([e for e in active if cache.slot_of[e] < 0], dtype=np.int64)
            cache.commit(missing, cache.place(missing, keep=active))
            held.append(frozenset(map(int, cache.expert_in[cache.expert_in >= 0])))
        evicted[policy] = tuple(held)
    assert len(set(evicted.values())) == len(options.EXPERT_POLICIES), evicted
