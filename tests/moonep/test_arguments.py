"""Invalid arguments of the single-process entry points name themselves (no process group needed)."""

from __future__ import annotations

import pytest
import torch

from moonep import Router, compute_plan
from moonep.layout import Layout
from moonep.skew import expert_popularity, make_routing
from moonep.transports.watchdog import Watchdog


@pytest.mark.parametrize(
    ("call", "match"),
    [
        pytest.param(lambda: make_routing("zipf", 4, 2, 8, 2), "skew must be one of", id="make_routing-skew"),
        pytest.param(lambda: expert_popularity("nope", 8, 2), "skew must be one of", id="expert_popularity-skew"),
        pytest.param(lambda: Router(16, 4, 5), r"top_k \(5\) must be <= num_experts \(4\)", id="Router-top_k"),
        pytest.param(lambda: compute_plan(torch.zeros(0, 4, dtype=torch.long)), "positive multiple", id="plan-R0"),
        pytest.param(
            lambda: Layout(2, 4, 2, 8, 0, 8, True, torch.device("cpu"), planner="cuda"),
            "planner must be one of",
            id="Layout-planner",
        ),
        pytest.param(lambda: Watchdog(0.0, print), "timeout_s and poll_s must be > 0", id="Watchdog-timeout"),
    ],
)
def test_bad_argument_raises_value_error_naming_it(call, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        call()


def test_router_picks_on_biased_scores_but_weights_come_from_scores() -> None:
    router = Router(hidden=8, num_experts=6, top_k=2)
    x = torch.randn(5, 8)
    router.bias_E.copy_(torch.tensor([0.0, 0.0, 0.0, 0.0, 10.0, 10.0]))  # bias steers selection only
    idx, w = router(x)
    assert set(idx.flatten().tolist()) == {4, 5}
    scores = torch.sigmoid(x @ router.weight_EH.t()).gather(1, idx)
    torch.testing.assert_close(w, scores / scores.sum(1, keepdim=True))
    router.update_bias(torch.tensor([0, 0, 0, 0, 9, 9]), rate=0.5)
    assert router.bias_E.tolist() == [0.5, 0.5, 0.5, 0.5, 9.5, 9.5]


def test_plan_of_no_tokens_is_empty_and_balanced() -> None:
    plan = compute_plan(torch.zeros(2, 4, dtype=torch.long))
    assert plan.load_R.tolist() == [0, 0] and int(plan.num_redundant_R.sum()) == 0
    assert plan.stats()["max_over_mean"] == 1.0
