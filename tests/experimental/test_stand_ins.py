"""opefo_trl.experimental.stand_ins alone: the served leaf reaches no parameter, the written gradient adds to what is
there. Both are pinned against TRL's own pass in tests/experimental/test_param_estimate.py (the written-gradient
tests)."""

import torch

from opefo_trl.experimental.stand_ins import served_scores, write_gradient
from opefo_trl.trainer.batch_state import Scores


def test_the_served_leaf_holds_the_estimates_log_probs_and_reaches_no_parameter():
    weight = torch.tensor(2.0, requires_grad=True)
    logps = weight * torch.tensor([[-0.5, -1.0, -2.0]])  # the estimate's scores, still on its graph
    entropies = torch.tensor([[0.3, 0.2, 0.1]])
    leaf, served_entropies, aux_loss = served_scores(Scores(logps, entropies))
    assert leaf.is_leaf and leaf.requires_grad and torch.equal(leaf, logps)
    assert served_entropies is entropies and aux_loss is None
    (-leaf.sum()).backward()  # TRL's loss backpropagates into the leaf only
    assert weight.grad is None and leaf.grad.tolist() == [[-1.0, -1.0, -1.0]]


def test_the_written_gradient_is_added_to_what_the_backward_left():
    untouched, accumulated = torch.zeros(2, requires_grad=True), torch.zeros(2, requires_grad=True)
    accumulated.grad = torch.ones(2)
    write_gradient([untouched, accumulated], [torch.tensor([1.0, 2.0]), torch.tensor([3.0, 4.0])])
    assert untouched.grad.tolist() == [1.0, 2.0] and accumulated.grad.tolist() == [4.0, 5.0]
