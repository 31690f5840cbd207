"""Megatron-LM's flag names, defaults and behaviours in pretrain_gpt's parser (issue 15, parts 1 and 2): no
process group, no training."""
import argparse

import pytest

from megatron_core.training import arguments_megatron
from megatron_core.training.arguments import parse_args
from megatron_core.training.lr_scheduler import LRScheduler
from megatron_core.training.schedule import BatchSchedule, build_lr_scheduler, resolve_train_iters


def _error(argv, capsys) -> str:
    with pytest.raises(SystemExit) as exit_:
        parse_args(argv)
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert "usage:" not in err and len(err.strip().splitlines()) == 1, err  # one paragraph
    return err


def test_megatron_defaults():
    args = parse_args([])
    assert (args.lr_warmup_iters, args.lr_decay_style, args.eval_iters, args.split) == (0, "linear", 100, "969,30,1")
    assert args.check_for_nan_in_loss_and_grad is True
    assert parse_args(["--no-check-for-nan-in-loss-and-grad"]).check_for_nan_in_loss_and_grad is False
    assert parse_args(["--vocab-file", "v.json", "--merge-file", "m.txt"]).tokenizer_type == "GPT2BPETokenizer"
    assert parse_args([]).tokenizer_type is None  # the byte tokenizer, which needs no file


def test_quotes_inside_array_items_are_stripped():
    assert parse_args(["--split", "'99,1,0'"]).split == "99,1,0"
    assert parse_args(["--split", '"98,2,0"']).split == "98,2,0"


def test_did_you_mean_keeps_the_polarity(capsys):
    err = _error(["--no-check-for-nan-in-loss-and-grads"], capsys)
    assert "did you mean --no-check-for-nan-in-loss-and-grad?" in err
    err = _error(["--check-for-nan-in-loss-and-grads"], capsys)
    assert "did you mean --check-for-nan-in-loss-and-grad?" in err and "--no-check" not in err


def test_usage_error_is_one_paragraph(capsys):
    err = _error(["--lr-decay-style", "bogus"], capsys)
    assert "invalid choice: 'bogus'" in err
    err = _error(["--lr-decay-style", "WSD"], capsys)  # a value Megatron-LM has: refused by name
    assert "--lr-decay-style WSD: a --lr-decay-style Megatron-LM has, not built here (built: constant" in err


def test_sequence_parallel_at_tp1_is_turned_off(caplog):
    with caplog.at_level("WARNING"):
        args = parse_args(["--sequence-parallel"])
    assert args.sequence_parallel is False and "--sequence-parallel is turned off" in caplog.text
    assert parse_args(["--sequence-parallel", "--tensor-model-parallel-size", "2"]).sequence_parallel is True


def test_tp_comm_overlap_flag(caplog, capsys):
    with caplog.at_level("WARNING"):
        assert parse_args(["--tp-comm-overlap", "--sequence-parallel"]).tp_comm_overlap is False
    assert "--tp-comm-overlap is turned off" in caplog.text
    args = parse_args(["--tp-comm-overlap", "--sequence-parallel", "--tensor-model-parallel-size", "2"])
    assert args.tp_comm_overlap is True
    assert "--tp-comm-overlap needs --sequence-parallel" in _error(
        ["--tp-comm-overlap", "--tensor-model-parallel-size", "2"], capsys)


def test_zero_flags_are_stored():
    from megatron_core.training.optimizer_setup import ddp_config
    args = parse_args(["--use-megatron-fsdp", "--overlap-param-gather", "--init-model-with-meta-device",
                       "--grad-reduce-in-bf16", "--use-distributed-optimizer", "--bf16"])
    assert args.zero_stage == 3 and args.overlap_param_gather and args.init_model_with_meta_device
    config = ddp_config(args)
    assert config.zero_stage == 3 and config.grad_reduce_in_fp32 is False
    assert ddp_config(parse_args(["--accumulate-allreduce-grads-in-fp32"])).grad_reduce_in_fp32 is True
    assert parse_args(["--use-megatron-fsdp", "--data-parallel-sharding-strategy", "optim_grads"]).zero_stage == 2


