"""The planner knows expert parallelism: for an MoE model it enumerates every ep dividing the experts and
tp x cp x dp (and expert tensor parallelism 1 or tp), shards the experts' states over expert-dp, counts the
ep traffic, and the tool prints the ep
column and the ``--expert-model-parallel-size`` of the best layout. (Memory against measured runs:
tests/distributed/test_planner.py.)"""
import contextlib
import dataclasses
import io

import pytest
import torch

from megatron_core.config import TransformerConfig
from megatron_core.planning.planner import (
    Hardware,
    Layout,
    Workload,
    ep_comm_seconds,
    layout_config,
    plan_layout,
    rank_plans,
    stage_expert_parameters,
    stage_parameters,
)
from megatron_core.transformer.moe import MoEConfig
from tools.plan_parallelism import main

WORKLOAD = Workload(vocab_size=1000, seq_length=256, micro_batch_size=1, global_batch_size=16)
HARDWARE = Hardware(num_devices=8, memory_per_device_gb=80, peak_tflops=100.0)


def _base(**moe):
    return TransformerConfig(num_layers=4, hidden_size=256, num_attention_heads=8, max_position_embeddings=256,
                             params_dtype=torch.bfloat16, bf16=True,
                             moe=MoEConfig(num_moe_experts=8, moe_router_topk=2, **moe))


def test_moe_layouts_enumerate_ep_with_sequence_parallel_tp():
    plans = rank_plans(_base(), WORKLOAD, HARDWARE)
    assert {p.layout.ep for p in plans} == {1, 2, 4, 8}
    assert all((p.layout.tp * p.layout.cp * p.layout.dp) % (p.layout.ep * p.layout.etp) == 0 for p in plans)
    assert {p.layout.etp for p in plans if p.layout.tp == 2} == {1, 2, 4, 8}  # any etp: not only 1 or tp
    assert {p.layout.etp for p in plans if p.layout.tp == 1} == {1, 2, 4, 8}  # etp over dp ranks at tp 1
    assert all(p.layout.sequence_parallel for p in plans if p.layout.tp > 1)  # the MoE layer needs SP with tp
    dense = rank_plans(TransformerConfig(num_layers=4, hidden_size=256, num_attention_heads=8,
                                         max_position_embeddings=256, params_dtype=torch.bfloat16, bf16=True),
                       WORKLOAD, HARDWARE)
    assert {p.layout.ep for p in dense} == {1}


@pytest.mark.parametrize("dispatcher", ["alltoall", "allgather"])
def test_ep_shards_expert_states_and_adds_traffic(dispatcher):
    base = _base(moe_token_dispatcher_type=dispatcher)
    by_ep = {ep: plan_layout(base, WORKLOAD, HARDWARE, Layout(1, 1, 8, None, 1, False, None, 1, ep))
             for ep in (1, 2, 8)}
    assert by_ep[1].model_state_bytes > by_ep[2].model_state_bytes > by_ep[8].model_state_bytes
    traffic = {ep: ep_comm_seconds(layout_config(base, plan.layout), WORKLOAD, plan.layout, HARDWARE, 2)
               for ep, plan in by_ep.items()}
    assert traffic[1] == 0 < traffic[2] < traffic[8]  # the dispatcher's ep traffic, (ep - 1) / ep of it sent
    # ZeRO-1 shards masters + Adam states (12 bytes/element) of the dense parameters over dp 8 and of the
    # experts over expert-dp (8 at ep 1, 1 at ep 8: nothing to save there)
    dense, _ = stage_parameters(layout_config(base, by_ep[1].layout), WORKLOAD, pp_rank=0)
    experts = stage_expert_parameters(base, pp_rank=0, ep=1)
    for ep, sharded in ((1, dense + experts), (8, dense)):
        zero0 = plan_layout(base, WORKLOAD, HARDWARE, Layout(1, 1, 8, None, 0, False, None, 1, ep))
        assert zero0.model_state_bytes - by_ep[ep].model_state_bytes == pytest.approx(12 * sharded * 7 / 8)


def test_tool_prints_the_ep_column_and_flag():
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        code = main(["--num-layers", "4", "--hidden-size", "256", "--num-attention-heads", "8", "--seq-length",
                     "256", "--max-position-embeddings", "256", "--micro-batch-size", "1", "--global-batch-size",
                     "16", "--bf16", "--vocab-size", "1000", "--num-experts", "8", "--expert-model-parallel-size", "2",
                     "--num-devices", "8", "--memory-per-device-gb", "80"])
    text = out.getvalue()
    assert code == 0 and "| ep |" in text.splitlines()[2]
    best = text.strip().splitlines()[-1]
    assert "--num-experts 8" in best and best.count("--expert-model-parallel-size") <= 1


def test_the_launch_line_names_etp_1_at_tp_2_since_etp_defaults_to_tp():
    from megatron_core.planning.planner import Layout
    from tests.data.conftest import load_tool
    tool = load_tool("plan_parallelism")
    plan = type("P", (), {"layout": Layout(2, 1, 2, None, 0, True, None, 1, 2, 1)})()
    line = tool.torchrun_command(plan, ["--num-experts", "4"], num_devices=4, devices_per_node=4, num_layers=2)
    assert "--expert-tensor-parallel-size 1" in line and "--expert-model-parallel-size 2" in line
    dense = tool.torchrun_command(plan, [], num_devices=4, devices_per_node=4, num_layers=2)
    assert "--expert-tensor-parallel-size" not in dense


