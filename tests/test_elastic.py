"""Fault tolerance: verified checkpoints, replanning for the processes that remain,
refusing a world nothing fits, and an emitted program that survives a killed process.

The kill test is the real thing: ``autoplan emit`` writes the training script,
four torchrun agents (``--nnodes=2:4 --nproc-per-node=1 --max-restarts=3``, c10d
rendezvous on localhost) start it, one agent and its worker are SIGKILLed in
mid-run, the three agents left re-rendezvous, and their restarted workers replan
for 3 processes, reshard the last good checkpoint and train to the end.  The
losses of every step, before and after the kill, must equal a single-process
run's (same seed, same per-step data).  It takes ~40 s on 2 cores; the first step
on 3 processes comes ~13 s after the kill (torch's default 5 s rendezvous
keep-alive made that ~23 s: the survivors wait for the lost node to miss three
heartbeats).
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import io
import os
import re
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import time

import pytest
import torch

import autoplan
from autoplan.elastic import (EXIT_NO_LAYOUT, NoLayoutFits, batch_for_step, choose_plan,
                              cluster_for_world, main_exit_code, run_elastic)
from autoplan.runtime.checkpoint import MANIFEST_FILE, latest_good, verify
from autoplan.errors import CheckpointError, ConfigError
from autoplan.hardware.cluster import Cluster
from autoplan.plan import Plan
from dist_harness import run

#: tiny fp32 GPT; the global batch divides by 4 and by 3 (the world before and after the kill)
GPT_ARGS = dict(vocab_size=128, seq_len=16, hidden=32, heads=2, layers=4)
GLOBAL_BATCH = 12
SEED = 7
#: loss tolerance against the single-process reference (fp32; losses printed with 6 decimals)
ATOL = 1e-5


#: a 2-block, 2-head GPT and a batch of 2: on 3 single-device nodes no layout exists (dp=3
#: needs 3 sequences, pp=3 three blocks, tp=3 three heads), on 2 one does
IDLE_ARGS = dict(GPT_ARGS, layers=2)
IDLE_BATCH = 2


def _gpt(args: tuple | None = None) -> torch.nn.Module:
    from autoplan.zoo import build_model

    return build_model("gpt", dict(args or GPT_ARGS), dtype=torch.float32, device="cpu")[0]


@functools.lru_cache(maxsize=None)
def _graph(args: tuple | None = None):
    from autoplan.zoo import build_model

    return autoplan.trace(build_model("gpt", dict(args or GPT_ARGS), dtype=torch.float32)[0],
                          seq_len=GPT_ARGS["seq_len"])


def _cluster(nodes: int) -> Cluster:
    """``nodes`` A100 nodes with one device each (one torchrun agent = one process = one node)."""
    return autoplan.load_cluster("a100-sxm4-80gb", nodes=nodes).subset(range(0, 8 * nodes, 8))


@functools.lru_cache(maxsize=None)
def _plan(nodes: int, args: tuple | None = None, global_batch: int = GLOBAL_BATCH) -> Plan:
    """A plan of every process (the tiny model would run fastest on one: these tests are
    about worlds of several)."""
    return autoplan.plan(_graph(args), _cluster(nodes), global_batch=global_batch,
                         precision="fp32", use_all_devices=True)


def _train(rank: int, world: int, root: str, steps: int, every: int, keep: int,
           plan_json: str, cluster_json: str) -> dict:
    res = run_elastic(_gpt, Plan.from_json(plan_json), cluster=Cluster.from_json(cluster_json),
                      steps=steps, checkpoint_dir=root, checkpoint_every=every, seed=SEED,
                      keep=keep)
    return {"world": res.world_size, "resumed_from": res.resumed_from, "losses": res.losses,
            "checkpoints": res.checkpoints, "replanned": res.replanned}


def _reference_losses(steps: int, args: tuple | None = None,
                      global_batch: int = GLOBAL_BATCH) -> dict[int, float]:
    """One plain process, no autoplan runtime: same seed, same model, same per-step data."""
    from autoplan.runtime.loss import token_cross_entropy

    torch.manual_seed(SEED)
    model = _gpt(args)
    opt = torch.optim.AdamW(model.parameters())
    out = {}
    for step in range(1, steps + 1):
        ids = batch_for_step(SEED, step, global_batch=global_batch, seq_len=GPT_ARGS["seq_len"],
                             vocab_size=GPT_ARGS["vocab_size"])
        loss = token_cross_entropy(model(ids), ids, shift=True)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        out[step] = float(loss.detach())
    return out


def _tree(root) -> dict[str, str]:
    out = {}
    for dirpath, _, names in os.walk(root):
        for name in names:
            full = os.path.join(dirpath, name)
            with open(full, "rb") as f:
                out[os.path.relpath(full, root)] = hashlib.sha256(f.read()).hexdigest()
    return out


def _data_file(ckpt: str) -> str:
    """The largest DCP data file of a checkpoint."""
    names = [n for n in os.listdir(ckpt) if n.endswith(".distcp")]
    return max(names, key=lambda n: os.path.getsize(os.path.join(ckpt, n)))


# ---------------------------------------------------------------------- (a) integrity
@pytest.mark.distributed
def test_latest_good_skips_corrupt_and_half_written_checkpoints(tmp_path):
    root = tmp_path / "ckpt"
    out = run(_train, 2, str(root), 3, 1, 2, _plan(2).to_json(), _cluster(2).to_json())
    assert out[0]["losses"].keys() == {1, 2, 3} and not out[0]["replanned"]
    # keep=2: step-1 was deleted once step-3 verified
    assert sorted(os.listdir(root)) == ["step-2", "step-3"]
    for name in ("step-2", "step-3"):
        verify(root / name)
    assert latest_good(root) == (str(root / "step-3"), 3)

    # a save interrupted before its rename/manifest leaves temp dirs: never a checkpoint
    (root / ".partial-step-4").mkdir()
    (root / ".partial-step-4" / "__0_0.distcp").write_bytes(b"half")
    (root / "step-5.tmp-0123456789ab").mkdir()

    pristine = tmp_path / "pristine"
    shutil.copytree(root / "step-3", pristine)
    data = _data_file(pristine)

    def flip(path):
        raw = bytearray(path.read_bytes())
        raw[len(raw) // 2] ^= 0xFF
        path.write_bytes(bytes(raw))

    def truncate(path):
        path.write_bytes(path.read_bytes()[:-7])

    cases = {
        "flipped bytes": (lambda d: flip(d / data), [data, "corrupt"]),
        "truncated": (lambda d: truncate(d / data), [data, "truncated"]),
        "deleted file": (lambda d: (d / data).unlink(), [data, "missing"]),
        "no manifest": (lambda d: (d / MANIFEST_FILE).unlink(), [MANIFEST_FILE, "incomplete"]),
        "bad manifest": (lambda d: (d / MANIFEST_FILE).write_text("{"), [MANIFEST_FILE,
                                                                         "malformed"]),
    }
    for what, (damage, words) in cases.items():
        shutil.rmtree(root / "step-3")
        shutil.copytree(pristine, root / "step-3")
        damage(root / "step-3")
        with pytest.raises(CheckpointError) as err:
            verify(root / "step-3")
        for word in words:
            assert word in str(err.value), (what, str(err.value))
        with pytest.warns(UserWarning, match=re.escape(str(root / "step-3"))) as rec:
            assert latest_good(root) == (str(root / "step-2"), 2), what
        assert any(words[0] in str(w.message) for w in rec), what

    # nothing good at all
    shutil.rmtree(root / "step-2")
    with pytest.warns(UserWarning):
        assert latest_good(root) is None
    assert latest_good(tmp_path / "nowhere") is None


def test_integrity_names_are_one_implementation_beside_the_dcp_code():
    """The verified-checkpoint functions live in runtime.checkpoint_integrity; elastic and
    runtime.checkpoint hand out those same objects (no second copy)."""
    import autoplan.elastic as elastic
    import autoplan.runtime.checkpoint as dcp_checkpoint
    import autoplan.runtime.checkpoint_integrity as integrity

    for name in ("save_verified", "verify", "latest_good", "MANIFEST_FILE"):
        assert getattr(elastic, name) is getattr(integrity, name), name
        assert getattr(dcp_checkpoint, name) is getattr(integrity, name), name
        assert name in elastic.__all__ and name in dcp_checkpoint.__all__, name


# ---------------------------------------------------------------------- (b) the policy
def test_cluster_for_world_keeps_the_first_devices_and_grows_like_the_last_node():
    c = autoplan.load_cluster("a100-sxm4-80gb", nodes=2)
    assert cluster_for_world(c, 16) is not None and cluster_for_world(c, 16).num_devices == 16
    small = cluster_for_world(c, 8)                # a node lost: whole first node kept
    assert (small.num_devices, small.num_nodes) == (8, 1)
    big = cluster_for_world(c, 28)                 # nodes added, like the last one
    assert (big.num_devices, big.num_nodes) == (28, 4)
    assert [len(n.local_ranks) for n in big.nodes] == [8, 8, 8, 4]
    assert {t.name for t in big.device_types} == {"A100-SXM4-80GB"}
    with pytest.raises(ConfigError):
        cluster_for_world(c, 0)


def test_choose_plan_replans_within_what_the_runtime_runs():
    from autoplan.runtime import check_plan
    from autoplan.runtime.idle import compact

    plan, graph, cluster = _plan(4), _graph(), _cluster(4)
    assert choose_plan(plan, 4, graph=graph, cluster=cluster) is plan
    for world in (3, 2, 6):
        new = choose_plan(plan, world, graph=graph, cluster=cluster)
        # a plan for the world's processes, some of which it may leave idle
        assert new.cluster.num_devices == world and new.global_batch == GLOBAL_BATCH
        assert set(new.mesh.devices) | set(new.idle_devices) == set(range(world))
        check_plan(compact(new), new.num_devices, graph)   # the runtime accepts it
        assert choose_plan(plan, world, graph=graph, cluster=cluster).to_json() == new.to_json()
        # a plan made for this world (idle processes counted) runs as it is
        assert choose_plan(new, world, graph=graph, cluster=cluster) is new
    # 12 sequences split evenly over no data-parallel degree of 5 single-device nodes:
    # without idle nodes, the batch is split unevenly over all 5; with them, the fastest
    idle = choose_plan(plan, 5, graph=graph, cluster=cluster)
    all5 = choose_plan(plan, 5, graph=graph, cluster=cluster, allow_idle=False)
    assert all5.num_devices == 5 and not all5.idle_devices
    assert len(set(all5.replica_batch)) > 1 and sum(all5.replica_batch) == GLOBAL_BATCH
    assert idle.estimate.step_time_s <= all5.estimate.step_time_s
    assert idle.num_devices == 5 or idle.idle_reason
    check_plan(all5, 5, graph)
    # 2 sequences, 2 blocks and 2 heads on 3 processes: no layout at all (dp=3 needs 3
    # sequences, pp=3 three blocks, tp=3 three heads), and idle nodes not allowed
    args = tuple(IDLE_ARGS.items())
    with pytest.raises(NoLayoutFits, match="no layout fits 3 processes"):
        choose_plan(_plan(4, args, IDLE_BATCH), 3, graph=_graph(args), cluster=cluster,
                    allow_idle=False)
    with pytest.raises(ConfigError, match="replanning needs the cluster"):
        choose_plan(plan, 3, graph=graph)


def _train_idle(rank: int, world: int, root: str, plan_json: str, cluster_json: str,
                fail_at: int | None = None, fail_rank: int = 1) -> dict:
    def on_step(step: int, loss: float) -> None:
        if step == fail_at and rank == fail_rank:
            raise RuntimeError("injected failure")

    res = run_elastic(functools.partial(_gpt, tuple(IDLE_ARGS.items())),
                      Plan.from_json(plan_json), cluster=Cluster.from_json(cluster_json),
                      steps=4, checkpoint_dir=root, checkpoint_every=2, seed=SEED,
                      on_step=on_step)
    import torch.distributed as dist

    return {"active": res.active, "devices": res.plan.num_devices, "losses": res.losses,
            "group": dist.get_world_size()}


@pytest.mark.distributed
def test_processes_no_layout_uses_wait_idle_and_rejoin(tmp_path):
    from dist_harness import run_outcomes

    args = tuple(IDLE_ARGS.items())
    plan, cluster = _plan(4, args, IDLE_BATCH), _cluster(4)
    chosen = choose_plan(plan, 3, graph=_graph(args), cluster=cluster)
    active = [r in chosen.mesh.devices for r in range(3)]
    assert not all(active) and chosen.idle_reason      # no layout of all 3
    out = run(_train_idle, 3, str(tmp_path / "a"), plan.to_json(), cluster.to_json())
    assert [o["active"] for o in out] == active
    assert {o["devices"] for o in out} == {chosen.num_devices} and {o["group"] for o in out} == {3}
    reference = _reference_losses(4, args, IDLE_BATCH)
    first, idle = active.index(True), active.index(False)
    torch.testing.assert_close(out[first]["losses"], reference, atol=ATOL, rtol=0)
    assert out[idle]["losses"] == {}
    # an active process fails: the idle one's wait ends with the reason, not a hang
    outcomes = run_outcomes(_train_idle, 3, str(tmp_path / "b"), plan.to_json(),
                            cluster.to_json(), 2, max(chosen.mesh.devices), timeout=120,
                            pg_timeout=30)
    assert all(o.value is None for o in outcomes)
    err = outcomes[idle].error or ""
    assert "an active process of this job failed" in err and "injected failure" in err, \
        outcomes[idle].describe()


def test_the_first_failure_is_the_reason_the_idle_processes_read():
    """When one active process fails, the others' collectives fail after it (a peer's
    connection closed) and they report too: the idle processes read the first reason."""
    import datetime

    import torch.distributed as dist

    from autoplan.runtime.idle import IdleSplit

    store = dist.TCPStore("127.0.0.1", 0, None, is_master=True,
                          timeout=datetime.timedelta(seconds=5), wait_for_workers=False)
    plan = _plan(4, tuple(IDLE_ARGS.items()), IDLE_BATCH)
    split = IdleSplit(store, 0, 4, "gloo", datetime.timedelta(seconds=5), True, plan)
    # the plan uses every process: nobody to wait for, so fail() returns at once
    split.fail("rank 2: RuntimeError: injected failure")
    split.fail("rank 0: DistBackendError: Connection closed by peer")
    idle = IdleSplit(store, 3, 4, "gloo", datetime.timedelta(seconds=5), False, plan)
    with pytest.raises(RuntimeError, match="injected failure"):
        idle.wait_done()


@functools.lru_cache(maxsize=None)
def _big():
    """A 6.9B-parameter GPT planned on 8 A100-80GB: its fp32 Adam states (~110 GB) fit 8
    GPUs sharded, never one."""
    from autoplan.zoo import build_model

    args = dict(vocab_size=50304, seq_len=1024, hidden=4096, heads=32, layers=32)
    graph = autoplan.trace(build_model("gpt", args, dtype=torch.float32)[0], seq_len=1024)
    cluster = autoplan.load_cluster("a100-sxm4-80gb")
    plan = autoplan.plan(graph, cluster, global_batch=8, precision="fp32")
    return graph, cluster, plan


def _refused(rank: int, world: int, root: str, graph_json: str, plan_json: str,
             cluster_json: str) -> dict:
    from autoplan.graph import ModelGraph

    built = []

    def factory():                   # the model must not be built when no plan fits
        built.append(1)
        raise AssertionError("the model was built")

    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        code = main_exit_code(lambda: run_elastic(
            factory, Plan.from_json(plan_json), cluster=Cluster.from_json(cluster_json),
            graph=ModelGraph.from_json(graph_json), steps=4, checkpoint_dir=root,
            checkpoint_every=2))
    return {"code": code, "stderr": err.getvalue(), "built": bool(built)}


@pytest.mark.distributed
def test_refuses_a_world_whose_memory_nothing_fits_and_leaves_checkpoints(tmp_path):
    graph, cluster, plan = _big()
    assert plan.num_devices == 8 and plan.estimate.fits
    with pytest.raises(NoLayoutFits) as err:
        choose_plan(plan, 1, graph=graph, cluster=cluster)
    e = err.value
    assert e.required_bytes > e.available_bytes > 0
    msg = str(e)
    assert "no layout fits 1 processes" in msg and "GiB per device" in msg
    assert "Checkpoints were left untouched" in msg

    root = tmp_path / "ckpt"
    (root / "step-4").mkdir(parents=True)
    (root / "step-4" / "__0_0.distcp").write_bytes(b"x" * 100)
    (root / "step-4" / MANIFEST_FILE).write_text("{}")
    before = _tree(root)
    out = run(_refused, 1, str(root), graph.to_json(), plan.to_json(), cluster.to_json())[0]
    assert out["code"] == EXIT_NO_LAYOUT == 3 and not out["built"]
    assert "no layout fits 1 processes" in out["stderr"] and "GiB" in out["stderr"]
    assert _tree(root) == before


# ---------------------------------------------------------------------- (c) the kill test
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _children(pid: int) -> list[int]:
    """Direct children of ``pid`` (torchrun's workers; they run in their own sessions)."""
    out = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            continue
        if ppid == pid:
            out.append(int(entry))
    return out


def _kill_tree(proc: subprocess.Popen) -> None:
    for pid in _children(proc.pid):
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)


