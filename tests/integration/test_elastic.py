"""Elastic restart under torchrun --nnodes 1:2 --max-restarts: two agents on loopback (one rank each) train
dp 2 and save every iteration; the second "node" is SIGKILLed (agent and worker) at a random iteration; the
survivor's worker fails at once, torchrun restarts it at world size 1, it resumes the newest complete
checkpoint at dp 1 with the same global batch (twice the micro-batches) and finishes with the losses of a
run started from that checkpoint at dp 1 (fp32, 1e-5 relative)."""
import json
import random
import re
import shutil
import time

from tests.integration.agents import ROOT, TINY, Agents

ITERS = 12
ARGV = [*TINY, "--global-batch-size", "8", "--train-iters", str(ITERS), "--elastic-layout", "--zero-stage", "1",
        "--distributed-timeout-minutes", "0.5"]


def _train(argv):
    from megatron_core.training.arguments import parse_args
    from megatron_core.training.loop import pretrain
    return pretrain(parse_args(list(argv)))


def _records(path):
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if '"split"' not in line]


def test_killing_a_node_restarts_the_survivor_at_dp1_from_the_newest_checkpoint(tmp_path, distributed):
    ckpt, metrics = tmp_path / "ckpt", tmp_path / "metrics.jsonl"
    kill_after = random.Random().randint(2, 6)
    argv = [*ARGV, "--save", str(ckpt), "--save-interval", "1", "--load", str(ckpt), "--metrics-file", str(metrics)]
    with Agents(argv, nproc_per_node=1, nnodes="1:2", torchrun_args=["--max-restarts", "2"],
                out_dir=tmp_path) as agents:
        assert agents.wait(90, until=lambda: len(_records(metrics)) >= kill_after), agents.log(0)[-3000:]
        agents.kill_node(1)
        killed_at = time.monotonic()
        assert agents.wait(120, until=lambda: agents.procs[0].poll() is not None), agents.log(0)[-3000:]
        log = agents.log(0)
        assert agents.procs[0].returncode == 0, log[-4000:]
    recovered_in = time.monotonic() - killed_at
    resumed = re.search(r"loaded checkpoint \S+ \(iteration (\d+)\)", log)
    assert resumed and "continuing at dp 1 (tp 1, pp 1 kept) with 4 micro-batches per rank" in log, log[-4000:]
    start = int(resumed.group(1))
    assert start >= kill_after - 1, (start, kill_after)
    tail = _records(metrics)[-(ITERS - start):]
    assert [r["iteration"] for r in tail] == list(range(start + 1, ITERS + 1)), _records(metrics)
    # the reference: a fresh single-process run from that checkpoint at dp 1
    ref_dir = tmp_path / "ref"
    shutil.copytree(ckpt / f"iter_{start:07d}", ref_dir / f"iter_{start:07d}")
    (ref_dir / "latest_checkpointed_iteration.txt").write_text(str(start))
    reference = distributed(1, _train, [*ARGV, "--load", str(ref_dir)])[0]
    assert len(reference) == ITERS - start
    for got, want in zip([r["lm_loss"] for r in tail], reference):
        assert abs(got - want) <= 1e-5 * abs(want), ([r["lm_loss"] for r in tail], reference)
    assert recovered_in < 100, recovered_in


def test_a_worker_whose_agent_is_killed_exits_at_once(tmp_path):
    """SIGKILL of the torchrun agent alone: its worker (in a session of its own) notices and exits within
    about a second instead of training on as an orphan."""
    import os
    import signal
    metrics = tmp_path / "metrics.jsonl"
    with Agents([*TINY, "--train-iters", "100000", "--metrics-file", str(metrics)], nproc_per_node=1, nnodes="1",
                agents=1, out_dir=tmp_path) as agents:
        assert agents.wait(90, until=lambda: len(_records(metrics)) >= 2), agents.log(0)[-3000:]
        workers = [pid for pid in agents.workers(0) if "pretrain_gpt.py" in open(f"/proc/{pid}/cmdline").read()]
        assert len(workers) == 1, workers
        os.kill(agents.procs[0].pid, signal.SIGKILL)
        killed = time.monotonic()
        while os.path.exists(f"/proc/{workers[0]}") and time.monotonic() - killed < 10:
            if open(f"/proc/{workers[0]}/stat").read().split()[2] == "Z":
                break  # exited, not yet reaped
            time.sleep(0.05)
        lived = time.monotonic() - killed
    assert lived < 3, f"the orphaned worker still ran {lived:.1f} s after its agent was killed"


def _resumes(log):
    """The iterations the log's restarts resumed from ("loaded checkpoint ... (iteration N)")."""
    return [int(n) for n in re.findall(r"loaded checkpoint \S+ \(iteration (\d+)\)", log)]


