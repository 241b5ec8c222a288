"""The host's time per operator (``DeviceType.op_overhead``), computed by hand.

On a CPU every operator of an eager step pays the dispatcher before its arithmetic; the
profiler measures that per operator a block's forward dispatches and per node its backward
runs (:mod:`autoplan.hardware.profiler`; profiles before them per captured operator) and the
cost model adds it per those of each layer and micro-batch, whatever the micro-batch's
size, plus the DTensor machinery of each tensor-parallel linear when tp > 1,
and under selective recompute torch's Python dispatch mode per operator a block dispatches;
and once per step the optimizer's per parameter tensor, plain or DTensor.
"""

from __future__ import annotations

import dataclasses

import pytest

from autoplan import load_cluster, trace
from autoplan.cost import CostOptions, estimate
from autoplan.cost.summary import summarize
from autoplan.models import GPT, GPTConfig
from autoplan.strategy import Strategy
from runtime_cases import cpu_cluster

CONFIG = GPTConfig(vocab_size=128, seq_len=16, hidden=32, heads=4, layers=4)
OVERHEAD = {"forward_s": 10e-6, "backward_s": 20e-6, "tp_linear_forward_s": 300e-6,
            "tp_linear_backward_s": 700e-6,
            "optimizer_param_s": 40e-6, "optimizer_dtensor_param_s": 200e-6}
NO_OVERLAP = CostOptions(overlap_grad_reduce=False, overlap_param_gather=False,
                         tp_comm_overlap=False, pp_comm_overlap=False)
NO_AUTOCAST = CostOptions(overlap_grad_reduce=False, overlap_param_gather=False,
                          tp_comm_overlap=False, pp_comm_overlap=False, autocast=False,
                          grad_accumulate_add=False)


@pytest.fixture(scope="module")
def graph():
    return trace(GPT(CONFIG), seq_len=CONFIG.seq_len)


def _step(graph, strategy, overhead):
    cluster = cpu_cluster(2, overhead=overhead)
    return estimate(graph, cluster, strategy, calibration=None, options=NO_OVERLAP)


def test_operators_are_counted_per_layer(graph):
    """Each block of the GPT captures 31 nodes: 28 operators and 3 getitem; the embedding
    layer's guard function is not an operator; tensor parallelism shards the block's four
    linears and the vocabulary embedding and head."""
    counts = summarize(graph).op_counts
    blocks = [t for t in counts if t.startswith("blocks")]
    assert blocks and all(counts[t] == (28, 4, 0) for t in blocks)
    assert counts["pre"] == (5, 1, 0) and counts["post"] == (8, 1, 0)


SHARED = {"tp_shared_linear_forward_s": 50e-6, "tp_shared_linear_backward_s": 80e-6}


@pytest.fixture(scope="module")
def llama_graph():
    from runtime_cases import make_llama
    return trace(make_llama(0), seq_len=16)


def test_column_linears_sharing_a_region_input_are_counted(llama_graph):
    """A Llama block's q, k and v share the attention's input and gate and up the MLP's
    (autoplan.runtime.tp takes each region's input once): 3 of its 7 tensor-parallel
    linears share; the GPT's fused qkv and single MLP column share nothing (above)."""
    counts = summarize(llama_graph).op_counts
    blocks = [t for t in counts if t.startswith("model.layers")]
    assert blocks and all(counts[t][1:] == (7, 3) for t in blocks)
    assert counts["pre"][1:] == (1, 0) and counts["post"][1:] == (1, 0)


def test_shared_column_linears_pay_their_own_figure(llama_graph):
    """With the shared figures measured, a Llama block's 4 unshared tensor-parallel linears
    pay the per-linear figure and its 3 shared ones the shared figure; without them
    (a profile from before) all 7 pay the per-linear figure."""
    s = Strategy(tp=2, micro_batch=2, global_batch=8, precision="fp32")
    base = _step(llama_graph, s, OVERHEAD)
    shared = _step(llama_graph, s, {**OVERHEAD, **SHARED})
    micro_batches = 4
    per_block = 3 * ((300e-6 + 700e-6) - (50e-6 + 80e-6))
    saved = base.breakdown["compute_s"] - shared.breakdown["compute_s"]
    assert saved == pytest.approx(micro_batches * 4 * per_block, rel=1e-9)


def test_shared_figures_come_in_pairs_and_round_trip():
    """A profile states both shared-linear figures or neither (a clear ProfileError), and
    they survive a YAML round trip; a profile without them writes none."""
    import yaml

    from autoplan.errors import ProfileError
    from autoplan.hardware import OpOverhead
    from autoplan.hardware.profile_yaml import parse_profile, profile_to_yaml
    with pytest.raises(ProfileError, match="both shared-linear figures"):
        OpOverhead(forward_s=0.0, backward_s=0.0, tp_linear_forward_s=0.0,
                   tp_linear_backward_s=0.0, source="x", tp_shared_linear_forward_s=1e-6)
    p = next(iter(_with({**OVERHEAD, **SHARED}).profiles.values()))
    o = parse_profile(yaml.safe_load(profile_to_yaml(p))).device.op_overhead
    assert (o.tp_shared_linear_forward_s, o.tp_shared_linear_backward_s) == (50e-6, 80e-6)
    p = next(iter(_with(OVERHEAD).profiles.values()))
    assert parse_profile(yaml.safe_load(profile_to_yaml(p))).device.op_overhead \
        .tp_shared_linear_forward_s is None


