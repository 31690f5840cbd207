"""Megatron-LM's own CI configurations (its functional tests' MODEL_ARGS, turned into argv as its runner does):
every one of the 227 training configs parses with no unrecognized flag and no crash (each is accepted or refused
in one paragraph naming the flag), the accepted share does not fall, a stratified dozen train 3 iterations at
their parallel layouts (sizes shrunk), and --deterministic-mode repeats a run bit for bit."""
import contextlib
import io
import math
import os

import pytest
import torch

from tests.integration.megatron_ci import load_configs, localize, shrink
from tests.integration.test_reliability import TINY, _files_digest, run_main

ACCEPTED_AT_LEAST = 199  # of 227 at Megatron-LM d98e8a64dd (88%); it may only grow

STRATIFIED = [  # (config, what it covers)
    "gpt/gpt3_mcore_te_tp1_pp1_uniform_full_recompute",                       # full recompute, 1 rank
    "gpt/gpt3_mcore_tp1_pp2_fp16",                                            # fp16 loss scaling, pp 2
    "gpt/gpt3_mcore_te_tp1_pp2_rope_embeddings_interleaved_no_fusion",        # --rotary-interleaved
    "gpt/gpt3_mcore_reruns_enable",                                           # distopt, SP, swiglu, rope
    "gpt/gpt3_mcore_te_tp1_pp4_vp1_dist_optimizer_overlap_grad_reduce",       # interleaved pp 4 x vpp 2
    "gpt/gpt3_mcore_te_tp2_pp2_resume_torch_dist",                            # tp 2 x pp 2
    "gpt/gpt3_mcore_te_tp2_pp1_cp2_nondeterministic",                         # tp 2 x cp 2
    "gpt/gpt3_mcore_te_tp4_pp1_dist_optimizer_overlap_grad_reduce_param_gather",  # tp 4, overlapped distopt
    "moe/gpt3_mcore_te_tp2_pp1_te_8experts2parallel_top2router",              # MoE tp 2 x ep 2
    "moe/gpt3_mcore_te_tp2_zp_z3_resume_torch_dist_te_8experts2parallel_top2router",  # Megatron-FSDP, MoE
    "moe/gpt3_moe_mcore_te_ep8_resume_torch_dist_dist_optimizer_1node",       # ep 4 (of 8 experts)
    "gpt/gpt3_mcore_tp2_pp2_uninstall_te",                                    # fp16, tp 2 x pp 2
    "moe/gpt3_moe_mcore_te_ep8_resume_torch_dist_muon_1node",                 # Muon, MoE ep 4
    "gpt/gpt3_mcore_te_tp1_pp2_cp4_a2a_p2p_nondeterministic",                 # hierarchical cp 2 x 2, pp 2
    "gpt/gpt3_mcore_te_tp2_pp1_multi_dist_optimizer_instances",               # 2 distributed optimizer instances
    "moe/gpt3_mcore_tp2_pp2_ep2_etp2_te_4experts2parallel",                   # MoE tp 2 x ep 2 x etp 2, pp 2
]


def _parse(argv):
    from megatron_core.training.arguments import parse_args
    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err):
            parse_args(argv)
    except SystemExit as exit_:
        return exit_.code, err.getvalue()
    return 0, err.getvalue()


def test_every_ci_config_is_recognized_and_accepted_or_refused_by_name(tmp_path):
    outcomes = {"accepted": [], "refused": [], "rejected": []}
    for name, entry in load_configs().items():
        argv, _ = shrink(localize(entry["argv"], str(tmp_path)), str(tmp_path / "ckpt"))
        status, err = _parse(argv)
        assert "unrecognized arguments" not in err and "Traceback" not in err, (name, err[-2000:])
        if status == 0:
            outcomes["accepted"].append(name)
            continue
        assert status == 2, (name, status, err[-2000:])
        kind = "refused" if "not supported by this framework:" in err else "rejected"  # (a value out of range)
        assert "pretrain_gpt.py: error:" in err, (name, err[-2000:])
        outcomes[kind].append(name)
    assert len(load_configs()) == 227
    assert len(outcomes["accepted"]) >= ACCEPTED_AT_LEAST, {k: len(v) for k, v in outcomes.items()}
    assert set(STRATIFIED) <= set(outcomes["accepted"])


def _train(argv):
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        status, err = run_main(argv)
    losses = [float(line.split("lm loss: ")[1].split()[0]) for line in out.getvalue().splitlines()
              if "lm loss: " in line]
    return status, err, losses, out.getvalue()


@pytest.mark.parametrize("name", STRATIFIED)
def test_a_stratified_dozen_train_3_iterations_at_their_layouts(distributed, name, tmp_path):
    argv, world = shrink(localize(load_configs()[name]["argv"], str(tmp_path)), str(tmp_path / "ckpt"))
    status, err, losses, out = distributed(world, _train, argv)[0]
    assert status == 0, (name, err[-3000:])
    assert "no checkpoint to load" in out  # --load points at a folder without a checkpoint, as in their CI
    assert len(losses) == 3 and all(math.isfinite(x) for x in losses), (name, losses)


def test_deterministic_mode_repeats_a_run_bit_for_bit(distributed, tmp_path):
    """Two runs at dp 2 with --deterministic-mode: the same losses and checkpoint files to the last bit; and
    the mode is the run's only (deterministic algorithms are off again after it)."""
    def run(folder):
        argv = [*TINY, "--train-iters", "3", "--deterministic-mode", "--save", str(folder), "--save-interval", "3",
                "--hidden-dropout", "0.1", "--attention-dropout", "0.1", "--log-interval", "1"]
        results = distributed(2, _train_and_report_determinism, argv)
        assert results[0][0] == 0, results[0][1][-3000:]
        tensors = {os.path.relpath(path, folder): digest for path, digest in _files_digest(folder).items()
                   if path.endswith(".safetensors")}  # (metadata.json names the folder)
        return results[0][2], tensors, results[0][3]
    first, second = run(tmp_path / "a"), run(tmp_path / "b")
    assert first[0] == second[0] and len(first[0]) == 3, (first[0], second[0])
    assert first[1] == second[1] and len(first[1]) >= 2
    assert first[2] == (True, False)  # on during the run, off after it


def _train_and_report_determinism(argv):
    seen = []
    from megatron_core.training import loop

    original = loop._train

    def spy(run):
        seen.append(torch.are_deterministic_algorithms_enabled())
        return original(run)
    loop._train = spy
    try:
        status, err, losses, _ = _train(argv)
    finally:
        loop._train = original
    return status, err, losses, (seen[0] if seen else None, torch.are_deterministic_algorithms_enabled())