def _segments(records, resumes=()):
    """The metrics records split into runs: [(checkpoint resumed, losses)]. A run starts where the iteration
    goes back, or at the record after a resume point N of ``resumes`` when the previous run's records ended
    exactly at N (a restart from the newest iteration leaves no seam; N + 1 is then recorded once only)."""
    iterations = [record["iteration"] for record in records]
    starts = {i for i in range(1, len(iterations)) if iterations[i] <= iterations[i - 1]}
    for resumed in set(resumes):
        at = [i for i, iteration in enumerate(iterations) if iteration == resumed + 1]
        if len(at) == 1 and at[0] > 0 and iterations[at[0] - 1] == resumed:
            starts.add(at[0])
    segments = []
    for i, record in enumerate(records):
        if i == 0 or i in starts:
            segments.append((record["iteration"] - 1, []))
        segments[-1][1].append(record["lm_loss"])
    return segments


def _reference(distributed, ckpt, tmp_path, start, world_size):
    """Losses of a fresh run at ``world_size`` ranks from checkpoint ``start`` (a copy of just that folder)."""
    ref_dir = tmp_path / f"ref_{start}_{world_size}"
    shutil.copytree(ckpt / f"iter_{start:07d}", ref_dir / f"iter_{start:07d}")
    (ref_dir / "latest_checkpointed_iteration.txt").write_text(str(start))
    return distributed(world_size, _train, [*SCALE_ARGV, "--load", str(ref_dir)])[0]


SCALE_ITERS, PACE = 30, "0.4"
SCALE_ARGV = [*TINY, "--global-batch-size", "8", "--train-iters", str(SCALE_ITERS), "--elastic-layout",
              "--zero-stage", "1", "--distributed-timeout-minutes", "0.5"]


def test_a_returning_node_scales_the_job_back_to_dp2(tmp_path, distributed):
    """(c) dp 2 on two agents; node 1 is SIGKILLed at a random iteration; the survivor goes on at dp 1; a new
    agent starts; torchrun restarts the survivor's worker when the new node waits to join, and the job
    finishes at dp 2. Each segment's losses equal a fresh run from its checkpoint at its layout (steps are
    paced to 0.4 s so that the dp 1 phase outlasts the new agent's start)."""
    ckpt, metrics = tmp_path / "ckpt", tmp_path / "metrics.jsonl"
    kill_after = random.Random().randint(2, 4)
    argv = [*SCALE_ARGV, "--save", str(ckpt), "--save-interval", "1", "--load", str(ckpt), "--async-save",
            "--metrics-file", str(metrics)]
    script = [str(ROOT / "tests" / "integration" / "paced_pretrain.py"), PACE]
    with Agents(argv, nproc_per_node=1, nnodes="1:2", torchrun_args=["--max-restarts", "2"], out_dir=tmp_path,
                script=script) as agents:
        assert agents.wait(90, until=lambda: len(_records(metrics)) >= kill_after), agents.log(0)[-3000:]
        agents.kill_node(1)
        def at_dp1():
            segments = _segments(_records(metrics), _resumes(agents.log(0)))
            return "continuing at dp 1" in agents.log(0) and len(segments) >= 2 and len(segments[-1][1]) >= 3
        assert agents.wait(90, until=at_dp1), agents.log(0)[-3000:]
        agents.start()  # node 2: a machine coming back
        assert agents.wait(150, until=lambda: agents.procs[0].poll() is not None and agents.procs[2].poll()
                           is not None), agents.log(0)[-3000:] + agents.log(2)[-3000:]
        logs = agents.log(0) + agents.log(2)
        assert agents.procs[0].returncode == 0 and agents.procs[2].returncode == 0, logs[-6000:]
    assert "continuing at dp 2 (tp 1, pp 1 kept) with 2 micro-batches per rank" in logs, logs[-6000:]
    segments = _segments(_records(metrics), _resumes(logs))
    assert len(segments) >= 3, segments
    (dp1_start, dp1_losses), (dp2_start, dp2_losses) = segments[-2], segments[-1]
    # dp 2 resumes from a checkpoint the dp 1 phase wrote (its newest complete one: an async save still in
    # flight when torchrun restarts the worker is not, and may be the last iteration dp 1 ran)
    assert dp1_start < dp2_start and dp2_start + len(dp2_losses) == SCALE_ITERS, segments
    for start, got, world_size in ((dp1_start, dp1_losses, 1), (dp2_start, dp2_losses, 2)):
        want = _reference(distributed, ckpt, tmp_path, start, world_size)[:len(got)]
        assert len(want) == len(got)
        for g, w in zip(got, want):
            assert abs(g - w) <= 1e-5 * abs(w), (start, world_size, got, want)


def _parent_of(pid):
    return int(open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[1])


def _rank_of(pid):
    environ = open(f"/proc/{pid}/environ", "rb").read().split(b"\0")
    return next((int(v.split(b"=", 1)[1]) for v in environ if v.startswith(b"RANK=")), None)