@pytest.mark.parametrize("tp", [1, 2])
def test_overhead_is_per_operator_and_micro_batch(graph, tp):
    s = Strategy(dp=2 // tp, tp=tp, micro_batch=2, global_batch=8, precision="fp32")
    base = _step(graph, s, None)
    with_overhead = _step(graph, s, OVERHEAD)
    micro_batches = 8 // (2 // tp) // 2
    ops = 5 + 4 * 28 + 8                      # pre, four blocks, post
    per_micro_batch = ops * (10e-6 + 20e-6)
    if tp > 1:
        per_micro_batch += (1 + 4 * 4 + 1) * (300e-6 + 700e-6)
    added = with_overhead.breakdown["compute_s"] - base.breakdown["compute_s"]
    assert added == pytest.approx(micro_batches * per_micro_batch, rel=1e-9)
    # (the optimizer's host time per parameter tensor: test_optimizer_pays_the_host_...)
    others = {k: v for k, v in with_overhead.breakdown.items()
              if k not in ("compute_s", "optimizer_s")}
    assert others == pytest.approx({k: v for k, v in base.breakdown.items()
                                    if k not in ("compute_s", "optimizer_s")})


def test_parameter_tensors_are_counted_per_layer(graph):
    """The GPT's embedding layer owns the token and position tables (the token table is
    sharded by tensor parallelism), each block 12 tensors (weights and biases of two layer
    norms and four linears, the linears' 8 sharded), the last layer the final norm and
    the head: every parameter of the model once."""
    counts = [(l.name, l.param_tensors, l.tp_param_tensors) for l in graph.layers]
    assert counts == [("pre", 2, 1), *((f"blocks.{i}", 12, 8) for i in range(4)),
                      ("post", 3, 1)]
    assert sum(c[1] for c in counts) == len(list(GPT(CONFIG).parameters()))


@pytest.mark.parametrize("layout, plain, dtensors", [
    # DDP: plain parameters
    (dict(dp=2), 53, 0),
    # FSDP2 (ZeRO-1..3) wraps every parameter as a DTensor (its shard)
    (dict(dp=2, zero=1), 0, 53),
    (dict(dp=2, zero=3), 0, 53),
    # tensor parallelism alone: only the sharded linears' parameters are DTensors
    (dict(tp=2), 53 - 34, 34),
    # with data parallelism too, FSDP2's replicate wraps them all
    (dict(dp=2, tp=2), 0, 53),
])
def test_optimizer_pays_the_host_per_parameter_tensor(graph, layout, plain, dtensors):
    world = layout.get("dp", 1) * layout.get("tp", 1)
    s = Strategy(**layout, micro_batch=2, global_batch=8, precision="fp32")
    cluster = cpu_cluster(world, overhead=OVERHEAD)
    without = cpu_cluster(world, overhead={**OVERHEAD, "optimizer_param_s": 0.0,
                                           "optimizer_dtensor_param_s": 0.0})
    added = (estimate(graph, cluster, s, calibration=None, options=NO_OVERLAP)
             .breakdown["optimizer_s"]
             - estimate(graph, without, s, calibration=None, options=NO_OVERLAP)
             .breakdown["optimizer_s"])
    assert added == pytest.approx(plain * 40e-6 + dtensors * 200e-6, rel=1e-9)


@pytest.mark.parametrize("layout,updated", [
    (dict(dp=2), 1.0),            # every parameter on each rank
    (dict(dp=2, zero=1), 0.5),    # its shard of them
    (dict(tp=2), None),           # the sharded linears halved, the rest whole
])
def test_optimizer_bytes_priced_per_measured_element(graph, layout, updated):
    """With ``optimizer_element_s`` (the fused step measured per fp32 element) the step's
    traffic is that figure per parameter the rank updates, not bytes over the copy
    bandwidth; a bf16 recipe with its master copy in the optimizer (30 bytes a parameter
    against fp32's 28) scales it, FSDP2's policy (which steps the fp32 parameters) not."""
    world = layout.get("dp", 1) * layout.get("tp", 1)
    per_element = 3e-9
    off = {**OVERHEAD, "optimizer_param_s": 0.0, "optimizer_dtensor_param_s": 0.0}
    on = {**off, "optimizer_element_s": per_element}
    master_copy = dataclasses.replace(NO_AUTOCAST, master_weights="optimizer",
                                      grad_reduce_dtype="bf16")
    opt = {}
    for precision, options in (("fp32", NO_AUTOCAST), ("bf16", master_copy),
                               ("bf16 fsdp2", NO_AUTOCAST)):
        s = Strategy(**layout, micro_batch=2, global_batch=8, precision=precision.split()[0])
        for name, o in (("off", off), ("on", on)):
            e = estimate(graph, cpu_cluster(world, overhead=o), s, calibration=None,
                         options=options)   # (its gradient accumulation: elsewhere)
            opt[precision, name] = e.breakdown["optimizer_s"]
    params = graph.num_params
    bandwidth_priced = opt["fp32", "off"]
    elements = opt["fp32", "on"] / per_element           # the parameters this rank updates
    assert elements == pytest.approx(bandwidth_priced * cpu_cluster(world).profile_of(0)
                                     .device.memory_bw_bytes_per_s / 28, rel=1e-9)
    if updated is not None:
        assert elements == pytest.approx(updated * params, rel=1e-9)
    else:
        assert 0.5 * params < elements < params
    assert opt["bf16", "on"] == pytest.approx(opt["fp32", "on"] * 30 / 28, rel=1e-9)
    assert opt["bf16 fsdp2", "on"] == pytest.approx(opt["fp32", "on"], rel=1e-9)


def test_pipeline_stages_pay_for_their_own_tensors(graph):
    """Each stage's optimizer steps its own layers' tensors: pre + two blocks (26) and two
    blocks + post (27); under a pipeline with data parallelism FSDP2's replicate makes
    them DTensors."""
    def busy(overhead, **layout):
        world = layout.get("dp", 1) * layout["pp"]
        s = Strategy(**layout, micro_batch=2, global_batch=8, schedule="1f1b",
                     precision="fp32")
        e = estimate(graph, cpu_cluster(world, overhead=overhead), s, calibration=None,
                     options=NO_OVERLAP)
        return [st.busy_s for st in e.stages]

    zero = {**OVERHEAD, "optimizer_param_s": 0.0, "optimizer_dtensor_param_s": 0.0}
    for layout, per_tensor in ((dict(pp=2), 40e-6), (dict(dp=2, pp=2), 200e-6)):
        added = [a - b for a, b in zip(busy(OVERHEAD, **layout), busy(zero, **layout))]
        assert added == pytest.approx([26 * per_tensor, 27 * per_tensor], rel=1e-9)


def test_a_block_dispatches_what_the_capture_counts(graph):
    """``dispatched_ops`` is what one eager forward of the block dispatches below autograd
    (where torch's selective checkpoint runs its Python mode) at the captured micro-batch:
    48 operators for the 28 captured (a linear arrives as view + t + addmm + view, a
    matmul as expand + view + bmm + _unsafe_view).  With more than one sequence the
    attention's three head-merging reshapes must copy (clone + _unsafe_view for a view):
    51, which the count misses."""
    import torch

    from autoplan.opstream import DispatchCount

    torch.manual_seed(0)
    model = GPT(CONFIG)
    count = DispatchCount()

    def enter(*_):
        count.__enter__()

    def leave(*_):
        count.__exit__(None, None, None)

    model.blocks[1].register_forward_pre_hook(enter)
    model.blocks[1].register_forward_hook(leave)
    eager = {}
    for sequences in (graph.micro_batch, 2):
        count.total = 0
        model(torch.randint(0, CONFIG.vocab_size, (sequences, CONFIG.seq_len)))
        eager[sequences] = count.total
    assert graph.micro_batch == 1 and eager == {1: 48, 2: 51}
    blocks = [layer for layer in graph.layers if layer.kind.value == "block"]
    assert all(layer.dispatched_ops == 48 for layer in blocks)


def test_a_block_runs_the_autograd_nodes_the_capture_counts(graph):
    """``autograd_nodes`` is what the block's backward runs: 45 nodes for its operators (a
    view's node too) and 12 parameters accumulated; the whole model's backward from the
    capture's objective, what the capture's layers add up to."""
    import torch

    from autoplan.opstream import autograd_nodes
    from autoplan.runtime.loss import token_cross_entropy

    torch.manual_seed(0)
    model = GPT(CONFIG)
    ids = torch.randint(0, CONFIG.vocab_size, (graph.micro_batch, CONFIG.seq_len))
    x = model.drop(model.tok_emb(ids) + model.pos_emb(torch.arange(CONFIG.seq_len)))
    block = model.blocks[1](x.detach().requires_grad_(True))
    is_param = lambda t: isinstance(t, torch.nn.Parameter)   # noqa: E731
    blocks = [layer for layer in graph.layers if layer.kind.value == "block"]
    assert autograd_nodes([block], is_param) == 57
    assert all(layer.autograd_nodes == 57 for layer in blocks)
    loss = token_cross_entropy(model(ids), ids, shift=True)   # the capture's objective
    assert sum(l.autograd_nodes for l in graph.layers) == autograd_nodes([loss], is_param)


def test_host_time_is_per_dispatched_operator_and_autograd_node(graph):
    """A profile with the per-dispatch figures prices each layer's forward per operator it
    dispatches and its backward per autograd node, in every micro-batch; the per-captured
    figures beside them are then unused.  A graph captured before the counts (every
    ``autograd_nodes`` 0) is priced per captured operator."""
    import dataclasses

    from autoplan.graph import ModelGraph

    s = Strategy(dp=2, micro_batch=2, global_batch=8, precision="fp32")
    micro_batches = 8 // 2 // 2
    per_dispatch = {**OVERHEAD, "forward_dispatch_s": 3e-6, "backward_node_s": 7e-6}
    added = (_step(graph, s, per_dispatch).breakdown["compute_s"]
             - _step(graph, s, None).breakdown["compute_s"])
    dispatched = sum(l.dispatched_ops for l in graph.layers)
    nodes = sum(l.autograd_nodes for l in graph.layers)
    assert added == pytest.approx(micro_batches * (dispatched * 3e-6 + nodes * 7e-6), rel=1e-9)
    old = ModelGraph.from_json(dataclasses.replace(
        graph, layers=tuple(dataclasses.replace(l, autograd_nodes=0) for l in graph.layers)
    ).to_json())
    added_old = (_step(old, s, per_dispatch).breakdown["compute_s"]
                 - _step(old, s, None).breakdown["compute_s"])
    assert added_old == pytest.approx(micro_batches * (5 + 4 * 28 + 8) * (10e-6 + 20e-6),
                                      rel=1e-9)


def test_selective_recompute_pays_the_dispatch_mode_per_operator(graph):
    """torch's selective checkpoint runs every operator of a block's forward and recompute
    through a Python dispatch mode: ``selective_dispatch_s`` per operator each block
    dispatches; a profile measured before it, per captured operator (``selective_s``)."""
    s = Strategy(dp=2, micro_batch=2, global_batch=8, recompute="selective", precision="fp32")
    micro_batches = 8 // 2 // 2
    for overhead, per_block in (({**OVERHEAD, "selective_dispatch_s": 150e-6}, 48 * 150e-6),
                                ({**OVERHEAD, "selective_s": 150e-6}, 28 * 150e-6)):
        added = (_step(graph, s, overhead).breakdown["recompute_s"]
                 - _step(graph, s, None).breakdown["recompute_s"])
        assert added == pytest.approx(micro_batches * 4 * per_block, rel=1e-9)


@pytest.mark.parametrize("tp", [1, 2])
def test_selective_recompute_pays_per_activation_byte(graph, tp):
    """``selective_byte_s`` per byte each block saves without recompute on its device
    (activation_bytes at the layout's tp, times the micro-batch, in fp32), on top of the
    per-operator figure; none for full recompute or no recompute."""
    from autoplan.cost.memory import activation_bytes
    from autoplan.cost.summary import summarize
    summary = summarize(graph)
    blocks = [l for l in summary.layers if l.is_block]
    # fp32 bytes: the summary's per-sequence bytes are in its own activation dtype
    nbytes = sum(activation_bytes(l, tp=tp) for l in blocks) * 2 * 4 / summary.activation_bytes
    base = {**OVERHEAD, "selective_dispatch_s": 150e-6}
    per_byte = {**base, "selective_byte_s": 1e-9}
    for recompute, expected in (("selective", 1e-9 * nbytes), ("full", 0.0), ("none", 0.0)):
        s = Strategy(dp=2 // tp, tp=tp, micro_batch=2, global_batch=16, recompute=recompute,
                     precision="fp32")
        micro_batches = 16 // (2 // tp) // 2
        added = (_step(graph, s, per_byte).breakdown["recompute_s"]
                 - _step(graph, s, base).breakdown["recompute_s"])
        assert added == pytest.approx(micro_batches * expected, rel=1e-9), recompute
    assert nbytes > 0


def test_overhead_does_not_grow_with_the_micro_batch(graph):
    """Twice the sequences per micro-batch, half the micro-batches: half the overhead."""
    def added(mb):
        s = Strategy(dp=2, micro_batch=mb, global_batch=16, precision="fp32")
        return (_step(graph, s, OVERHEAD).breakdown["compute_s"]
                - _step(graph, s, None).breakdown["compute_s"])

    assert added(4) == pytest.approx(added(2) / 2, rel=1e-9)


def _shared(cores: int | None, world: int = 4):
    """``cpu_cluster(world)`` with its ranks sharing ``cores`` cores."""
    import dataclasses

    from autoplan.hardware import NodeGroup, compose_cluster
    cluster = cpu_cluster(world)
    p = next(iter(cluster.profiles.values()))
    p = dataclasses.replace(p, node=dataclasses.replace(p.node, shared_cores=cores))
    return compose_cluster([NodeGroup(p, 1)], name=f"shared-{cores}")


def test_ranks_sharing_cores_run_faster_in_the_pipeline_bubble(graph):
    """4 ranks on 2 cores, measured all busy at once: while pipeline ranks wait in the
    bubble the others get their cores.  The pipeline's part of the step is the larger of
    the critical path at a whole core's speed (2/4 of the measured time) and the busiest
    rank's own work (which the total work over the 4 ranks, 8 x their mean, never
    exceeds)."""
    from autoplan.cost import pipeline_time
    from autoplan.strategy import Schedule

    s = Strategy(pp=4, micro_batch=1, global_batch=8, schedule="1f1b", precision="fp32")
    alone = estimate(graph, _shared(None), s, calibration=None, options=NO_OVERLAP)
    shared = estimate(graph, _shared(2), s, calibration=None, options=NO_OVERLAP)
    m = 8
    times = [st.forward_s + st.backward_s for st in alone.stages]
    t_pipe = pipeline_time(Schedule.ONE_F_ONE_B, times, m)
    expected = max(t_pipe * 2 / 4, m * max(times))
    assert m * sum(times) / 4 <= m * max(times) and expected < t_pipe
    assert alone.step_time_s - shared.step_time_s == pytest.approx(t_pipe - expected, rel=1e-9)
    assert shared.breakdown["bubble_s"] >= 0


@pytest.mark.parametrize("cores", [1, 3])
def test_without_a_pipeline_bubble_sharing_changes_nothing(graph, cores):
    """Data parallelism keeps every rank busy: the measured (all busy) figures hold."""
    dp = Strategy(dp=4, micro_batch=1, global_batch=8, precision="fp32")
    assert estimate(graph, _shared(cores), dp, calibration=None).step_time_s == \
        estimate(graph, _shared(None), dp, calibration=None).step_time_s


def test_shared_cores_round_trips_and_is_checked():
    import yaml

    from autoplan.errors import ProfileError
    from autoplan.hardware.profiles import parse_profile, profile_to_yaml
    p = next(iter(_shared(2).profiles.values()))
    assert parse_profile(yaml.safe_load(profile_to_yaml(p))).node.shared_cores == 2
    import dataclasses
    with pytest.raises(ProfileError, match="shared_cores"):
        dataclasses.replace(p.node, shared_cores=4)      # as many cores as ranks: not shared


def _arriving(arrival_s: float, cores: int | None = 2, world: int = 4):
    """``_shared(cores, world)`` whose collectives cost ``arrival_s`` more per call after
    compute (``NodeSpec.arrival_s``)."""
    import dataclasses

    from autoplan.hardware import NodeGroup, compose_cluster
    p = next(iter(_shared(cores, world).profiles.values()))
    p = dataclasses.replace(p, node=dataclasses.replace(
        p.node, arrival_s=arrival_s, arrival_source="a test's figure" if arrival_s else None))
    return compose_cluster([NodeGroup(p, 1)], name=f"arrival-{arrival_s}")


def test_a_collective_after_compute_costs_the_arrival_once_per_call():
    """Every collective call but p2p inside the node pays ``arrival_s`` once on top of its
    ring-model time, whatever its bytes and group; a group of one pays nothing."""
    base, late = _shared(2), _arriving(1.5e-3)
    for op in ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "broadcast"):
        for group, nbytes in (((0, 1), 16), ((0, 1, 2, 3), 4e6)):
            assert late.collective_time(op, group, nbytes) - base.collective_time(op, group, nbytes) \
                == pytest.approx(1.5e-3, rel=1e-9)
            assert late.collective_params(op, group).latency_s \
                == pytest.approx(base.collective_params(op, group).latency_s + 1.5e-3, rel=1e-9)
    assert late.collective_time("p2p", (0, 1), 4e6) == base.collective_time("p2p", (0, 1), 4e6)
    assert late.collective_time("all_reduce", (0,), 4e6) == 0.0