def test_model_flags_map_to_the_config():
    from megatron_core.training.arguments import transformer_config
    config = transformer_config(parse_args([
        "--norm-epsilon", "1e-6", "--apply-layernorm-1p", "--qk-layernorm", "--position-embedding-type", "rope",
        "--rotary-percent", "0.5", "--recompute-activations", "--recompute-modules", "core_attn", "mlp"]))
    assert config.layernorm_epsilon == 1e-6 and config.layernorm_zero_centered_gamma and config.qk_layernorm
    assert config.rotary_dim == 16 and config.recompute_granularity == "selective"
    assert config.recomputes("mlp") and not config.recomputes("layernorm")
    assert transformer_config(parse_args(["--no-position-embedding"])).position_embedding_type == "none"
    assert transformer_config(parse_args(["--no-position-embedding", "--position-embedding-type", "rope"])
                              ).position_embedding_type == "rope"


@pytest.mark.parametrize("flag", sorted(arguments_megatron.ACCEPTED_NO_OPS))
def test_accepted_flags_parse(flag):
    kind = arguments_megatron._VALUE_NO_OPS.get(flag)
    values = [] if kind is None else ["1"] if kind is int else ["1", "2", "3"] if isinstance(kind, int) else [kind[0]]
    parse_args([flag, *values])


def test_sample_based_schedule():
    args = parse_args(["--train-samples", "100", "--lr-decay-samples", "80", "--lr-warmup-samples", "20",
                       "--lr", "1.0", "--min-lr", "0.0", "--lr-warmup-init", "0.1", "--global-batch-size", "10"])
    assert resolve_train_iters(args, 10) == 10
    scheduler = build_lr_scheduler(args)
    assert scheduler.counts_samples and scheduler.increment(10) == 10
    assert scheduler.current_lr(10) == pytest.approx(0.1 + 0.9 * 10 / 20)  # warmup from --lr-warmup-init
    scheduler.step(20)
    assert scheduler.current_lr(10) == pytest.approx(1.0 - 10 / 60)  # linear decay over samples 20..80


def test_warmup_fraction_and_mixing_errors(capsys):
    scheduler = build_lr_scheduler(parse_args(["--train-iters", "1000", "--lr-warmup-fraction", "0.01"]))
    assert scheduler.warmup_iters == 10 and not scheduler.counts_samples
    assert "--lr-decay-iters 5 does not go with --train-samples" in _error(
        ["--train-samples", "10", "--lr-decay-iters", "5"], capsys)
    assert "--lr-warmup-fraction 0.1 and --lr-warmup-iters 5 disagree" in _error(
        ["--lr-warmup-fraction", "0.1", "--lr-warmup-iters", "5"], capsys)
    assert "--train-iters 5 and --train-samples 10 disagree" in _error(
        ["--train-iters", "5", "--train-samples", "10"], capsys)


def test_decoupled_lr_groups_follow_their_own_schedule():
    scheduler = LRScheduler(max_lr=1.0, min_lr=0.1, warmup_iters=0, decay_iters=10, decay_style="linear",
                            decoupled_lr=5.0, decoupled_min_lr=0.5)
    groups = [{"params": []}, {"params": [], "decoupled_lr": True}]
    scheduler.step(10)
    scheduler.apply(groups)
    assert groups[0]["lr"] == pytest.approx(0.1) and groups[1]["lr"] == pytest.approx(0.5)


