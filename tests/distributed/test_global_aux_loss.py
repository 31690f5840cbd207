"""``--moe-router-load-balancing-type global_aux_loss`` (Megatron-LM's): the Switch loss with the expert counts
of the global batch so far, summed over the data-parallel replicas and averaged over the step's micro-batches,
against a hand computation on 2 dp ranks x 2 micro-batches; the counts restart after each optimizer step."""
import torch
import torch.nn.functional as F

from megatron_core import destroy_model_parallel, initialize_model_parallel
from megatron_core.config import TransformerConfig
from megatron_core.tensor_parallel import model_parallel_seed
from megatron_core.transformer.moe import MoEConfig
from megatron_core.transformer.moe.router import TopKRouter
from megatron_core.transformer.moe.tracking import reset_global_counts

S, B, H, E, K, COEFF = 4, 2, 8, 4, 2, 0.1


def _inputs(rank, step):
    return torch.randn(S, B, H, generator=torch.Generator().manual_seed(100 * rank + step))


def _router_losses(dp):
    state = initialize_model_parallel()
    try:
        model_parallel_seed(0, tp_rank=0, tracker=state.rng_tracker)
        config = TransformerConfig(num_layers=1, hidden_size=H, num_attention_heads=2, max_position_embeddings=S,
                                   moe=MoEConfig(num_moe_experts=E, moe_router_topk=K, moe_aux_loss_coeff=COEFF,
                                                 moe_router_load_balancing_type="global_aux_loss"))
        torch.manual_seed(0)
        router = TopKRouter(config, parallel_state=state)
        rank, out = torch.distributed.get_rank(), []
        for step in range(3):  # micro-batches 0 and 1 in one optimizer step, 2 in the next
            if step == 2:
                reset_global_counts([router])
            router.reset_loss_sums()
            router(_inputs(rank, step).requires_grad_())
            out.append(float(router.loss_sums["load_balancing_loss"]))
        return out, router.weight.detach().clone()
    finally:
        destroy_model_parallel(state)


def _by_hand(weight, dp, rank):
    losses, running = [], []
    for step in range(3):
        if step == 2:
            running = []
        counts = torch.zeros(E, dtype=torch.float64)
        for r in range(dp):
            logits = _inputs(r, step).reshape(-1, H) @ weight.t()
            chosen = torch.topk(logits, K, dim=-1).indices
            counts += F.one_hot(chosen, E).sum(dim=(0, 1)).double()
        running.append(counts)
        mean = torch.stack(running).mean(0).float()
        scores = torch.softmax(_inputs(rank, step).reshape(-1, H) @ weight.t(), dim=-1)
        total = S * B * dp
        losses.append(float((scores.sum(0) * mean).sum() * E / (K * total * total)))
    return losses


def test_global_aux_loss_uses_the_global_batch_counts(distributed):
    results = distributed(2, _router_losses, 2)
    for rank, (losses, weight) in enumerate(results):
        expected = _by_hand(weight, 2, rank)
        torch.testing.assert_close(torch.tensor(losses), torch.tensor(expected), rtol=1e-5, atol=1e-8)
    # the second micro-batch's loss uses the mean of both steps' counts, the third starts over
    assert results[0][0][1] != _by_hand(results[0][1], 1, 0)[1]