def test_the_arrival_cost_adds_to_every_collective_a_step_calls(graph):
    """The step's data-parallel collectives: DDP's gradient all-reduce (one call per
    bucket; the toy model's gradients fit one) and the loss all-reduce, each one arrival
    more, where nothing overlaps."""
    import dataclasses

    s = Strategy(dp=4, micro_batch=1, global_batch=8, precision="fp32")
    opts = dataclasses.replace(NO_OVERLAP, step_loss_all_reduce=True)
    base = estimate(graph, _arriving(0.0), s, calibration=None, options=opts)
    late = estimate(graph, _arriving(2e-3), s, calibration=None, options=opts)
    assert late.breakdown["dp_comm_s"] - base.breakdown["dp_comm_s"] \
        == pytest.approx(2 * 2e-3, rel=1e-6)
    assert late.step_time_s - base.step_time_s == pytest.approx(2 * 2e-3, rel=1e-6)


def test_the_arrival_cost_round_trips_and_is_checked():
    import dataclasses

    import yaml

    from autoplan.errors import ProfileError
    from autoplan.hardware.profiles import parse_profile, profile_to_yaml
    p = next(iter(_arriving(1.5e-3).profiles.values()))
    text = profile_to_yaml(p)
    back = parse_profile(yaml.safe_load(text)).node
    assert (back.arrival_s, back.arrival_source) == (1.5e-3, "a test's figure")
    assert "arrival" not in profile_to_yaml(next(iter(_shared(2).profiles.values())))
    with pytest.raises(ProfileError, match="arrival_source"):
        dataclasses.replace(p.node, arrival_source=None)   # a figure needs its source
    with pytest.raises(ProfileError, match="arrival_s"):
        dataclasses.replace(p.node, arrival_s=-1e-3)
    data = yaml.safe_load(text)
    del data["node"]["arrival_source"]
    with pytest.raises(ProfileError, match="arrival_source"):
        parse_profile(data)


