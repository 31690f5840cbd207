"""A tiny GPTModel with multi-latent attention: tp 2 (with and without sequence parallelism, with and without
q_lora_rank, with the tp comm overlap), cp 2 (p2p, allgather, a2a) and tp 2 x cp 2 with sequence parallelism
give the loss and every gathered weight grad of the single-process model. Under sequence parallelism the
replicated down projections and latent norms see only their rank's tokens, so their grads are right only when
summed over tp."""
import pytest
import torch
import torch.distributed as dist

from megatron_core import destroy_model_parallel, initialize_model_parallel
from megatron_core.context_parallel import split_sequence
from megatron_core.distributed import finalize_model_grads
from megatron_core.transformer import InferenceCache
from tests.model_helpers import SEQ, VOCAB, build_model, full_grads, make_batch, run_tiny_model, tiny_config
from tests.unit.test_mla import MLA_GPT

LOSS_TOL = dict(rtol=1e-5, atol=1e-6)
GRAD_TOL = dict(rtol=1e-4, atol=1e-6)


def _assert_same(reference, losses, grads, what):
    ref_loss, ref_grads = reference
    for rank, loss in enumerate(losses):
        torch.testing.assert_close(loss, ref_loss, **LOSS_TOL, msg=lambda m: f"{what} loss rank {rank}: {m}")
    assert grads.keys() == ref_grads.keys()
    for name, grad in grads.items():
        torch.testing.assert_close(grad, ref_grads[name][0], **GRAD_TOL, msg=lambda m: f"{what} grad {name}: {m}")


TP_CASES = {
    "q-lora-sp": dict(sequence_parallel=True),
    "q-lora": {},
    "q-direct-sp": dict(q_lora_rank=None, sequence_parallel=True),
    "q-lora-sp-overlap": dict(sequence_parallel=True, tp_comm_overlap=True),
}


@pytest.mark.parametrize("name", list(TP_CASES))
def test_tensor_parallel_matches_tp1(distributed, name):
    overrides = {**MLA_GPT, **TP_CASES[name]}
    reference = run_tiny_model(1, {key: value for key, value in overrides.items()
                                   if key not in ("sequence_parallel", "tp_comm_overlap")})
    results = distributed(2, run_tiny_model, 2, overrides)
    _assert_same(reference, [loss for loss, _ in results], full_grads([grads for _, grads in results]), name)


def _split_model_run(tp: int, cp: int, comm_type: str, overrides: dict):
    """The per-token loss of this cp rank's tokens and the grads of the summed loss (summed over cp, finalized
    over tp), with the rank's tp and cp indices."""
    state = initialize_model_parallel(tensor_model_parallel_size=tp, context_parallel_size=cp)
    try:
        config = tiny_config(tensor_model_parallel_size=tp, context_parallel_size=cp, cp_comm_type=comm_type,
                             **overrides)
        model = build_model(config, state)
        split = dict(dim=1, cp_size=cp, cp_rank=state.cp_rank)
        input_ids, positions, labels = (split_sequence(x, **split) for x in make_batch())
        loss = model(input_ids, positions, labels=labels)
        loss.sum().backward()  # the sum over the whole sequence is the sum over the cp ranks
        finalize_model_grads(model, state)
        grads = {}
        for name, param in model.named_parameters():
            grad = param.grad.clone()
            dist.all_reduce(grad, group=state.cp_group)  # each cp rank holds its tokens' share
            grads[name] = (grad, param.partition_dim if param.tensor_model_parallel else None, param.partition_stride)
        return state.tp_rank, state.cp_rank, loss.detach(), grads
    finally:
        destroy_model_parallel(state)


def _reference_sum_loss(overrides: dict):
    model = build_model(tiny_config(**overrides), initialize_model_parallel())
    input_ids, positions, labels = make_batch()
    loss = model(input_ids, positions, labels=labels)
    loss.sum().backward()
    return loss.detach(), {name: (param.grad.clone(),) for name, param in model.named_parameters()}


CP_CASES = {  # name: (tp, cp, cp_comm_type, overrides)
    "cp2-p2p": (1, 2, "p2p", {}),
    "cp2-allgather": (1, 2, "allgather", {}),
    "cp2-a2a-q-direct": (1, 2, "a2a", dict(q_lora_rank=None)),
    "tp2-cp2-sp-p2p": (2, 2, "p2p", dict(sequence_parallel=True)),
}


@pytest.mark.parametrize("name", list(CP_CASES))
def test_context_parallel_matches_cp1(distributed, name):
    tp, cp, comm_type, extra = CP_CASES[name]
    overrides = {**MLA_GPT, **extra}
    ref_loss, ref_grads = _reference_sum_loss({k: v for k, v in overrides.items() if k != "sequence_parallel"})
    results = distributed(tp * cp, _split_model_run, tp, cp, comm_type, overrides)
    for tp_rank, cp_rank, loss, _ in results:
        expected = split_sequence(ref_loss, dim=1, cp_size=cp, cp_rank=cp_rank)
        torch.testing.assert_close(loss, expected, **LOSS_TOL, msg=lambda m: f"{name} loss tp {tp_rank} cp {cp_rank}")
    first_cp = sorted((tp_rank, grads) for tp_rank, cp_rank, _, grads in results if cp_rank == 0)
    _assert_same((ref_loss, ref_grads), [], full_grads([grads for _, grads in first_cp]), name)


def _decode_logits(tp: int):
    """Full-forward and incremental logits (prompt, then one token at a time from the latent cache)."""
    state = initialize_model_parallel(tensor_model_parallel_size=tp)
    model = build_model(tiny_config(tensor_model_parallel_size=tp, **MLA_GPT), state, parallel_output=False).eval()
    tokens = torch.randint(0, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        full = model(tokens, torch.arange(SEQ).expand(2, SEQ))
        cache = InferenceCache(max_sequence_length=SEQ, batch_size=2)
        steps = [model(tokens[:, :4], None, inference_cache=cache)]
        steps += [model(tokens[:, i:i + 1], None, inference_cache=cache) for i in range(4, SEQ)]
    return full, torch.cat(steps, 1)


def test_latent_cache_decoding_at_tp2_matches_tp1(distributed):
    reference, _ = _decode_logits(1)
    for full, incremental in distributed(2, _decode_logits, 2):
        torch.testing.assert_close(full, reference, **LOSS_TOL)
        torch.testing.assert_close(incremental, reference, rtol=0, atol=1e-5)