def test_all_to_all_across_nodes_sends_to_its_own_node_over_nvlink():
    """An ep 16 all-to-all over two 8-GPU nodes: each rank's 7 shares for its own node go over NVLink while
    the 8 for the other node go over its NIC, so the NIC's 8/15 of the bytes set the time, not all of them;
    inside one node it is one NVLink collective."""
    from megatron_core.planning.hardware import hardware_from_profile
    from megatron_core.planning.layer_cost import all_to_all_seconds, collective_seconds
    h100 = hardware_from_profile("h100", num_devices=16)
    volume = 1e9
    across = all_to_all_seconds(volume, ranks=16, span=16, hardware=h100)
    nic = volume * 8 / 15 / (h100.inter_node_bandwidth_gbps * 1e9)
    assert across == pytest.approx(nic + h100.inter_node_latency_us * 1e-6)
    assert across < 0.6 * collective_seconds(volume, span=16, hardware=h100)
    assert all_to_all_seconds(volume, ranks=8, span=8, hardware=h100) == collective_seconds(volume, span=8,
                                                                                            hardware=h100)


def test_fp8_experts_quantize_every_local_experts_input_and_weight():
    """An FP8 MoE layer quantizes each of its rank's ``E / ep`` experts' weights and all routed rows, not one
    expert's: the quantization's bytes (the FP8 GEMM part's seconds at this bandwidth less at an unlimited one)
    are ``(e + 1)`` per element of every linear's input and weight on the rank."""
    from megatron_core.fp8.config import Fp8Config
    from megatron_core.planning.layer_cost import layer_forward_cost

    h, f, experts, topk, ep, tokens = 256, 128, 8, 2, 2, 512
    config = dataclasses.replace(_base(moe_ffn_hidden_size=f), activation="swiglu", add_bias_linear=False,
                                 fp8=Fp8Config(fp8_recipe="tensorwise"))
    bandwidth = 1000.0
    hardware = Hardware(num_devices=8, memory_per_device_gb=80, peak_tflops=100.0, fp8_peak_tflops=200.0,
                        memory_bandwidth_gbps=bandwidth)

    def gemm_seconds(hw):
        return layer_forward_cost(config, hw, micro_batch_size=1, seq_length=tokens, moe_layer=True, ep=ep).gemm

    quantized_bytes = (gemm_seconds(hardware)
                       - gemm_seconds(dataclasses.replace(hardware, memory_bandwidth_gbps=0.0))) * bandwidth * 1e9
    q = k = h  # 8 heads of 32 channels, no GQA
    routed_here = tokens * topk  # what the rank's experts receive at ep 2 (each rank's share of ep x the tokens)
    attention = tokens * h + h * (q + 2 * k) + tokens * q + q * h
    router = tokens * h + h * experts
    expert_inputs = routed_here * h + routed_here * f  # fc1's and fc2's rows, over the local experts
    expert_weights = experts // ep * (h * 2 * f + f * h)  # SwiGLU fc1 (h x 2f) and fc2 (f x h) of each
    assert quantized_bytes == pytest.approx(3 * (attention + router + expert_inputs + expert_weights), rel=1e-9)


def test_bridge_moe_rows_shapes_give_their_published_model_tflops():
    """The MoE rows' shapes are those Megatron-Bridge measured: our FLOPs formula, with causal attention's
    ``s^2`` term at half as theirs counts it, gives the Model TFLOP/s per GPU they published (within 1%; for
    gpt-oss their count also takes its gated experts at two GEMMs' FLOPs, and its windowed layers at full
    causal attention). Each row plans at its recipe's layout on its GPU count and fits in an H100's memory."""
    from megatron_core.planning.published_moe import MEGATRON_BRIDGE_H100_MOE, SEQUENCE
    from megatron_core.training.metrics import gpt_flops_per_iteration

    for run in MEGATRON_BRIDGE_H100_MOE:
        plan = run.plan()
        layout = plan.layout
        assert layout.tp * layout.pp * layout.dp == run.gpus and plan.fits, run.name
        config, padded_vocab = run.config(), -(-run.vocab // 128) * 128
        tokens = run.global_batch * SEQUENCE
        flops = gpt_flops_per_iteration(config, batch_size=run.global_batch, seq_length=SEQUENCE,
                                        padded_vocab_size=padded_vocab)
        flops -= 6.0 * tokens * SEQUENCE * run.layers * config.kv_channels * run.heads  # half the s^2 term
        if run.gpt_oss:  # the gate's third of the experts' FLOPs
            flops -= 6.0 * tokens * run.layers * run.hidden * run.topk * run.expert_ffn
        tflops = flops / run.measured_step_seconds / run.gpus / 1e12
        assert tflops == pytest.approx(run.model_tflops, rel=0.01), run.name


def test_published_layouts_script_prints_the_three_tables(capsys):
    """``python scripts/published_layouts.py`` prints docs/performance.md's comparisons from the code: the ten
    2021 A100 runs, the five Megatron-Bridge dense recipes and the three MoE rows, each with its ratio."""
    import pathlib
    import runpy

    runpy.run_path(str(pathlib.Path(__file__).resolve().parents[2] / "scripts" / "published_layouts.py"),
                   run_name="__main__")
    rows = [line for line in capsys.readouterr().out.splitlines() if line.startswith("| ") and "---" not in line
            and not line.startswith("| model")]
    assert len(rows) == 10 + 5 + 3
    assert all(0.5 < float(row.rstrip(" |").rsplit("| ", 1)[1]) < 2.5 for row in rows)