def _with(overhead: dict | None, *, world: int = 2, cores: int | None = None,
          arrival_s: float = 0.0):
    """``cpu_cluster(world, overhead)`` with its ranks sharing ``cores`` cores and their
    collectives costing ``arrival_s`` more after compute."""
    import dataclasses

    from autoplan.hardware import NodeGroup, compose_cluster
    p = next(iter(cpu_cluster(world, overhead=overhead).profiles.values()))
    p = dataclasses.replace(p, node=dataclasses.replace(
        p.node, shared_cores=cores, arrival_s=arrival_s,
        arrival_source="a test's figure" if arrival_s else None))
    return compose_cluster([NodeGroup(p, 1)], name=f"with-{world}-{cores}-{arrival_s}")


PIPELINE = {**OVERHEAD, "pipeline_action_s": 1e-3, "pipeline_message_s": 2e-3}


@pytest.mark.parametrize("schedule,per_micro_batch", [
    # each rank's one chunk: a forward and a backward action, each across one boundary
    ("1f1b", 2 * (1e-3 + 2e-3)),
    # ZB-V: two chunks a rank, one boundary each to the other rank (the V's turn is on
    # one rank: no message), and each chunk's deferred weight backward is an action
    ("zero_bubble", 2 * (2 * 1e-3 + 2 * 2e-3) + 2 * 1e-3),
])
def test_pipeline_host_work_is_per_stage_action_and_message_end(graph, schedule,
                                                                 per_micro_batch):
    """A CPU rank's pipeline machinery (the schedule's and the stage's Python, gloo's
    transport threads) costs ``pipeline_action_s`` per stage action and
    ``pipeline_message_s`` per message it sends or receives, every micro-batch, in the
    compute of the rank."""
    v = 2 if schedule == "zero_bubble" else 1
    s = Strategy(pp=2, micro_batch=1, global_batch=8, schedule=schedule, virtual_stages=v,
                 precision="fp32")
    base = estimate(graph, _with(OVERHEAD), s, calibration=None, options=NO_AUTOCAST)
    piped = estimate(graph, _with(PIPELINE), s, calibration=None, options=NO_AUTOCAST)
    m = 8
    added = piped.breakdown["compute_s"] - base.breakdown["compute_s"]
    assert added == pytest.approx(m * per_micro_batch, rel=1e-9)
    assert piped.step_time_s > base.step_time_s + m * per_micro_batch * 0.99
    # without a pipeline there is no stage action
    dp = Strategy(dp=2, micro_batch=1, global_batch=8, precision="fp32")
    assert (estimate(graph, _with(PIPELINE), dp, calibration=None).to_dict()
            == estimate(graph, _with(OVERHEAD), dp, calibration=None).to_dict())


def test_pipeline_host_figures_round_trip():
    import yaml

    from autoplan.hardware.profiles import parse_profile, profile_to_yaml
    p = next(iter(_with({**PIPELINE, "zero_bubble_node_s": 5e-6}).profiles.values()))
    o = parse_profile(yaml.safe_load(profile_to_yaml(p))).device.op_overhead
    assert (o.pipeline_action_s, o.pipeline_message_s, o.zero_bubble_node_s) == (1e-3, 2e-3, 5e-6)
    # a profile measured before them states none of them, and reads 0
    old = profile_to_yaml(next(iter(_with(OVERHEAD).profiles.values())))
    assert "pipeline" not in old and "zero_bubble" not in old
    o = parse_profile(yaml.safe_load(old)).device.op_overhead
    assert (o.pipeline_action_s, o.pipeline_message_s, o.zero_bubble_node_s) == (0, 0, 0)


def test_tensor_parallel_collectives_take_no_arrival_where_the_linears_host_time_holds_it(
        graph):
    """Where the profile prices each tensor-parallel linear's host time (measured with its
    collectives on pairs of ranks, their waits in it), the link model's arrival cost is not
    added to the tensor-parallel collectives again; the data-parallel ones still pay it.
    Without that figure every collective pays it."""
    import dataclasses

    opts = dataclasses.replace(NO_AUTOCAST, step_loss_all_reduce=False)
    s = Strategy(dp=2, tp=2, micro_batch=2, global_batch=8, precision="fp32")
    for overhead, tp_pays in ((OVERHEAD, False), (None, True)):
        base = estimate(graph, _with(overhead, world=4, cores=2), s, calibration=None,
                        options=opts)
        late = estimate(graph, _with(overhead, world=4, cores=2, arrival_s=2e-3), s,
                        calibration=None, options=opts)
        tp_extra = late.breakdown["tp_comm_s"] - base.breakdown["tp_comm_s"]
        assert (tp_extra > 0) is tp_pays, (overhead, tp_extra)
        assert late.breakdown["dp_comm_s"] > base.breakdown["dp_comm_s"]


