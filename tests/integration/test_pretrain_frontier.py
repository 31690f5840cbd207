"""pretrain_gpt's loop for the frontier architectures equals the single-process run (8 iterations, fp32, losses
and grad norms to 1e-5 relative): a DeepSeek-V3-shaped model (multi-latent attention with q_lora_rank and YaRN,
a dense first layer, then MoE layers with sigmoid scores, expert bias, group-limited routing, a scaling factor
and a shared expert) and a gpt-oss-shaped one (sinks, a sliding window on every other layer, clamped quick
GeGLU experts with biases, the router's bias), each at tp 2 with sequence parallelism, pp 2, cp 2, ep 2 and
dp 2 with ZeRO-3."""
import json

import pytest
import torch

from tests.recipe import RECIPE

BASE = [*RECIPE, "--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4", "--seq-length", "16",
        "--micro-batch-size", "2", "--global-batch-size", "8", "--train-iters", "8", "--lr", "2e-3",
        "--min-lr", "1e-4", "--lr-warmup-iters", "2", "--eval-interval", "1000", "--log-interval", "1000",
        "--seed", "7", "--position-embedding-type", "rope", "--normalization", "RMSNorm",
        "--moe-token-dispatcher-type", "alltoall"]
ARCHITECTURES = {
    "deepseek": ["--multi-latent-attention", "--q-lora-rank", "16", "--kv-lora-rank", "8", "--qk-head-dim", "8",
                 "--qk-pos-emb-head-dim", "4", "--v-head-dim", "8", "--qk-layernorm", "--rotary-scaling-factor", "4",
                 "--mscale", "1.0", "--mscale-all-dim", "1.0", "--yarn-original-max-position-embeddings", "8",
                 "--swiglu", "--disable-bias-linear", "--ffn-hidden-size", "48", "--num-experts", "4",
                 "--moe-router-topk", "2", "--moe-ffn-hidden-size", "16", "--moe-shared-expert-intermediate-size", "16",
                 "--moe-layer-freq", "[0]+[1]", "--moe-router-score-function", "sigmoid",
                 "--moe-router-enable-expert-bias", "--moe-router-num-groups", "2", "--moe-router-group-topk", "1",
                 "--moe-router-topk-scaling-factor", "2.5", "--moe-router-load-balancing-type", "seq_aux_loss",
                 "--moe-aux-loss-coeff", "1e-3"],
    "gpt_oss": ["--group-query-attention", "--num-query-groups", "2", "--kv-channels", "8", "--softmax-type",
                "learnable", "--window-size", "3,0", "--window-attn-skip-freq", "2", "--quick-geglu",
                "--glu-linear-offset", "1.0", "--activation-func-clamp-value", "7.0", "--rope-type", "yarn",
                "--rotary-scaling-factor", "4", "--yarn-original-max-position-embeddings", "8",
                "--no-yarn-correction-range-round-to-int", "--ffn-hidden-size", "32", "--num-experts", "4",
                "--moe-router-topk", "2", "--moe-ffn-hidden-size", "16", "--moe-aux-loss-coeff", "1e-2"],
}
TP2_SP = ["--tensor-model-parallel-size", "2", "--sequence-parallel"]
LAYOUTS = {
    "tp2-sp": (2, TP2_SP),
    "pp2": (2, ["--pipeline-model-parallel-size", "2"]),
    "cp2": (2, ["--context-parallel-size", "2"]),
    "ep2": (2, ["--expert-model-parallel-size", "2"]),
    "dp2-zero3": (2, ["--zero-stage", "3"]),
}


def _train(argv):
    from megatron_core.training.arguments import parse_args
    from megatron_core.training.loop import pretrain
    return pretrain(parse_args(BASE + list(argv)))


def _grad_norms(path):
    with open(path) as handle:
        return [json.loads(line)["grad_norm"] for line in handle if '"split"' not in line]


@pytest.fixture(scope="module")
def references(tmp_path_factory, distributed):
    out = {}
    for name, flags in ARCHITECTURES.items():
        metrics = tmp_path_factory.mktemp(f"frontier_{name}") / "metrics.jsonl"
        losses = distributed(1, _train, [*flags, "--metrics-file", str(metrics)])[0]
        out[name] = (losses, _grad_norms(metrics))
    return out


@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("architecture", list(ARCHITECTURES))
def test_losses_match_single_process(distributed, references, tmp_path, architecture, layout):
    world, argv = LAYOUTS[layout]
    metrics = tmp_path / "metrics.jsonl"
    losses = distributed(world, _train, [*ARCHITECTURES[architecture], *argv, "--metrics-file", str(metrics)])[0]
    ref_losses, ref_norms = references[architecture]
    assert len(losses) == 8 and losses[-1] < losses[0]
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), rtol=1e-5, atol=0)
    torch.testing.assert_close(torch.tensor(_grad_norms(metrics)), torch.tensor(ref_norms), rtol=1e-5, atol=0)