@pytest.mark.distributed
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc to find workers")
@pytest.mark.slow   # torchrun restarts a job after a rank is killed: ~1 min
def test_emitted_program_survives_a_killed_process_under_torchrun(tmp_path):
    from autoplan.emit import RESTART_ENV, emit_script, launch_commands

    steps, every, kill_after = 24, 4, 10
    plan, cluster = _plan(4), _cluster(4)
    script = tmp_path / "train.py"
    script.write_text(emit_script(plan, "gpt", GPT_ARGS, cluster=cluster, min_nodes=2,
                                  max_restarts=3))
    root, logs = tmp_path / "ckpt", tmp_path / "logs"
    logs.mkdir()
    port = _free_port()
    # the emitted launch line on localhost, with quick rendezvous timeouts for the test
    line = launch_commands(plan, str(script), endpoint=f"127.0.0.1:{port}", min_nodes=2,
                           max_restarts=3, last_call_timeout_s=1, keep_alive_s=1,
                           args=f"--steps {steps} --checkpoint-every {every} "
                                f"--checkpoint-dir {root} --seed {SEED}")[0]
    prefix, _, rest = line.partition(" torchrun ")
    assert prefix == RESTART_ENV and "--nnodes=2:4" in rest and "--max-restarts=3" in rest
    cmd = [sys.executable, "-m", "torch.distributed.run", "--monitor-interval=0.2",
           *shlex.split(rest)]
    key, value = RESTART_ENV.split("=")
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", **{key: value})
    agents: list[subprocess.Popen] = []

    def text() -> str:
        return "".join((logs / f"agent{i}.log").read_text(errors="replace")
                       for i in range(len(agents)))

    def start(i: int) -> None:
        with open(logs / f"agent{i}.log", "w") as f:
            agents.append(subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, env=env,
                                           cwd=tmp_path, start_new_session=True))

    def wait_for(pred, timeout: float, what: str) -> None:
        end = time.monotonic() + timeout
        while not pred():
            if time.monotonic() > end:
                pytest.fail(f"timed out waiting for {what}; agent logs:\n{text()[-6000:]}")
            time.sleep(0.05)

    def listening() -> bool:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
            return True
        except OSError:
            return False

    try:
        start(0)                      # agent 0 hosts the rendezvous store: never the victim
        wait_for(listening, 60, "the rendezvous store")
        for i in (1, 2, 3):
            start(i)
        wait_for(lambda: any(int(s) >= kill_after for s in re.findall(r"step (\d+) loss", text())),
                 180, f"step {kill_after}")
        victim = agents[3]
        workers = _children(victim.pid)
        assert workers, "agent 3 has no worker"
        _kill_tree(victim)            # a node lost: its agent and its worker
        t_kill = time.monotonic()
        wait_for(lambda: "world 3" in text(), 180, "training to resume on 3 processes")
        recovery_s = time.monotonic() - t_kill
        for a in agents[:3]:
            try:
                a.wait(timeout=180)
            except subprocess.TimeoutExpired:
                pytest.fail(f"an agent did not finish; logs:\n{text()[-6000:]}")
    finally:
        for a in agents:
            _kill_tree(a)
    log = text()
    assert [a.returncode for a in agents[:3]] == [0, 0, 0], log[-6000:]

    losses: dict[int, dict[int, float]] = {4: {}, 3: {}}
    order: dict[int, list[int]] = {4: [], 3: []}
    for s, x, w in re.findall(r"step (\d+) loss ([0-9.]+) world (\d+)", log):
        losses[int(w)][int(s)] = float(x)
        order[int(w)].append(int(s))
    saved4 = [int(s) for s in re.findall(r"checkpoint step-(\d+) saved \(world 4\)", log)]
    resumed = [int(s) for s in re.findall(r"resumed from step (\d+) on 3 processes", log)]
    killed_at = max(order[4])
    print(f"\nkilled after step {killed_at} (checkpoints of world 4: {saved4}), resumed from "
          f"step {resumed} on 3 processes {recovery_s:.1f} s after the kill")
    m = re.search(r"elastic: the plan is for 4 processes.*\n(?:  .*\n)+", log)
    print(m.group(0) if m else "no replan message")
    # before the kill: steps 1..k once each; after: from the last good checkpoint to the end
    assert order[4] == list(range(1, killed_at + 1)) and killed_at >= kill_after
    assert resumed == [max(saved4)], (resumed, saved4, log[-8000:])
    assert killed_at - resumed[0] <= every          # nothing lost beyond the interval
    assert order[3] == list(range(resumed[0] + 1, steps + 1))   # none applied twice
    assert "replanned" in log and "the job has 3" in log
    reference = _reference_losses(steps)
    for world in (4, 3):
        torch.testing.assert_close(losses[world], {s: reference[s] for s in losses[world]},
                                   atol=ATOL, rtol=0)
    assert latest_good(root) == (str(root / f"step-{steps}"), steps)
    import json
    with open(root / f"step-{steps}" / MANIFEST_FILE) as f:
        assert json.load(f)["world_size"] == 3