def test_a_zero_bubble_split_backward_costs_its_measured_host_time_per_autograd_node(graph):
    """torch's zero-bubble schedules split each backward (input gradients, then the
    weights'): ``zero_bubble_node_s`` per autograd node of the rank's layers, every
    micro-batch; other schedules do not pay it."""
    z = 5e-6
    split = {**PIPELINE, "zero_bubble_node_s": z}
    m = 8
    s = Strategy(pp=2, micro_batch=1, global_batch=m, schedule="zero_bubble", virtual_stages=2,
                 precision="fp32")
    base = estimate(graph, _with(PIPELINE), s, calibration=None, options=NO_AUTOCAST)
    est = estimate(graph, _with(split), s, calibration=None, options=NO_AUTOCAST)
    added = est.breakdown["compute_s"] - base.breakdown["compute_s"]
    # the busiest rank's share of the model's autograd nodes, every micro-batch
    n = added / (m * z)
    total = sum(layer.autograd_nodes for layer in graph.layers)
    block = max(layer.autograd_nodes for layer in graph.layers)
    assert n == pytest.approx(round(n), abs=1e-6) and block <= n < total, (n, total)
    one = Strategy(pp=2, micro_batch=1, global_batch=m, schedule="1f1b", precision="fp32")
    assert (estimate(graph, _with(split), one, calibration=None).to_dict()
            == estimate(graph, _with(PIPELINE), one, calibration=None).to_dict())


@pytest.mark.parametrize("sp", [False, True])
def test_tensor_parallel_collectives_pay_their_host_work_per_byte(graph, sp):
    """``tp_collective_byte_s`` per byte of every tensor-parallel collective's payload (the
    full tensor, each micro-batch, forward and backward): a dp2 tp2 step of 2 micro-batches
    of 2 sequences pays it on the bytes the capture records, with or without sequence
    parallelism (its all-gathers and reduce-scatters); the rest of the step is unchanged."""
    import dataclasses

    from autoplan.cost.summary import summarize

    per_byte = 3e-9
    opts = dataclasses.replace(NO_AUTOCAST, step_loss_all_reduce=False)
    s = Strategy(dp=2, tp=2, micro_batch=2, global_batch=8, precision="fp32",
                 sequence_parallel=sp)
    base = estimate(graph, _with(OVERHEAD, world=4, cores=2), s, calibration=None,
                    options=opts)
    paid = estimate(graph, _with({**OVERHEAD, "tp_collective_byte_s": per_byte}, world=4,
                                 cores=2), s, calibration=None, options=opts)
    summary = summarize(graph)   # bytes per sequence in its activation dtype: fp32 is 4
    payload = 4 / summary.activation_bytes * sum(
        nbytes for layer in summary.layers
        for _, _, nbytes in (layer.sp_collectives if sp else layer.tp_collectives))
    micro_batches, b = 2, 2
    assert payload > 0
    extra = paid.breakdown["tp_comm_s"] - base.breakdown["tp_comm_s"]
    assert extra == pytest.approx(micro_batches * b * payload * per_byte, rel=1e-9)
    others = {k: v for k, v in paid.breakdown.items() if k != "tp_comm_s"}
    assert others == pytest.approx({k: v for k, v in base.breakdown.items()
                                    if k != "tp_comm_s"})


def test_the_per_byte_figure_round_trips_and_older_profiles_read_zero():
    import yaml

    from autoplan.hardware.profiles import parse_profile, profile_to_yaml
    p = next(iter(_with({**OVERHEAD, "tp_collective_byte_s": 2e-9}).profiles.values()))
    text = profile_to_yaml(p)
    assert parse_profile(yaml.safe_load(text)).device.op_overhead.tp_collective_byte_s == 2e-9
    old = profile_to_yaml(next(iter(_with(OVERHEAD).profiles.values())))
    assert "tp_collective_byte" not in old
    assert parse_profile(yaml.safe_load(old)).device.op_overhead.tp_collective_byte_s == 0
    bad = yaml.safe_load(text)
    bad["device"]["op_overhead"]["tp_collective_byte_s"] = -1
    from autoplan.errors import AutoplanError
    with pytest.raises(AutoplanError, match="tp_collective_byte"):
        parse_profile(bad)


SCALES = {"layer_forward_scale": 1.2, "layer_backward_scale": 1.1}


@pytest.mark.parametrize("tp", [1, 2])
def test_layer_scales_multiply_a_layers_parts(graph, tp):
    """A profile's layer scales (a reference stack timed whole over its parts as priced)
    multiply each layer's compute and host time, forward and backward; the tensor-parallel
    linears' DTensor work is measured apart and added unscaled."""
    from autoplan.cost.engine import CostEngine
    times = {}
    for name, overhead in (("plain", OVERHEAD), ("scaled", {**OVERHEAD, **SCALES})):
        engine = CostEngine(graph, cpu_cluster(2, overhead=overhead), calibration=None)
        device = engine.device_of((0,))
        times[name] = engine.template_time("blocks.0", 2, tp, 1, device, "fp32")
    plain, scaled = times["plain"], times["scaled"]
    tp_fwd, tp_bwd = (4 * 300e-6, 4 * 700e-6) if tp > 1 else (0.0, 0.0)
    assert scaled.forward_s - tp_fwd == pytest.approx(1.2 * (plain.forward_s - tp_fwd), rel=1e-12)
    assert scaled.backward_s - tp_bwd == pytest.approx(1.1 * (plain.backward_s - tp_bwd),
                                                       rel=1e-12)
    assert scaled.core_forward_s == pytest.approx(1.2 * plain.core_forward_s, rel=1e-12)


HOST_SCALES = {"host_forward_scale": 2.0, "host_backward_scale": 2.5}


def test_host_scales_multiply_a_layers_host_work_apart(graph):
    """With host scales (the reference blocks timed at two micro-batches), a layer's host
    work is multiplied by them and the rest by the layer scales; both or neither, each a
    positive ratio, and they survive a YAML round trip."""
    import yaml

    from autoplan.cost.engine import CostEngine, _host_s
    from autoplan.errors import ProfileError
    from autoplan.hardware import OpOverhead
    from autoplan.hardware.profile_yaml import parse_profile, profile_to_yaml
    times = {}
    for name, overhead in (("plain", OVERHEAD), ("split", {**OVERHEAD, **SCALES, **HOST_SCALES})):
        engine = CostEngine(graph, cpu_cluster(2, overhead=overhead), calibration=None)
        device = engine.device_of((0,))
        times[name] = engine.template_time("blocks.0", 2, 1, 1, device, "fp32")
    host_fwd, host_bwd = _host_s(device.op_overhead, engine._templates["blocks.0"],
                                 engine.summary.op_counts["blocks.0"][0], engine._host_counted)
    plain, split = times["plain"], times["split"]
    assert 0 < host_fwd < plain.forward_s and 0 < host_bwd < plain.backward_s
    assert split.forward_s == pytest.approx(1.2 * (plain.forward_s - host_fwd) + 2.0 * host_fwd,
                                            rel=1e-12)
    assert split.backward_s == pytest.approx(1.1 * (plain.backward_s - host_bwd)
                                             + 2.5 * host_bwd, rel=1e-12)
    base = dict(forward_s=0.0, backward_s=0.0, tp_linear_forward_s=0.0,
                tp_linear_backward_s=0.0, source="x")
    with pytest.raises(ProfileError, match="both host scales"):
        OpOverhead(**base, host_forward_scale=2.0)
    with pytest.raises(ProfileError, match="host_backward_scale"):
        OpOverhead(**base, host_forward_scale=2.0, host_backward_scale=-1.0)
    p = next(iter(_with({**OVERHEAD, **SCALES, **HOST_SCALES}).profiles.values()))
    o = parse_profile(yaml.safe_load(profile_to_yaml(p))).device.op_overhead
    assert (o.host_forward_scale, o.host_backward_scale) == (2.0, 2.5)