HANG_ITERS = 10
HANG_ARGV = [*TINY, "--global-batch-size", "8", "--train-iters", str(HANG_ITERS), "--zero-stage", "1"]


def test_a_stopped_rank_is_detected_within_the_timeout_and_torchrun_restarts_the_job(tmp_path, distributed):
    """(d) one agent, two ranks; rank 1 is SIGSTOPped mid-run. Rank 0's next collective fails after
    --distributed-timeout-minutes 0.1 (6 s) naming the stalled peer; torchrun stops the group (its SIGTERM to the
    stopped rank is delivered when the test wakes it, sparing torchrun's fixed 30 s grace before SIGKILL),
    restarts it, and the job resumes its newest checkpoint and ends with the losses of an uninterrupted
    single-process run (fp32, 1e-5)."""
    import os
    import signal
    ckpt, metrics = tmp_path / "ckpt", tmp_path / "metrics.jsonl"
    argv = [*HANG_ARGV, "--distributed-timeout-minutes", "0.1", "--save", str(ckpt), "--save-interval", "1",
            "--load", str(ckpt), "--metrics-file", str(metrics)]
    script = [str(ROOT / "tests" / "integration" / "paced_pretrain.py"), "0.3"]
    with Agents(argv, nproc_per_node=2, nnodes="1", agents=1, torchrun_args=["--max-restarts", "1"],
                out_dir=tmp_path, script=script) as agents:
        assert agents.wait(90, until=lambda: len(_records(metrics)) >= 3), agents.log(0)[-3000:]
        rank1 = [pid for pid in agents.workers(0) if _parent_of(pid) == agents.procs[0].pid and _rank_of(pid) == 1]
        assert len(rank1) == 1, rank1
        os.kill(rank1[0], signal.SIGSTOP)
        stopped = time.monotonic()
        assert agents.wait(60, until=lambda: "A peer rank died or stalled" in agents.log(0)), agents.log(0)[-3000:]
        detected_in = time.monotonic() - stopped
        # torchrun stops the group: SIGTERM to every worker, SIGKILL after its fixed 30 s grace to one that
        # does not exit; a stopped rank cannot, so the test wakes it once the SIGTERM is pending (saves 30 s)
        assert agents.wait(60, until=lambda: f"Sending process {rank1[0]} closing signal SIGTERM" in agents.log(0)), \
            agents.log(0)[-3000:]
        os.kill(rank1[0], signal.SIGCONT)
        assert agents.wait(150, until=lambda: agents.procs[0].poll() is not None), agents.log(0)[-3000:]
        log = agents.log(0)
        assert agents.procs[0].returncode == 0, log[-4000:]
    assert detected_in < 6 + 10, detected_in  # the timeout, and slack for the shared cores
    assert "--distributed-timeout-minutes 0.1" in log and "loaded checkpoint" in log, log[-4000:]
    # The restart resumes the newest checkpoint; when that is the last iteration the first run logged, the
    # records run on without a seam, so the resume point comes from the log, not from the records.
    assert _resumes(log), log[-4000:]
    start, records = _resumes(log)[-1], _records(metrics)
    assert 2 <= start < HANG_ITERS, (start, records)
    tail = records[-(HANG_ITERS - start):]
    assert [r["iteration"] for r in tail] == list(range(start + 1, HANG_ITERS + 1)), records
    reference = distributed(1, _train, HANG_ARGV)[0]
    for record in records:  # both runs, each iteration against the uninterrupted run
        want = reference[record["iteration"] - 1]
        assert abs(record["lm_loss"] - want) <= 1e-5 * abs(want), (record, reference)


def test_runs_split_at_seams_and_at_seamless_resume_points():
    """The splitting the restart tests rely on: a go-back, a restart from exactly the last logged iteration
    (no seam), both in one file, and no resume at all."""
    def records(iterations):
        return [{"iteration": i, "lm_loss": float(i)} for i in iterations]
    assert _segments(records([1, 2, 3, 4, 5, 6]), [3]) == [(0, [1.0, 2.0, 3.0]), (3, [4.0, 5.0, 6.0])]
    assert _segments(records([1, 2, 3, 4, 5, 3, 4]), [2]) == [(0, [1.0, 2.0, 3.0, 4.0, 5.0]), (2, [3.0, 4.0])]
    assert _segments(records([1, 2, 3, 4, 3, 4, 5, 6, 7]), [2, 5]) == [
        (0, [1.0, 2.0, 3.0, 4.0]), (2, [3.0, 4.0, 5.0]), (5, [6.0, 7.0])]
    assert _segments(records([1, 2, 3]), []) == [(0, [1.0, 2.0, 3.0])]
    assert _resumes("x loaded checkpoint /a/b (iteration 7) y\nloaded checkpoint c (iteration 12)") == [7, 12]
