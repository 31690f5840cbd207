"""Megatron-LM's DeepSeek-V3 and gpt-oss flag sets through pretrain_gpt.py, flag for flag with sizes shrunk:
examples/megatron_fsdp/sbatch_mfsdp_deepseek_v3.sh (MLA with q_lora_rank and YaRN, 8 experts in 4 groups with
sigmoid scores, expert bias, shared expert, dense first layer, the flex dispatcher, forced load balancing,
selective recompute of mlp / moe / mla_up_proj / layernorm, one MTP depth; ep 2 on 2 ranks) and
examples/gptoss/02_train.sh (sinks, 127-token windows on every other layer, clamped quick GeGLU, MoE, its fp8
flags included: emulated here) each train 3 iterations; the parsed configs carry the architecture."""
from tests.integration.test_megatron_examples import GPT_OSS, _iteration_lines, _replace_flags, _run

DEEPSEEK_V3 = [
    "--distributed-timeout-minutes", "60", "--tensor-model-parallel-size", "1", "--expert-model-parallel-size", "2",
    "--expert-tensor-parallel-size", "1", "--context-parallel-size", "1", "--use-distributed-optimizer",
    "--overlap-grad-reduce", "--overlap-param-gather", "--use-mcore-models", "--sequence-parallel",
    "--use-flash-attn", "--disable-bias-linear", "--micro-batch-size", "1", "--global-batch-size", "4",
    "--train-samples", "12", "--exit-duration-in-mins", "220", "--no-check-for-nan-in-loss-and-grad", "--manual-gc",
    "--manual-gc-interval", "10", "--recompute-granularity", "selective", "--recompute-modules", "mlp", "moe",
    "mla_up_proj", "layernorm", "--transformer-impl", "transformer_engine", "--seq-length", "32",
    "--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", "500", "--split", "99,1,0",
    "--no-mmap-bin-files", "--no-create-attention-mask-in-dataloader", "--num-workers", "6",
    "--num-layers", "3", "--hidden-size", "32", "--ffn-hidden-size", "64", "--num-attention-heads", "4",
    "--kv-channels", "8", "--max-position-embeddings", "32", "--position-embedding-type", "rope",
    "--rotary-base", "10000", "--make-vocab-size-divisible-by", "32", "--normalization", "RMSNorm",
    "--norm-epsilon", "1e-6", "--swiglu", "--untie-embeddings-and-output-weights", "--multi-latent-attention",
    "--attention-dropout", "0.0", "--hidden-dropout", "0.0", "--clip-grad", "1.0", "--weight-decay", "0.1",
    "--qk-layernorm", "--lr-decay-samples", "12", "--lr-warmup-samples", "4", "--lr-warmup-init", "3.9e-7",
    "--lr", "3.9e-6", "--min-lr", "3.9e-7", "--lr-decay-style", "cosine", "--adam-beta1", "0.9",
    "--adam-beta2", "0.95", "--num-experts", "8", "--moe-layer-freq", "[0]*1+[1]*2", "--moe-ffn-hidden-size", "16",
    "--moe-shared-expert-intermediate-size", "16", "--moe-router-load-balancing-type", "seq_aux_loss",
    "--moe-router-topk", "4", "--moe-token-dispatcher-type", "flex", "--moe-flex-dispatcher-backend", "hybridep",
    "--moe-router-pre-softmax", "--moe-grouped-gemm", "--moe-aux-loss-coeff", "1e-4", "--moe-router-group-topk", "2",
    "--moe-router-num-groups", "4", "--moe-router-topk-scaling-factor", "2.5", "--moe-router-score-function",
    "sigmoid", "--moe-router-enable-expert-bias", "--moe-router-bias-update-rate", "1e-3", "--moe-router-dtype",
    "fp32", "--moe-permute-fusion", "--moe-router-force-load-balancing", "--q-lora-rank", "16", "--kv-lora-rank", "8",
    "--qk-head-dim", "8", "--qk-pos-emb-head-dim", "4", "--v-head-dim", "8", "--rotary-scaling-factor", "40",
    "--mscale", "1.0", "--mscale-all-dim", "1.0", "--mtp-num-layers", "1", "--mtp-loss-scaling-factor", "0.1",
    "--eval-iters", "1", "--eval-interval", "100", "--auto-detect-ckpt-format", "--save-interval", "100",
    "--dist-ckpt-strictness", "log_all", "--init-method-std", "0.02", "--log-timers-to-tensorboard",
    "--log-memory-to-tensorboard", "--log-num-zeros-in-grad", "--log-params-norm",
    "--log-validation-ppl-to-tensorboard", "--log-throughput", "--log-interval", "1", "--logging-level", "40",
    "--bf16"]


def test_deepseek_v3_example_trains(distributed, tmp_path):
    ckpt = str(tmp_path / "ckpt")
    status, err, out = _run(distributed, 2, [*DEEPSEEK_V3, "--save", ckpt, "--load", ckpt,
                                             "--tensorboard-dir", str(tmp_path / "tb")])
    assert status == 0, err
    assert _iteration_lines(out) == 3 and "mtp_1 loss" in out, out


def test_deepseek_v3_example_flags_parse_into_its_architecture():
    from megatron_core.training.arguments import parse_args, transformer_config
    config = transformer_config(parse_args(DEEPSEEK_V3))
    assert config.multi_latent_attention and config.q_lora_rank == 16 and config.effective_rope_type == "yarn"
    assert config.mtp_num_layers == 1 and config.recompute_modules == ("mlp", "moe", "mla_up_proj", "layernorm")
    moe = config.moe
    assert (moe.moe_router_num_groups, moe.moe_router_group_topk, moe.moe_router_topk_scaling_factor) == (4, 2, 2.5)
    assert moe.moe_token_dispatcher_type == "alltoall" and moe.moe_router_force_load_balancing
    assert moe.moe_layer_freq == [0, 1, 1]


def test_gpt_oss_example_trains(distributed, tmp_path):
    argv = _replace_flags(GPT_OSS, {"--save": ["--save", str(tmp_path / "ckpt")], "--tensorboard-dir": [],
                                 "--data-cache-path": ["--data-cache-path", str(tmp_path / "cache")]})
    status, err, out = _run(distributed, 1, argv)
    assert status == 0, err
    assert _iteration_lines(out) == 3 and "load_balancing_loss" in out and "runs emulated" in err
    from megatron_core.training.arguments import parse_args, transformer_config
    config = transformer_config(parse_args(argv))
    assert config.softmax_type == "learnable" and config.activation == "quick_geglu"
    assert [config.window_for(n) for n in (1, 2)] == [(127, 0), None]
    assert config.fp8.fp8_format == "hybrid" and config.fp8.fp8_amax_history_len == 1024