def test_layer_scales_come_in_pairs_and_round_trip():
    """Both layer scales or neither, each a positive ratio (clear ProfileErrors); they
    survive a YAML round trip, and a profile without them writes none."""
    import yaml

    from autoplan.errors import ProfileError
    from autoplan.hardware import OpOverhead
    from autoplan.hardware.profile_yaml import parse_profile, profile_to_yaml
    base = dict(forward_s=0.0, backward_s=0.0, tp_linear_forward_s=0.0,
                tp_linear_backward_s=0.0, source="x")
    with pytest.raises(ProfileError, match="both layer scales"):
        OpOverhead(**base, layer_forward_scale=1.2)
    with pytest.raises(ProfileError, match="layer_backward_scale"):
        OpOverhead(**base, layer_forward_scale=1.2, layer_backward_scale=0.0)
    p = next(iter(_with({**OVERHEAD, **SCALES}).profiles.values()))
    o = parse_profile(yaml.safe_load(profile_to_yaml(p))).device.op_overhead
    assert (o.layer_forward_scale, o.layer_backward_scale) == (1.2, 1.1)
    p = next(iter(_with(OVERHEAD).profiles.values()))
    assert parse_profile(yaml.safe_load(profile_to_yaml(p))).device.op_overhead \
        .layer_forward_scale is None


def test_a_cpu_ranks_sends_cost_their_measured_host_work_not_a_transfer(graph):
    """Where the profile measured a pipeline message's host work on CPU ranks (gloo's
    transport threads, ``pipeline_message_s``), a send costs that and no transfer time:
    gloo's isend returns at once.  Without the figure (and on a GPU) a send is priced as
    the point-to-point link's time."""
    s = Strategy(pp=2, micro_batch=1, global_batch=8, schedule="1f1b", precision="fp32")
    base = estimate(graph, _with(OVERHEAD), s, calibration=None, options=NO_AUTOCAST)
    piped = estimate(graph, _with(PIPELINE), s, calibration=None, options=NO_AUTOCAST)
    assert base.breakdown["pp_comm_s"] > 0
    assert piped.breakdown["pp_comm_s"] == piped.comm_total["pp_comm_s"] == 0.0
    # each stage's micro-batch gained the host work (a forward and a backward action, each
    # across one boundary) less the one send it no longer pays for
    host = 2 * (1e-3 + 2e-3)
    assert piped.breakdown["compute_s"] - base.breakdown["compute_s"] == pytest.approx(
        8 * host, rel=1e-9)
    send = base.breakdown["pp_comm_s"] / 8
    for b, p in zip(base.stages, piped.stages):
        assert p.forward_s + p.backward_s == pytest.approx(
            b.forward_s + b.backward_s + host - send, rel=1e-9)
    gpu = estimate(graph, load_cluster("a100-sxm4-80gb"), dataclasses.replace(s, dp=4),
                   calibration=None, options=NO_AUTOCAST)
    assert gpu.breakdown["pp_comm_s"] > 0


def test_a_reduction_hidden_under_another_stages_backward_still_takes_its_cores(graph):
    """4 ranks on 2 cores, 2 stages x 2 replicas: the last stage finishes its backward
    first and reduces its gradients while the first stage's backward runs.  That is
    hidden from the step's critical path, not from the cores: the first stage computes at
    the every-rank-busy speed instead of a whole core each for as long as the reduction
    runs, so the step pays the hidden seconds times 1 - 2/4 (in ``dp_comm_s``).  On ranks
    that do not share cores it is free."""
    s = Strategy(dp=2, pp=2, micro_batch=4, global_batch=8, schedule="gpipe",
                 precision="fp32")
    opts = dataclasses.replace(NO_AUTOCAST, step_loss_all_reduce=False)
    alone = estimate(graph, _with(OVERHEAD, world=4), s, calibration=None, options=opts)
    shared = estimate(graph, _with(OVERHEAD, world=4, cores=2), s, calibration=None,
                      options=opts)
    first, last = shared.stages
    hidden = min(last.dp_comm_exposed_s, first.backward_s)
    assert hidden > 0
    assert (shared.breakdown["dp_comm_s"] - alone.breakdown["dp_comm_s"]
            == pytest.approx(hidden * (1 - 2 / 4), rel=1e-9))
    assert sum(shared.breakdown.values()) == pytest.approx(shared.step_time_s, rel=1e-9)


FSDP = {"fsdp_gather_call_s": 1e-3, "fsdp_gather_byte_s": 2e-9,
        "fsdp_reduce_call_s": 3e-3, "fsdp_reduce_byte_s": 4e-9}
REPLICATE = {"replicate_call_s": 5e-3, "replicate_byte_s": 6e-9}
CP_WAITS = {"cp_gather_call_s": 1e-3, "cp_gather_byte_s": 2e-9,
            "cp_scatter_call_s": 3e-3, "cp_scatter_byte_s": 4e-9}


@pytest.mark.parametrize("zero", [1, 2, 3])
def test_fsdp2_work_beyond_its_collectives_is_per_call_and_byte(graph, zero):
    """Where a CPU profile measured FSDP2's work around its collectives
    (``OpOverhead.fsdp_*``), each ZeRO-2/3 layer pays it for every per-micro-batch
    collective, per call and per byte of the layer's parameters (fp32: 4 bytes each):
    ZeRO-3 gathers in the forward and again in the backward and reduce-scatters, ZeRO-2
    reduce-scatters.  The once-a-step collectives pay it too, per wrapped unit (each
    block, and the other layers together): ZeRO-1 reduce-scatters and gathers, ZeRO-2
    gathers.  In their place it no longer pays the buffer copies (``zero_buffer_copies``)."""
    s = Strategy(dp=2, micro_batch=1, global_batch=4, zero=zero, precision="fp32")
    opts = dataclasses.replace(NO_AUTOCAST, zero_buffer_copies=False)
    base = estimate(graph, _with(OVERHEAD), s, calibration=None, options=opts)
    host = estimate(graph, _with({**OVERHEAD, **FSDP}), s, calibration=None, options=opts)
    layers = [l for l in summarize(graph).layers if l.params]

    def reduce(params: float) -> float:
        return FSDP["fsdp_reduce_call_s"] + 4 * params * FSDP["fsdp_reduce_byte_s"]

    def gather(params: float) -> float:
        return FSDP["fsdp_gather_call_s"] + 4 * params * FSDP["fsdp_gather_byte_s"]
    per_mb = sum(reduce(l.params) for l in layers) if zero >= 2 else 0.0
    if zero == 3:
        per_mb += 2 * sum(gather(l.params) for l in layers)
    units = [l.params for l in layers if l.is_block] + [
        sum(l.params for l in layers if not l.is_block)]
    per_step = {1: sum(reduce(n) + gather(n) for n in units),
                2: sum(gather(n) for n in units), 3: 0.0}[zero]
    extra = 2 * per_mb + per_step        # two micro-batches a replica
    assert host.breakdown["dp_comm_s"] - base.breakdown["dp_comm_s"] == pytest.approx(
        extra, rel=1e-9, abs=1e-15)
    assert host.step_time_s - base.step_time_s == pytest.approx(extra, rel=1e-9, abs=1e-15)
    if zero == 3:
        # the buffer copies it replaces
        copies = estimate(graph, _with(OVERHEAD), s, calibration=None, options=NO_AUTOCAST)
        measured = estimate(graph, _with({**OVERHEAD, **FSDP}), s, calibration=None,
                            options=NO_AUTOCAST)
        assert copies.step_time_s > base.step_time_s
        assert measured.step_time_s == pytest.approx(host.step_time_s, rel=1e-12)