def test_step_batch_size_schedule():
    schedule = BatchSchedule.parse("0:16 2.4B:320 12B:1536", seq_length=2048)
    assert schedule.entries[1] == (2_400_000_000 // 2048, 320)
    assert schedule.global_batch(0) == 16 and schedule.global_batch(2_400_000_000 // 2048) == 320
    args = argparse.Namespace(train_samples=100, batch_schedule=BatchSchedule.parse("0:10 30:20", seq_length=None))
    assert resolve_train_iters(args, 20) == 6  # 10 + 10 + 10 + 20 + 20 + 20 = 90; another 20 passes 100
    with pytest.raises(ValueError, match="must start with a threshold of 0"):
        BatchSchedule.parse("5:16", seq_length=None)


def test_gpt3_script_gives_both_schedule_and_global_batch(capsys):
    args = parse_args(["--global-batch-size", "1536", "--step-batch-size-schedule",
                       "0:16 2.4B:320 4.8B:624 7.2B:928 9.6B:1232 12B:1536", "--seq-length", "2048",
                       "--max-position-embeddings", "2048"])
    assert args.batch_schedule.largest == 1536
    assert "differs from the last batch size 1536" in _error(
        ["--global-batch-size", "64", "--step-batch-size-schedule", "0:16 1K:1536"], capsys)


def test_every_megatron_lm_flag_acts_is_a_documented_no_op_or_is_refused(capsys):
    """Megatron-LM's parser has 876 option strings (megatron_lm_flags.json); each one is ours, an accepted
    no-op listed in --help with its reason, or refused by name."""
    from megatron_core.training.arguments import build_parser
    from megatron_core.training.megatron_table import NO_OP, classify, megatron_lm_flags
    parser = build_parser()
    ours = {option for action in parser._actions for option in action.option_strings
            if not action.dest.startswith("megatron_no_op_")}
    flags = megatron_lm_flags()
    assert len(flags) == 876
    kinds = {option: "ours" if option in ours else classify(option)[0] for option in flags}
    assert all(kind in ("ours", NO_OP, "refuse") for kind in kinds.values())
    help_text = parser.format_help()
    for option, kind in kinds.items():
        if kind == NO_OP:
            assert option in help_text, option
    assert kinds["--use-persistent-ckpt-worker"] == NO_OP and kinds["--deterministic-mode"] == "ours"
    assert kinds["--rerun-mode"] == "refuse" and kinds["--lion-beta1"] == "refuse"
    assert kinds["--muon-momentum"] == kinds["--muon-tp-mode"] == "ours"
    assert classify("--some-future-megatron-flag") == ("refuse", "a Megatron-LM option this framework has not built")


def test_no_ops_are_accepted_with_one_warning_and_refusals_name_the_flag(capsys, caplog):
    with caplog.at_level("WARNING"):
        args = parse_args(["--use-persistent-ckpt-worker", "--ckpt-fully-parallel-load", "--async-strategy", "nvrx"])
    assert "no effect here: --async-strategy, --ckpt-fully-parallel-load, --use-persistent-ckpt-worker" in caplog.text
    assert args.num_layers == 4  # the run's own flags are untouched
    # what happens here anyway, or a refused flag at Megatron-LM's own default, is harmless
    parse_args(["--rerun-mode", "disabled", "--dataloader-type", "single", "--fim-rate", "0.5"])
    err = _error(["--rerun-mode", "report_stats", "--save-activations-interval", "5"], capsys)
    assert "--rerun-mode report_stats: Megatron's rerun state machine" in err
    assert "--save-activations-interval 5: saving activations, gradients or parameters" in err
    err = _error(["--optimizer", "lion", "--lion-beta1", "0.5"], capsys)  # (its default is 0.95)
    assert "--optimizer lion: a --optimizer Megatron-LM has, not built here (built: adam, sgd, muon, dist_muon)" in err
    assert "--lion-beta1 0.5: this optimizer option is not built" in err


def test_docs_list_every_no_op_and_refusal_with_its_reason():
    import importlib.util
    import pathlib
    root = pathlib.Path(__file__).resolve().parents[2]
    spec = importlib.util.spec_from_file_location("extract_megatron_flags", root / "scripts" /
                                                  "extract_megatron_flags.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    table = module.docs_table()
    assert table in (root / "docs" / "megatron_lm.md").read_text(), \
        "docs/megatron_lm.md is out of date: run python scripts/extract_megatron_flags.py --docs"
    assert "`--use-persistent-ckpt-worker`" in table and "`--rerun-mode`" in table


# Where our default differs from Megatron-LM's, and why (everything else must match).
DEFAULT_EXCEPTIONS = {
    # Megatron-LM has no default (it requires them); ours train the tiny built-in model with no flags
    "--num-layers": 4, "--hidden-size": 128, "--num-attention-heads": 4, "--seq-length": 128,
    "--micro-batch-size": 4, "--lr": 3e-3,
    "--split": "969,30,1",  # Megatron-LM sets the same split when none is given ("969, 30, 1")
    "--distributed-backend": None,  # nccl with CUDA, gloo without (Megatron-LM's nccl cannot run on a CPU)
    # read with --use-megatron-fsdp only, where ours means optim_grads_params (ZeRO-3) too
    "--data-parallel-sharding-strategy": None,
}


def test_every_shared_flag_has_megatron_lms_default():
    """Each value flag pretrain_gpt.py shares with Megatron-LM's parser has Megatron's default (read from the
    parser itself, megatron_lm_flags.json), except the listed ones; accepted no-ops are not compared."""
    from megatron_core.training.arguments import build_parser
    from megatron_core.training.arguments_megatron import ACCEPTED_NO_OPS
    from megatron_core.training.megatron_table import megatron_lm_flags
    differ = {}
    for action in build_parser()._actions:
        for option in action.option_strings:
            theirs = megatron_lm_flags().get(option)
            if (theirs is None or option in ACCEPTED_NO_OPS or action.dest.startswith("megatron_no_op_")
                    or theirs["action"] != "_StoreAction" or type(action).__name__ != "_StoreAction"):
                continue
            ours, default = action.default, theirs["default"]
            same = ours == default or (isinstance(ours, (int, float)) and isinstance(default, (int, float))
                                       and float(ours) == float(default))
            if not same:
                differ[option] = (ours, default)
    unexplained = {k: v for k, v in differ.items() if k not in DEFAULT_EXCEPTIONS or DEFAULT_EXCEPTIONS[k] != v[0]}
    assert not unexplained, unexplained
    assert set(DEFAULT_EXCEPTIONS) <= set(differ)  # (an exception that no longer differs is dropped)


def test_megatron_lms_defaults_where_ours_used_to_differ():
    args = parse_args([])
    assert (args.adam_beta2, args.hidden_dropout, args.attention_dropout, args.min_lr, args.log_interval,
            args.eval_interval) == (0.999, 0.1, 0.1, 0.0, 100, None)
    moe = parse_args(["--num-experts", "4", "--tensor-model-parallel-size", "2", "--sequence-parallel"])
    assert moe.expert_tensor_parallel_size == 2  # etp = tp, as in Megatron-LM
    assert parse_args(["--num-experts", "4"]).expert_tensor_parallel_size == 1
    gqa = parse_args(["--group-query-attention"])
    assert gqa.num_query_groups == 1  # Megatron-LM's default: one group (multi-query attention)
    assert parse_args([]).num_query_groups is None  # (without --group-query-attention: every head its own)


def test_use_torch_fsdp2_runs_our_zero3_and_test_mode_is_a_no_op():
    from megatron_core.training.arguments import zero_stage
    assert zero_stage(parse_args(["--use-torch-fsdp2"])) == 3
    assert zero_stage(parse_args(["--use-torch-fsdp2", "--data-parallel-sharding-strategy", "optim_grads"])) == 2
    parse_args(["--test-mode"])


def test_uneven_pipeline_split_flags():
    from megatron_core.training.arguments import transformer_config
    pp2 = ["--pipeline-model-parallel-size", "2", "--num-layers", "3"]
    config = transformer_config(parse_args([*pp2, "--account-for-embedding-in-pipeline-split"]))
    assert [config.pipeline_layer_range(r) for r in range(2)] == [(0, 1), (1, 2)]  # (3 + 1) / 2 - 1 = 1 first
    config = transformer_config(parse_args([*pp2, "--decoder-last-pipeline-num-layers", "1"]))
    assert [config.pipeline_layer_range(r) for r in range(2)] == [(0, 2), (2, 1)]
    four = ["--pipeline-model-parallel-size", "2", "--num-layers", "4"]
    config = transformer_config(parse_args([*four, "--account-for-embedding-in-pipeline-split",
                                            "--account-for-loss-in-pipeline-split"]))
    assert [config.pipeline_layer_range(r) for r in range(2)] == [(0, 2), (2, 2)]
    with pytest.raises(ValueError, match="plus the embedding and loss counted as layers \\(5\\)"):
        transformer_config(parse_args([*four, "--account-for-embedding-in-pipeline-split"]))
