"""The MFU formula's FLOPs for multi-latent attention and multi-token prediction against what torch's
FlopCounterMode counts in a real forward (matmuls only, attention over every key as Megatron's formula
counts it: an explicit mask keeps the softmax path, whose two bmm the counter sees)."""
import torch
from torch.utils.flop_counter import FlopCounterMode

from megatron_core import initialize_model_parallel
from megatron_core.config import TransformerConfig
from megatron_core.models import GPTModel
from megatron_core.training.metrics import gpt_flops_per_iteration

S, B, V = 16, 2, 128
MLA = dict(multi_latent_attention=True, kv_lora_rank=16, qk_head_dim=12, qk_pos_emb_head_dim=8, v_head_dim=10,
           qk_layernorm=True, position_embedding_type="rope", normalization="RMSNorm", add_bias_linear=False)


def _counted_forward_flops(**overrides):
    config = TransformerConfig(num_layers=2, hidden_size=48, num_attention_heads=4, ffn_hidden_size=96,
                               hidden_dropout=0.0, attention_dropout=0.0, untie_embeddings_and_output_weights=True,
                               **{**MLA, **overrides})
    model = GPTModel(config, parallel_state=initialize_model_parallel(), vocab_size=V, max_sequence_length=S,
                     make_vocab_size_divisible_by=V)
    tokens = torch.randint(0, V, (B, S))
    positions = torch.arange(S).expand(B, S)
    mask = torch.zeros(B, 1, S, S, dtype=torch.bool)  # no key masked: full attention, as the formula counts
    with FlopCounterMode(display=False) as counter, torch.no_grad():
        model(tokens, positions, attention_mask=mask, labels=tokens)
    formula = gpt_flops_per_iteration(config, batch_size=B, seq_length=S, padded_vocab_size=V) / 3  # forward
    return counter.get_total_flops(), formula


def test_mla_flops_match_the_counted_forward():
    for q_lora_rank in (None, 24):
        counted, formula = _counted_forward_flops(q_lora_rank=q_lora_rank)
        assert abs(formula - counted) / counted < 1e-9, (q_lora_rank, counted, formula)


def test_mtp_flops_match_the_counted_forward():
    counted, formula = _counted_forward_flops(q_lora_rank=24, mtp_num_layers=1)
    assert abs(formula - counted) / counted < 1e-9, (counted, formula)


def test_planner_counts_mla_parameters_like_the_model():
    from megatron_core.planning.planner import Workload, stage_parameters
    for q_lora_rank in (None, 24):
        config = TransformerConfig(num_layers=2, hidden_size=48, num_attention_heads=4, ffn_hidden_size=96,
                                   untie_embeddings_and_output_weights=True, q_lora_rank=q_lora_rank, **MLA)
        model = GPTModel(config, parallel_state=initialize_model_parallel(), vocab_size=V, max_sequence_length=S,
                         make_vocab_size_divisible_by=V)
        bound = config.bind_layout(initialize_model_parallel())
        predicted, _ = stage_parameters(bound, Workload(vocab_size=V, seq_length=S, micro_batch_size=1,
                                                        global_batch_size=1, make_vocab_size_divisible_by=V),
                                        pp_rank=0)
        assert predicted == sum(p.numel() for p in model.parameters()), q_lora_rank


def test_fp8_runs_are_measured_against_the_fp8_peak():
    from megatron_core.training.metrics import peak_for_device_name
    assert peak_for_device_name("NVIDIA H100 80GB HBM3") == 989.0
    assert peak_for_device_name("NVIDIA H100 80GB HBM3", fp8=True) == 1979.0
    assert peak_for_device_name("NVIDIA A100-SXM4-80GB", fp8=True) == 312.0  # no FP8 tensor cores: emulated
    assert peak_for_device_name("a CPU", fp8=True) is None