def _replicate_figures(graph, s: Strategy, cluster_of, opts=NO_AUTOCAST):
    """(without the figures, with them) for ``s`` on ``cluster_of(overhead)``."""
    base = estimate(graph, cluster_of({**OVERHEAD, **FSDP}), s, calibration=None, options=opts)
    host = estimate(graph, cluster_of({**OVERHEAD, **FSDP, **REPLICATE}), s, calibration=None,
                    options=opts)
    return base, host


def test_replicate_work_beyond_its_all_reduce_is_per_call_and_byte(graph):
    """Where a CPU profile measured FSDP2's ``replicate`` around its all-reduce
    (``OpOverhead.replicate_*``), a layout that runs it (ZeRO-0 with tensor or context
    parallelism) pays it once a step: one call and the rank's gradient bytes, in place of
    the buffer copies, whichever ``zero_buffer_copies`` says.  DDP (ZeRO-0 without them)
    does not run it: its layouts price as without the figures."""
    from autoplan.cost.engine import _local_params
    s = Strategy(dp=2, tp=2, micro_batch=1, global_batch=4, precision="fp32")
    opts = dataclasses.replace(NO_AUTOCAST, zero_buffer_copies=False)
    base, host = _replicate_figures(graph, s, lambda o: _with(o, world=4), opts)
    params = sum(_local_params(l, 2, 1)[0] for l in summarize(graph).layers)
    extra = REPLICATE["replicate_call_s"] + 4 * params * REPLICATE["replicate_byte_s"]
    assert host.breakdown["dp_comm_s"] - base.breakdown["dp_comm_s"] == pytest.approx(
        extra, rel=1e-9)
    assert host.step_time_s - base.step_time_s == pytest.approx(extra, rel=1e-9)
    copies, measured = _replicate_figures(graph, s, lambda o: _with(o, world=4))
    assert copies.step_time_s > base.step_time_s
    assert measured.step_time_s == pytest.approx(host.step_time_s, rel=1e-12)
    ddp = Strategy(dp=2, micro_batch=1, global_batch=4, precision="fp32")
    plain, carried = _replicate_figures(graph, ddp, _with)
    assert carried.step_time_s == plain.step_time_s


def test_a_pipeline_on_shared_cores_prices_fsdp2s_once_a_step_work_as_before(graph):
    """4 ranks on 2 cores, 2 stages x 2 replicas: the step ends with the other stage's
    ranks idle, faster than the every-rank-busy figures; replicate's and fully_shard's
    once-a-step work keep the buffer copies there.  With a core each the figures apply."""
    for zero in (0, 1):
        s = Strategy(dp=2, pp=2, micro_batch=4, global_batch=8, schedule="gpipe", zero=zero,
                     precision="fp32")
        shared = _replicate_figures(graph, s, lambda o: _with(o, world=4, cores=2))
        assert shared[1].step_time_s == shared[0].step_time_s
        without = estimate(graph, _with(OVERHEAD, world=4, cores=2), s, calibration=None,
                           options=NO_AUTOCAST)
        assert shared[0].step_time_s == pytest.approx(without.step_time_s, rel=1e-12)
        alone = _replicate_figures(graph, s, lambda o: _with(o, world=4))
        if zero == 0:
            assert alone[1].step_time_s > alone[0].step_time_s
        else:
            own = estimate(graph, _with(OVERHEAD, world=4), s, calibration=None,
                           options=NO_AUTOCAST)
            assert alone[0].step_time_s > own.step_time_s


@pytest.mark.parametrize("figures, measured, seconds, strategy", [
    (FSDP, "fsdp_measured", "fsdp_gather_s",
     Strategy(dp=8, micro_batch=1, global_batch=16, zero=3, precision="bf16")),
    (REPLICATE, "replicate_measured", "replicate_s",
     Strategy(dp=4, tp=2, micro_batch=1, global_batch=16, precision="bf16")),
    (CP_WAITS, "cp_measured", "cp_collectives_s",
     Strategy(dp=4, cp=2, micro_batch=1, global_batch=16, precision="bf16"))],
    ids=["fsdp", "replicate", "cp"])
def test_fsdp2_figures_round_trip_and_a_gpu_ignores_them(graph, figures, measured, seconds,
                                                          strategy):
    """FSDP2's figures (``fully_shard``'s four, ``replicate``'s two) and context
    parallelism's in a step survive the profile's YAML (absent from a profile without
    them, which reads 0) and are checked; a GPU's FSDP2 copies run on its streams, priced
    by its memory bandwidth, and its host does not take turns with other ranks on cores,
    so a GPU profile that carried them would price as without."""
    import yaml

    from autoplan.errors import AutoplanError
    from autoplan.hardware import NodeGroup, OpOverhead, compose_cluster
    from autoplan.hardware.profiles import parse_profile, profile_to_yaml
    p = next(iter(_with({**OVERHEAD, **figures}).profiles.values()))
    back = parse_profile(yaml.safe_load(profile_to_yaml(p))).device.op_overhead
    assert {k: getattr(back, k) for k in figures} == figures and getattr(back, measured)
    old = parse_profile(yaml.safe_load(profile_to_yaml(
        next(iter(_with(OVERHEAD).profiles.values()))))).device.op_overhead
    assert not getattr(old, measured) and getattr(old, seconds)(1e6) in (0.0, (0.0, 0.0))
    bad = yaml.safe_load(profile_to_yaml(p))
    key = list(figures)[-1]
    bad["device"]["op_overhead"][key] = -1
    with pytest.raises(AutoplanError, match=key[:-2]):
        parse_profile(bad)
    gpu = next(iter(load_cluster("a100-sxm4-80gb").profiles.values()))
    none = OpOverhead(forward_s=0.0, backward_s=0.0, tp_linear_forward_s=0.0,
                      tp_linear_backward_s=0.0, source="a test")

    def step(overhead: OpOverhead, name: str):
        device = dataclasses.replace(gpu.device, op_overhead=overhead)
        cluster = compose_cluster([NodeGroup(dataclasses.replace(gpu, device=device), 1)],
                                  name=name)
        return estimate(graph, cluster, strategy, calibration=None)
    assert (step(dataclasses.replace(none, **figures), f"gpu-{measured}").step_time_s
            == step(none, "gpu-plain").step_time_s)


def test_a_tied_copy_keeps_its_buffer_copies_beside_fsdp2s_figures():
    """A pipeline's tied embedding copy (kept whole, ZeRO-0, beside ZeRO-1 layers) is not
    in FSDP2's measured figures: it keeps ``zero_buffer_copies``' copies (4 bytes moved a
    gradient byte) where the figures price the sharded layers' once-a-step work."""
    tied = trace(GPT(dataclasses.replace(CONFIG, tie_embeddings=True)), seq_len=CONFIG.seq_len)
    s = Strategy(dp=2, pp=2, micro_batch=1, global_batch=4, zero=1, precision="fp32")
    cluster = _with({**OVERHEAD, **FSDP}, world=4)
    copies = estimate(tied, cluster, s, calibration=None, options=NO_AUTOCAST)
    none = estimate(tied, cluster, s, calibration=None,
                    options=dataclasses.replace(NO_AUTOCAST, zero_buffer_copies=False))
    tied_params = max(l.tied_params for l in summarize(tied).layers)
    assert tied_params > 0
    bw = next(iter(cluster.profiles.values())).device.memory_bw_bytes_per_s
    extra = sorted(c.dp_comm_exposed_s - n.dp_comm_exposed_s
                   for c, n in zip(copies.stages, none.stages))
    assert extra[0] == pytest.approx(0.0, abs=1e-15)     # the stage without a tied copy
    assert extra[-1] == pytest.approx(4 * tied_params * 4 / bw, rel=1e-9)


def test_a_shared_core_pipelines_collective_waits_do_not_speed_up(graph):
    """4 ranks on 2 cores, a tp2 pp2 pipeline of one micro-batch: while one stage works the
    other's ranks wait, and the working ranks' compute runs at a whole core's speed (twice
    the every-rank-busy figures), but not their tensor-parallel collectives' waits: the
    critical path is the stages' forward + backward times (1/2 + 1/2 x the critical
    stage's exposed tensor-parallel share), unless one stage's work at the speed of the
    ranks that run at once (one stage's two, a core each: 1/2) is longer.  Without tensor
    parallelism the whole path speeds up."""
    opts = dataclasses.replace(NO_AUTOCAST, step_loss_all_reduce=False)
    for tp in (1, 2):
        s = Strategy(tp=tp, pp=2, dp=2 // tp, micro_batch=4 // (2 // tp), global_batch=4,
                     schedule="gpipe", precision="fp32")
        e = estimate(graph, _with(OVERHEAD, world=4, cores=2), s, calibration=None,
                     options=opts)
        per_mb = [st.forward_s + st.backward_s for st in e.stages]
        crit = max(range(2), key=lambda p: per_mb[p])
        share = e.breakdown["tp_comm_s"] / per_mb[crit]
        assert (share > 0) == (tp == 2)
        expected = max(sum(per_mb) * (0.5 + 0.5 * share), per_mb[crit] / 2)
        assert e.breakdown["bubble_s"] + per_mb[crit] == pytest.approx(expected, rel=1e-9)


@pytest.mark.parametrize("m", [1, 2, 3, 4, 8])
def test_fewer_micro_batches_than_stages_run_fewer_ranks_at_once(graph, m):
    """4 ranks on 2 cores, 4 stages of one rank each: with m micro-batches only min(m, 4)
    stages ever run at once, so the busiest rank's work bounds the pipeline at the speed
    of that many ranks on the 2 cores (a whole core each while they are no more than the
    cores: 2/4 of the every-rank-busy figure for m <= 2, 3/4 for m = 3, all of it from
    m = 4); the critical path at a whole core's speed bounds it too."""
    from autoplan.cost import pipeline_time
    from autoplan.strategy import Schedule

    s = Strategy(pp=4, micro_batch=1, global_batch=m, schedule="gpipe", precision="fp32")
    alone = estimate(graph, _shared(None), s, calibration=None, options=NO_OVERLAP)
    shared = estimate(graph, _shared(2), s, calibration=None, options=NO_OVERLAP)
    times = [st.forward_s + st.backward_s for st in alone.stages]
    t_pipe = pipeline_time(Schedule.GPIPE, times, m)
    speed = max(2, min(m, 4)) / 4
    expected = max(t_pipe * 2 / 4, m * max(times) * speed)
    assert alone.step_time_s - shared.step_time_s == pytest.approx(t_pipe - expected, rel=1e-9)


def _cp_waits(graph, s: Strategy, **cluster) -> tuple:
    """(without the figures, with them, one block's waits per micro-batch, the bytes of
    keys and values it gathers) for ``s``."""
    from autoplan.cost.api import engine_for
    base = estimate(graph, _with(OVERHEAD, **cluster), s, calibration=None,
                    options=NO_AUTOCAST)
    host = estimate(graph, _with({**OVERHEAD, **CP_WAITS}, **cluster), s, calibration=None,
                    options=NO_AUTOCAST)
    summary = summarize(graph)
    scale = engine_for(graph, _with(OVERHEAD, **cluster), options=NO_AUTOCAST,
                       calibration=None).precision_costs(s.precision).activation_scale
    kv = summary.kv_bytes_per_token * scale * summary.seq_len * s.micro_batch / s.tp
    block = (CP_WAITS["cp_gather_call_s"] + kv * CP_WAITS["cp_gather_byte_s"]
             + CP_WAITS["cp_scatter_call_s"] + kv * CP_WAITS["cp_scatter_byte_s"])
    return base, host, block, kv


def test_context_parallel_pairs_wait_for_turns_on_shared_cores(graph):
    """Where a CPU profile measured context parallelism's collectives in a step
    (``OpOverhead.cp_*``), each block's all-gather and reduce-scatter pay them per call
    and per byte of the keys and values gathered, on groups that leave other ranks of
    the node computing; a group of every rank of the node pays none (none computes
    meanwhile)."""
    blocks = CONFIG.layers
    s = Strategy(dp=2, cp=2, micro_batch=2, global_batch=8, precision="fp32")
    base, host, block, kv = _cp_waits(graph, s, world=4, cores=2)
    extra = 2 * blocks * block            # two micro-batches a replica
    assert host.breakdown["cp_comm_s"] - base.breakdown["cp_comm_s"] == pytest.approx(
        extra, rel=1e-9)
    assert host.step_time_s - base.step_time_s == pytest.approx(extra, rel=1e-9)
    whole = Strategy(cp=4, micro_batch=4, global_batch=8, precision="fp32")
    base, host, *_ = _cp_waits(graph, whole, world=4, cores=2)
    assert host.step_time_s == base.step_time_s
    # full recompute gathers again in the backward, and waits again
    rc = Strategy(dp=2, cp=2, micro_batch=2, global_batch=8, precision="fp32",
                  recompute="full")
    base, host, *_ = _cp_waits(graph, rc, world=4, cores=2)
    gather = CP_WAITS["cp_gather_call_s"] + kv * CP_WAITS["cp_gather_byte_s"]
    assert host.breakdown["cp_comm_s"] - base.breakdown["cp_comm_s"] == pytest.approx(
        2 * blocks * (block + gather), rel=1e-9)


def test_a_pipeline_on_shared_cores_waits_for_turns_only_while_others_compute(graph):
    """4 ranks on 2 cores, 2 stages of a cp pair, one micro-batch: while a stage runs
    the other idles, and its pair has the cores to itself; the waits are not on the
    critical path there, only in the busiest rank's work (the pipeline's other bound):
    the step grows by one stage's waits at most, where on the critical path both stages'
    would add, at the every-rank-busy share of the time or more."""
    s = Strategy(pp=2, cp=2, micro_batch=8, global_batch=8, schedule="gpipe",
                 precision="fp32")
    base, host, block, _ = _cp_waits(graph, s, world=4, cores=2)
    per_stage = CONFIG.layers // 2 * block
    assert host.breakdown["cp_comm_s"] - base.breakdown["cp_comm_s"] > 0
    assert 0 < host.step_time_s - base.step_time_s <= per_stage * (1 + 1e-9)
