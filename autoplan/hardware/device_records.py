"""Device records: what one accelerator (or CPU) computes and how fast.

The dtypes and architectures a profile may name, a matmul efficiency table, the host time
per operator, memory-bound operators' measured rates and :class:`DeviceType`, which holds
them; every field name carries its SI unit.  Nodes, networks and composite clusters are
:mod:`.profile_records`, which re-exports all of these.
"""

from __future__ import annotations

import bisect
import math
from dataclasses import dataclass

from ..errors import ConfigError, ProfileError
from ..records import Record

__all__ = ["DTYPES", "VARIANT_TABLES", "DTYPE_FALLBACK", "ARCHITECTURES", "cuda_architecture",
           "EfficiencyTable", "OpOverhead", "DeviceType", "ELEMENTWISE_KINDS", "LAYOUT_KINDS",
           "RATE_KINDS", "ElementwiseRates", "elementwise_kind"]

#: Numeric formats a device may list a peak for.
DTYPES: tuple[str, ...] = ("fp64", "fp32", "tf32", "bf16", "fp16", "fp8")

#: Efficiency tables a device may hold beside its dtypes', against the peak of another:
#: ``fp8_rowwise``, FP8 GEMMs with one scale a row (torchao's rowwise recipe), against the
#: ``fp8`` peak (``autoplan profile`` measures it where the GPU has FP8 matmuls).
VARIANT_TABLES: dict[str, str] = {"fp8_rowwise": "fp8"}

#: What a matmul in one dtype runs as on a device that lacks it: TF32 mode on a
#: device without TF32 units (V100, CPU) computes in FP32; a device without BF16
#: units (V100) trains in FP16 instead.
DTYPE_FALLBACK: dict[str, str] = {"tf32": "fp32", "bf16": "fp16"}

#: Device architectures a profile may name (:attr:`DeviceType.architecture`): NVIDIA GPU
#: generations, keyed by CUDA compute capability major version in :func:`cuda_architecture`,
#: and ``"cpu"`` for profiles measured on CPU ranks.
ARCHITECTURES: tuple[str, ...] = ("volta", "ampere", "hopper", "blackwell", "cpu")
_CUDA_MAJOR = {7: "volta", 8: "ampere", 9: "hopper", 10: "blackwell", 12: "blackwell"}


def cuda_architecture(major: int, minor: int = 0) -> str:
    """The architecture of a CUDA device of compute capability ``major.minor``.

    7.0 Volta (7.5 Turing is listed as Volta: same tensor-core generation for
    FP16), 8.x Ampere (8.9 Ada is listed as Ampere), 9.0 Hopper, 10.x/12.x
    Blackwell (CUDA C Programming Guide, "Compute Capabilities"); ``""`` otherwise.

    >>> cuda_architecture(9, 0), cuda_architecture(8, 6), cuda_architecture(3, 5)
    ('hopper', 'ampere', '')
    """
    return _CUDA_MAJOR.get(int(major), "")


_DEFAULT_TABLE_KEY = "default"


def _require(ok: bool, field_name: str, message: str) -> None:
    """Raise the error a record constructor gives for an impossible value."""
    if not ok:
        exc = ProfileError(message, path=field_name)
        exc.detail = message  # type: ignore[attr-defined]  # the message without the path
        raise exc


def _text(value: object) -> bool:
    """A non-empty string (a name, a site, a source)."""
    return isinstance(value, str) and bool(value.strip())


def _finite_positive(value: float) -> bool:
    return isinstance(value, (int, float)) and math.isfinite(value) and value > 0


def _finite_nonnegative(value: float) -> bool:
    return isinstance(value, (int, float)) and math.isfinite(value) and value >= 0


def _is_fraction(value: float) -> bool:
    return _finite_positive(value) and value <= 1


@dataclass(frozen=True)
class EfficiencyTable(Record):
    """Achievable fraction of peak FLOP/s as a function of matmul size.

    Parameters
    ----------
    points : tuple of (float, float)
        ``(flops, efficiency)`` pairs: FLOPs of one matmul (``2*m*n*k``),
        strictly increasing, and the achieved fraction of peak in (0, 1].
    source : str
        Where the points come from (measurement, fit, estimate).

    Examples
    --------
    >>> t = EfficiencyTable(((1e9, 0.2), (1e11, 0.8)), source="example")
    >>> t.efficiency(1e10)  # halfway in log-size
    0.5
    >>> t.efficiency(1e6), t.efficiency(1e14)  # clamped at the ends
    (0.2, 0.8)
    """

    points: tuple[tuple[float, float], ...]
    source: str

    def __post_init__(self) -> None:
        _require(len(self.points) >= 1, "points", "expected at least one (flops, efficiency) point")
        for i, (flops, eff) in enumerate(self.points):
            _require(_finite_positive(flops), f"points[{i}][0]",
                     f"expected matmul FLOPs > 0, got {flops!r}")
            _require(_is_fraction(eff), f"points[{i}][1]",
                     f"expected an efficiency in (0, 1], got {eff!r}")
            if i:
                _require(flops > self.points[i - 1][0], f"points[{i}][0]",
                         f"expected FLOPs strictly increasing, got {flops!r} after "
                         f"{self.points[i - 1][0]!r}")
        _require(_text(self.source), "source", "expected a non-empty source")

    def efficiency(self, flops: float) -> float:
        """Efficiency at ``flops`` FLOPs per matmul: linear in log10(flops), clamped."""
        if not _finite_positive(flops):
            raise ConfigError(f"matmul FLOPs must be a finite number > 0, got {flops!r}")
        xs = [p[0] for p in self.points]
        i = bisect.bisect_left(xs, flops)
        if i == 0:
            return self.points[0][1]
        if i == len(xs):
            return self.points[-1][1]
        (x0, y0), (x1, y1) = self.points[i - 1], self.points[i]
        w = (math.log10(flops) - math.log10(x0)) / (math.log10(x1) - math.log10(x0))
        return y0 + w * (y1 - y0)


@dataclass(frozen=True)
class OpOverhead(Record):
    """Host time per operator that adds to a device's work: the cost of dispatching it.

    On a CPU the host *is* the device, so every operator of an eager PyTorch step pays
    the dispatcher, autograd and Python time before its own arithmetic; for a small model
    that is a large part of the step.  On a GPU the host enqueues kernels ahead of the
    device and this time is hidden, so GPU profiles leave it out (``None``).

    Parameters
    ----------
    forward_dispatch_s : float
        Seconds per operator a layer's forward dispatches
        (:attr:`~autoplan.graph.LayerRecord.dispatched_ops`: ``linear`` arrives as ``t`` +
        ``addmm``; views and allocations count), the module calls and Python between them
        included.
    backward_node_s : float
        Seconds per node the layer's backward runs
        (:attr:`~autoplan.graph.LayerRecord.autograd_nodes`: the autograd engine, the node's
        kernels' dispatch, gradient accumulation).  Both 0 in profiles measured before them.
    forward_s, backward_s : float
        The same per *captured* forward operator (one node of the captured graph:
        ``aten.linear``, ``aten.layer_norm``, a view...), in the forward and in the backward;
        used where a profile has no ``forward_dispatch_s`` or a graph no counts.  A captured
        operator is a coarser unit: a layer of composites (``linear``, ``matmul``) dispatches
        more per captured operator, and one that builds masks or rotary tables without
        gradient has no backward for them.
    tp_linear_forward_s, tp_linear_backward_s : float
        Extra seconds per tensor-parallel linear (a DTensor ``ColwiseParallel`` /
        ``RowwiseParallel`` module: sharding propagation, wrapping and unwrapping, the
        functional collective's Python side) in the forward and in the backward, beyond
        the collective itself, which the link model prices.  Where ranks share cores, the
        main thread's CPU time times the ranks over the cores (seconds at every-rank-busy
        speed, as the pipeline figures).
    tp_collective_byte_s : float
        Extra seconds per byte of a tensor-parallel collective's payload (the full tensor
        an all-reduce sums, an all-gather gathers or a reduce-scatter scatters), forward
        and backward alike: the host work that grows with the activation beyond the
        collective's transfer, which the link model prices (the functional collective's
        copy in, DTensor's wrapping of the result, the local shard's copies).  Where ranks
        share cores, seconds at every-rank-busy speed as above.  0 where not measured
        (ranks with cores of their own, GPUs, profiles measured before it).
    tp_shared_linear_forward_s, tp_shared_linear_backward_s : float or None
        Extra seconds of a column linear that shares its region's input with another (q, k
        and v of one attention, gate and up of one MLP: :mod:`autoplan.runtime.tp` takes a
        region's input once, and its column linears' input gradients are reduced together),
        in the forward and in the backward: its DTensor matmul's host work, without the
        region's input wrapping and gradient reduction that the per-linear figure above
        carries.  Where ranks share cores, seconds at every-rank-busy speed as above.
        ``None`` where not measured (ranks that do not pair up, GPUs, profiles measured
        before it): such a linear is priced as any tensor-parallel linear.
    selective_dispatch_s : float
        Extra seconds per dispatched operator of a block under selective recompute
        (torch's selective checkpoint runs a Python dispatch mode over every operator the
        forward and its recompute dispatch, :attr:`~autoplan.graph.LayerRecord.dispatched_ops`),
        forward and backward together.
    selective_byte_s : float
        Extra seconds per byte of a block's activations (what it saves for the backward
        without recompute, :func:`autoplan.cost.memory.activation_bytes`) under selective
        recompute beyond the per-operator figure: the checkpoint keeps every operator's
        output until the block's forward ends and hands the recompute fresh tensors, so
        the block's backward works in memory its forward did not leave warm.  Measured on
        a CPU as a reference block's extra under a selective checkpoint that recomputes
        nothing, less its operators at ``selective_dispatch_s``, over its activation bytes
        (2026-11-27, 4 processes on 2 cores: 0.35-0.52 ns per byte in four profiles; the
        confirm models' blocks measured 9-19 ms more per micro-batch under selective
        recompute against 7-15 priced at the per-operator figure and the core's compute
        alone).  0 in GPU profiles (the device's own memory) and in profiles measured
        before it.
    selective_s : float
        The same per *captured* operator, as profiles measured before
        ``selective_dispatch_s`` state it (a block dispatches 1.4-1.8 operators per captured
        one, more where composites such as ``linear`` or ``matmul`` abound); used where a
        profile has no ``selective_dispatch_s`` or a graph no ``dispatched_ops``.
    optimizer_param_s, optimizer_dtensor_param_s : float
        Seconds per parameter tensor of one optimizer step (the fused ``AdamW``
        :func:`autoplan.parallelize` builds by default), for a plain tensor and for a DTensor (the
        parameters FSDP2's ``fully_shard``/``replicate`` and tensor parallelism leave:
        every operator goes through DTensor's sharding propagation).  The bytes the step
        moves are priced apart.  0 in profiles measured before they were.
    optimizer_element_s : float
        Seconds per fp32 parameter element of the same step over tensors large enough
        that the caches do not hold them (its arithmetic and memory traffic), less the
        per-tensor figure.  Where it is above 0 the cost model prices the step's bytes by
        it, scaled by the recipe's bytes per parameter against fp32's, instead of at the
        copy bandwidth: the fused step streams several tensors at once and runs faster
        than one large copy (measured 15-16 GB/s of its 28 bytes per parameter against
        12-13 GB/s copying 64 MiB, 4 processes on 2 cores).  0 in profiles measured
        before it was.
    zero_bubble_node_s : float
        Extra seconds per autograd node of a backward split as torch's zero-bubble
        schedules split it (input gradients, then the weight gradients in a pass of their
        own after a Python walk of the graph), forward + backward together.  0 in
        profiles measured before it.
    pipeline_action_s, pipeline_message_s : float
        Seconds of host work per pipeline stage action (one micro-batch's forward or
        backward, or a zero-bubble schedule's weight backward, of one stage) beyond the
        stage's operators: the schedule's and the stage's Python on the rank's main thread
        (``pipeline_action_s``) and, per message the action sends or receives, gloo's
        transport threads (``pipeline_message_s``).  CPU work that competes for the cores
        where ranks share them, measured as core time and scaled by the ranks over the
        cores (:func:`autoplan.profiling.parallel.measure_pipeline_overhead`).  0 in
        profiles measured before them and on GPUs.
    fsdp_gather_call_s, fsdp_gather_byte_s : float
        FSDP2's work per all-gather of one wrapped unit's parameters (a block, or a
        stage's other layers) beyond the collective itself, which the link model prices:
        seconds per call and per byte of the unit's gathered (unsharded) parameters.  Its
        buffers' copies (the shard into the gather's input, the gathered buffer out into
        the parameters) and allocation, the unsharded parameters' set-up, the reshard:
        memory-bound and host work on the rank's cores.  Measured on a CPU as two units of
        linears under ``fully_shard`` on pairs of ranks, every rank busy: ZeRO-3's forward +
        backward less ZeRO-2's (which keeps its gathered parameters), less two raw
        ``all_gather_into_tensor`` of the same bytes, per unit and gather, at two unit sizes
        (:func:`autoplan.profiling.parallel.measure_fsdp_overhead`).  2026-11-27, 4
        processes on 2 cores: 1.7-2.7 ms a call at 1-2 MB, 6.3 at 4 MB, 10.7 at 8 MB,
        against 0.9-3.8 ms for the raw gathers; three profiles' lines read 0-0.4 ms + 1.4-1.8
        ms per MiB.  0 in GPU profiles (the copies run on the device's streams, priced by
        its memory bandwidth) and in profiles measured before them.
    fsdp_reduce_call_s, fsdp_reduce_byte_s : float
        The same per reduce-scatter of one unit's gradients, per call and per byte of the
        unit's (unsharded) gradients: their copy into the reduce-scatter's input, the
        reduced shard's copy, division and accumulation into the sharded gradient.
        Measured as ZeRO-2's forward + backward (a reduce-scatter a micro-batch, gathered
        parameters kept) less the same units without ``fully_shard``, less a raw
        ``reduce_scatter_tensor`` of the same bytes, per unit (2026-11-27, same ranks: 4.2
        ms a call at 1 MB, 7.1-7.2 at 2, 8.5 at 4, 13.0 at 8, against 2.4-14 ms for the raw
        reduce-scatters; three profiles' lines 1.3-2.7 ms + 1.3-2.0 ms per MiB).

        The cost model adds them (in place of :attr:`CostOptions.zero_buffer_copies`'
        copies) to the collectives ZeRO-2 and ZeRO-3 layers run every micro-batch, where
        the eight confirm passes of the retired ``benchmarks/local_truth.py`` had priced
        ZeRO-3's and ZeRO-2's steps 11% and 5-6% fast against the same layout without
        ZeRO, and to the once-a-step collectives per wrapped unit (ZeRO-1's reduce-scatters,
        ZeRO-1/2's gathers) but on pipelines whose ranks share cores: a pipeline's step
        ends with the other stages' ranks idle, not every rank busy, a speed-up neither
        these figures nor the link model's know, where the engine's pipeline bound (the
        busiest rank's work at the every-rank-busy speed) is pessimistic (with them there
        the stored passes priced ZeRO-1's pipelines 21% (GPT) and 28% (Llama) slow where
        without them their ratio to the layout without ZeRO was priced within 2%).
    replicate_call_s, replicate_byte_s : float
        FSDP2's ``replicate`` (what :func:`autoplan.parallelize` runs for ZeRO-0 with
        tensor, pipeline or context parallelism) per step's all-reduce of a rank's
        gradients beyond the collective itself, per call and per byte of the gradients:
        its copy of the gradients into the all-reduce's input and of the reduced ones back
        out, the division, the DTensor gradients' set-up.  Measured on a CPU as two units of
        linears under ``replicate`` on pairs of ranks, every rank busy, forward + backward
        less the same units without it, less a raw ``all_reduce`` of the same bytes, at two
        sizes (:func:`autoplan.profiling.parallel.measure_fsdp_overhead`).  2026-11-27, 4
        processes on 2 cores: 11.5 ms beyond the raw all-reduce's 4.6 at 2.1 MB, 34.6
        beyond 9.0 at 8.4 MB (3.8 ms + 3.7 ms per MB); the ten stored confirm passes had
        priced the layouts that run it without a pipeline (tensor parallelism with data
        or context parallelism) 8-15% fast.  The cost model adds them to ``replicate``'s
        all-reduce in place of :attr:`CostOptions.zero_buffer_copies`' copies on CPU
        ranks, but on pipelines whose ranks share cores (as the ``fsdp_*`` figures'
        once-a-step part: with them there the stored passes priced the two-stage
        pipelines of two replicas 9-28% slow, where without them they lie within 10%).
        0 in GPU profiles and in profiles measured before them.
    cp_gather_call_s, cp_gather_byte_s, cp_scatter_call_s, cp_scatter_byte_s : float
        Context parallelism's all-gather of a block's keys and values (forward) and the
        reduce-scatter of their gradients (backward) as a step runs them, beyond the
        collectives timed back to back (which the link model prices): seconds per call and
        per byte of the gathered (whole-sequence) keys and values.  Where ranks share
        cores, a collective between compute waits for its peers to be scheduled: the
        pairs' collectives in a context-parallel block cost about twice their
        back-to-back time.  Measured on a CPU as an attention core with
        :func:`autoplan.runtime.cp.gather_sequence` between linears, on pairs of ranks,
        every pair at once, each rank's clock: forward, and forward + backward, less the
        same with a local stand-in for the collective (the same copies), less the raw
        collective of the same bytes, at two payloads
        (:func:`autoplan.profiling.parallel.measure_cp_overhead`).  2026-11-28, 4
        processes on 2 cores: the pair's all-gather and reduce-scatter together 8-10 ms
        in a step at 512 KiB and 11.3-11.4 ms at 1 MiB, against 4.1 and 5.1 ms back to
        back.  The cost model adds them to the context-parallel collectives of CPU ranks
        whose group leaves other ranks of the node computing (not to a group of every
        rank: none computes meanwhile), and on a pipeline whose ranks share cores keeps
        them off the critical path where the other stages idle.  0 in GPU profiles and in
        profiles measured before them.
    layer_forward_scale, layer_backward_scale : float or None
        A transformer layer's measured time against the sum of its parts as this profile
        prices them (matmuls by the efficiency table, memory-bound operators by their
        rates and the copy bandwidth, the host per operator and autograd node), forward
        and backward: a reference stack of transformer blocks timed whole, every rank busy,
        over the cost model's price for the same blocks from this profile's other figures.
        The parts are timed alone, each on operands of its own; in a layer they follow each
        other through memory the others have just used, and a CPU's forward reads and
        writes activations the previous step's backward left in memory, and ranks that
        share cores evict each other's caches at every time slice (2026-11-27: on 4
        processes of 2 cores the reference read 1.12-1.25 forward and 0.96-1.09 backward in
        four profiles and runs, the confirm models' blocks 1.1-1.3 forward; on 2 processes
        with cores of their own 1.04 and 0.96).  The cost model multiplies each layer's
        compute by them where the host is the device (CPUs), and its host time too where
        the profile has no ``host_forward_scale``.  ``None`` where not measured (GPU
        profiles, profiles measured before them): no scaling.
    host_forward_scale, host_backward_scale : float or None
        A transformer layer's host work (``forward_dispatch_s`` per dispatched operator,
        ``backward_node_s`` per autograd node) at a model's width against the same
        figures measured on tiny blocks, forward and backward: the reference stack timed
        at two shapes (4 x 128 and 1 x 32 tokens), the host work being about the same at
        both and the arithmetic 16 times, gives the layer scales (what grows with the
        tokens) and these (what does not).  An operator on real tensors costs more, beyond its
        arithmetic, than on tiny ones (its output's allocation and its kernel's set-up
        grow with the operands; not separated here), which a small micro-batch pays per
        sequence four times over (2026-11-28, 4 processes on 2 cores
        of an AMD EPYC: the confirm models at one sequence a micro-batch measured 25-37%
        more per sequence than at four in the forward and 16-21% in the backward, priced
        15-28% and 9-15% with the layer scales on host and arithmetic alike; the
        reference read x1.5-2.0 forward and x2.3-2.7 backward in four profiles and runs,
        one profile x5.4 backward: at 1 x 128 tokens, the first second shape, the host
        work is ~13% of the price, so the split amplified the host's noise; at 1 x 32 it
        is ~37%, and one pair of scales fitted 4 x 128, 1 x 128, 1 x 32 and 1 x 8 tokens'
        backward within 1.5%, the forward at 1 x 128 within 1.4%).  ``autoplan profile``
        states the split in its source but does not set these
        (:data:`autoplan.profiling.reference.HOST_SPLIT_NOT_APPLIED`: in three confirm passes
        it priced the layouts worse, the Llama's most); a profile written by hand may.
        ``None`` (GPU profiles, measured profiles): the host time is scaled as the
        arithmetic.
    source : str
        How the figures were measured.
    """

    forward_s: float
    backward_s: float
    tp_linear_forward_s: float
    tp_linear_backward_s: float
    source: str
    selective_s: float = 0.0
    selective_dispatch_s: float = 0.0
    selective_byte_s: float = 0.0
    optimizer_param_s: float = 0.0
    optimizer_dtensor_param_s: float = 0.0
    forward_dispatch_s: float = 0.0
    backward_node_s: float = 0.0
    optimizer_element_s: float = 0.0
    pipeline_action_s: float = 0.0
    pipeline_message_s: float = 0.0
    zero_bubble_node_s: float = 0.0
    tp_collective_byte_s: float = 0.0
    fsdp_gather_call_s: float = 0.0
    fsdp_gather_byte_s: float = 0.0
    fsdp_reduce_call_s: float = 0.0
    fsdp_reduce_byte_s: float = 0.0
    replicate_call_s: float = 0.0
    replicate_byte_s: float = 0.0
    cp_gather_call_s: float = 0.0
    cp_gather_byte_s: float = 0.0
    cp_scatter_call_s: float = 0.0
    cp_scatter_byte_s: float = 0.0
    tp_shared_linear_forward_s: float | None = None
    tp_shared_linear_backward_s: float | None = None
    layer_forward_scale: float | None = None
    layer_backward_scale: float | None = None
    host_forward_scale: float | None = None
    host_backward_scale: float | None = None

    def __post_init__(self) -> None:
        for name in ("forward_s", "backward_s", "tp_linear_forward_s", "tp_linear_backward_s",
                     "tp_collective_byte_s", "selective_s", "selective_dispatch_s",
                     "selective_byte_s", "optimizer_param_s", "optimizer_dtensor_param_s",
                     "forward_dispatch_s", "backward_node_s", "optimizer_element_s",
                     "pipeline_action_s", "pipeline_message_s", "zero_bubble_node_s",
                     "fsdp_gather_call_s", "fsdp_gather_byte_s", "fsdp_reduce_call_s",
                     "fsdp_reduce_byte_s", "replicate_call_s", "replicate_byte_s",
                     "cp_gather_call_s", "cp_gather_byte_s", "cp_scatter_call_s",
                     "cp_scatter_byte_s"):
            value = getattr(self, name)
            _require(_finite_nonnegative(value), name,
                     f"expected seconds >= 0, got {value!r}")
        # figures measured in pairs (forward, backward): both or neither
        for names, check, expected, pair in (
                (("tp_shared_linear_forward_s", "tp_shared_linear_backward_s"),
                 _finite_nonnegative, "seconds >= 0", "shared-linear figures"),
                (("layer_forward_scale", "layer_backward_scale"),
                 _finite_positive, "a ratio > 0", "layer scales"),
                (("host_forward_scale", "host_backward_scale"),
                 _finite_positive, "a ratio > 0", "host scales")):
            values = [getattr(self, name) for name in names]
            for name, value in zip(names, values):
                _require(value is None or check(value), name,
                         f"expected {expected} or None, got {value!r}")
            _require((values[0] is None) == (values[1] is None), names[0],
                     f"expected both {pair} or neither")
        _require(_text(self.source), "source", "expected a non-empty source")

    @property
    def fsdp_measured(self) -> bool:
        """Whether the profile measured FSDP2's work beyond its collectives (any of the
        ``fsdp_*`` figures above 0)."""
        return bool(self.fsdp_gather_call_s or self.fsdp_gather_byte_s
                    or self.fsdp_reduce_call_s or self.fsdp_reduce_byte_s)

    @property
    def replicate_measured(self) -> bool:
        """Whether the profile measured ``replicate``'s work beyond its all-reduce."""
        return bool(self.replicate_call_s or self.replicate_byte_s)

    @property
    def cp_measured(self) -> bool:
        """Whether the profile measured context parallelism's collectives in a step."""
        return bool(self.cp_gather_call_s or self.cp_gather_byte_s
                    or self.cp_scatter_call_s or self.cp_scatter_byte_s)

    def cp_collectives_s(self, nbytes: float) -> tuple[float, float]:
        """Context parallelism's seconds beyond its collectives' back-to-back time for
        one block gathering ``nbytes`` of keys and values (the whole sequences'),
        ``(forward all-gather, backward reduce-scatter)``."""
        return (self.cp_gather_call_s + nbytes * self.cp_gather_byte_s,
                self.cp_scatter_call_s + nbytes * self.cp_scatter_byte_s)

    def fsdp_gather_s(self, nbytes: float, calls: float = 1.0) -> float:
        """FSDP2's seconds beyond the collective for ``calls`` all-gathers gathering
        ``nbytes`` in all."""
        return calls * self.fsdp_gather_call_s + nbytes * self.fsdp_gather_byte_s

    def fsdp_reduce_s(self, nbytes: float, calls: float = 1.0) -> float:
        """The same for ``calls`` reduce-scatters reducing ``nbytes`` in all."""
        return calls * self.fsdp_reduce_call_s + nbytes * self.fsdp_reduce_byte_s

    def replicate_s(self, nbytes: float, calls: float = 1.0) -> float:
        """``replicate``'s seconds beyond the collective for ``calls`` all-reduces
        reducing ``nbytes`` of gradients in all."""
        return calls * self.replicate_call_s + nbytes * self.replicate_byte_s

    def tp_linears_s(self, linears: int, shared: int) -> tuple[float, float]:
        """Host seconds of ``linears`` tensor-parallel linears of a layer, ``shared`` of
        them column linears that share their region's input with another, ``(forward,
        backward)``: those at the shared figure where the profile has it, every other
        at the per-linear figure."""
        fwd, bwd = self.tp_linear_forward_s, self.tp_linear_backward_s
        shared_fwd, shared_bwd = self.tp_shared_linear_forward_s, self.tp_shared_linear_backward_s
        if shared_fwd is None or shared_bwd is None:
            return linears * fwd, linears * bwd
        own = linears - shared
        return own * fwd + shared * shared_fwd, own * bwd + shared * shared_bwd


#: Memory-bound operators a profile may time apart (:class:`ElementwiseRates`), each with
#: the captured targets it prices (``aten.<op>.<overload>``, matched up to the overload).
#: Their arithmetic per byte is far from a copy's on a CPU: erf-GELU's backward, SiLU's
#: sigmoid, softmax's exponentials, layer norm's two reductions, masked_fill's mask.
ELEMENTWISE_KINDS: dict[str, tuple[str, ...]] = {
    "gelu": ("aten.gelu",),
    "silu": ("aten.silu",),
    "softmax": ("aten.softmax", "aten._softmax", "aten._safe_softmax"),
    "layer_norm": ("aten.layer_norm", "aten.native_layer_norm"),
    "masked_fill": ("aten.masked_fill",),
}


#: Memory-bound nodes a profile may time apart by the layout of their operands rather than
#: by their operator: ``broadcast``, an operation with an operand smaller than its output (a
#: norm's per-row scale or weight, rotary embeddings' cos and sin, an expanded mask), and
#: ``layout_copy``, the copy that makes a transposed or permuted view contiguous.  torch's
#: CUDA kernels take a non-vectorized path for both, whose speed is not the copy
#: bandwidth's: on an H200 (2026-11-27, Llama 3.2 1B shapes) they took 0.84-1.0 of their time
#: on an H100 where the vectorized kernels took 0.70-0.80, most of them the ratio of the two
#: cards' copy bandwidths, 0.71 (``benchmarks/gpu_truth.py``).
LAYOUT_KINDS: tuple[str, ...] = ("broadcast", "layout_copy")
#: Every kind an :class:`ElementwiseRates` may price.
RATE_KINDS: tuple[str, ...] = (*ELEMENTWISE_KINDS, *LAYOUT_KINDS)


def elementwise_kind(target: str) -> str | None:
    """The :data:`ELEMENTWISE_KINDS` kind a captured node's target is, or ``None``.

    >>> elementwise_kind("aten.gelu.default"), elementwise_kind("aten.gelu_backward.default")
    ('gelu', None)
    """
    op = target.rsplit(".", 1)[0] if target.count(".") >= 2 else target
    for kind, ops in ELEMENTWISE_KINDS.items():
        if op in ops:
            return kind
    return None


@dataclass(frozen=True)
class ElementwiseRates(Record):
    """Measured speed of memory-bound operators of a kind (:data:`RATE_KINDS`: an operator of
    :data:`ELEMENTWISE_KINDS` or a layout of :data:`LAYOUT_KINDS`), in
    the bytes the cost model counts for them: a node's output plus its inputs in the
    forward (:attr:`autoplan.cost.summary.GraphSummary.elementwise`), per second of its
    forward and per second of its backward.  A kind without a figure moves at the
    device's copy bandwidth, its backward ``ELEMENTWISE_BACKWARD_FACTOR`` times the
    forward's bytes (:mod:`autoplan.cost.engine`; on a CPU other operators' backward
    moves the bytes their derivative moves, :func:`autoplan.cost.summary.backward_traffic`,
    on a GPU twice their forward's too).

    Parameters
    ----------
    forward_bytes_per_s, backward_bytes_per_s : dict of str to float
        Per kind, the forward's counted bytes over the forward's seconds and over the
        backward's seconds.
    source : str
        How the figures were measured.
    """

    forward_bytes_per_s: dict[str, float]
    backward_bytes_per_s: dict[str, float]
    source: str

    def __post_init__(self) -> None:
        for field_name in ("forward_bytes_per_s", "backward_bytes_per_s"):
            rates = getattr(self, field_name)
            _require(isinstance(rates, dict), field_name,
                     f"expected a mapping of operator kind to bytes per second, got {rates!r}")
            for kind, value in rates.items():
                _require(kind in RATE_KINDS, f"{field_name}.{kind}",
                         f"unknown operator kind {kind!r}; expected one of "
                         f"{list(RATE_KINDS)}")
                _require(_finite_positive(value), f"{field_name}.{kind}",
                         f"expected bytes per second > 0, got {value!r}")
        _require(set(self.forward_bytes_per_s) == set(self.backward_bytes_per_s),
                 "backward_bytes_per_s", "expected a backward figure for each forward one, "
                 f"got {sorted(self.backward_bytes_per_s)} for {sorted(self.forward_bytes_per_s)}")
        _require(_text(self.source), "source", "expected a non-empty source")

    def seconds(self, kind: str, nbytes: float) -> tuple[float, float] | None:
        """``(forward, backward)`` seconds of ``nbytes`` counted bytes of ``kind``, or
        ``None`` without a figure for it."""
        f = self.forward_bytes_per_s.get(kind)
        if f is None:
            return None
        return nbytes / f, nbytes / self.backward_bytes_per_s[kind]


@dataclass(frozen=True)
class DeviceType(Record):
    """One accelerator (or CPU) kind.

    Parameters
    ----------
    name : str
        E.g. ``"A100-SXM4-80GB"``.
    peak_flops_per_s : dict of str to float
        Dense peak FLOP/s per dtype (keys from :data:`DTYPES`).  A dtype the
        device lacks is absent; see :meth:`resolve_dtype`.
    memory_bytes : int
        Device memory capacity.
    memory_bw_bytes_per_s : float
        Device memory bandwidth.
    matmul_efficiency : dict of str to EfficiencyTable
        Achievable fraction of peak vs matmul size, per dtype, or under the key
        ``"default"`` for every dtype without its own table.
    source : str
        Where the peak, memory and bandwidth figures come from.
    architecture : str
        The device's architecture, one of :data:`ARCHITECTURES` (``"volta"``,
        ``"ampere"``, ``"hopper"``, ``"blackwell"``, ``"cpu"``) or ``""`` when not
        known.  Fitted figures (``autoplan.cost.calibration``) are kept per
        architecture and scaled by each device's own datasheet peaks and links.
    op_overhead : OpOverhead or None
        Host time per operator that adds to the device's (measured CPU profiles);
        ``None`` where the host runs ahead of the device (GPUs).
    measured : bool
        The peaks and tables are measurements of this device (``autoplan profile``), not
        datasheet figures: the fitted figures of ``autoplan.cost.calibration``, which
        scale a datasheet peak, are not applied to it.
    elementwise_rates : ElementwiseRates or None
        Measured memory-bound operators by kind (``autoplan profile``: on CPU ranks the
        operator kinds, on a GPU the layout kinds too);
        ``None``: every memory-bound operator at ``memory_bw_bytes_per_s``.
    grouped_matmul_efficiency : dict of str to EfficiencyTable or None
        Measured grouped GEMMs (MoE expert banks, ``torch._grouped_mm``; ``autoplan
        profile``, :mod:`autoplan.hardware.grouped_gemm`) per dtype: the fraction of the
        dtype's peak at which a grouped GEMM runs, against the FLOPs of one group's GEMM.
        ``None``: expert GEMMs are priced from ``matmul_efficiency``.
    attention_efficiency : EfficiencyTable or None
        Measured fused attention (``autoplan profile`` on CUDA: causal SDPA, forward and
        backward): the fraction of the 16-bit peak at which the cost model's fused-
        attention FLOPs take the measured time, against the FLOPs of one ``QK^T`` product
        on the device (the engine's key for attention).  ``None``: the fitted curve of the
        architecture (or the device's matmul table scaled by the fitted ratio).
    """

    name: str
    peak_flops_per_s: dict[str, float]
    memory_bytes: int
    memory_bw_bytes_per_s: float
    matmul_efficiency: dict[str, EfficiencyTable]
    source: str
    architecture: str = ""
    op_overhead: OpOverhead | None = None
    measured: bool = False
    attention_efficiency: EfficiencyTable | None = None
    elementwise_rates: ElementwiseRates | None = None
    grouped_matmul_efficiency: dict[str, EfficiencyTable] | None = None

    def __post_init__(self) -> None:
        _require(_text(self.name), "name", "expected a non-empty device name")
        _require(bool(self.peak_flops_per_s), "peak_flops_per_s", "expected at least one dtype")
        for dtype, flops in self.peak_flops_per_s.items():
            _require(dtype in DTYPES, f"peak_flops_per_s.{dtype}",
                     f"unknown dtype {dtype!r}; expected one of {list(DTYPES)}")
            _require(_finite_positive(flops), f"peak_flops_per_s.{dtype}",
                     f"expected a peak FLOP/s > 0, got {flops!r}")
        _require(isinstance(self.memory_bytes, int) and self.memory_bytes > 0, "memory_bytes",
                 f"expected a memory capacity > 0 bytes, got {self.memory_bytes!r}")
        _require(_finite_positive(self.memory_bw_bytes_per_s), "memory_bw_bytes_per_s",
                 f"expected a memory bandwidth > 0, got {self.memory_bw_bytes_per_s!r}")
        for key in self.matmul_efficiency:
            _require(key in DTYPES or key == _DEFAULT_TABLE_KEY or key in VARIANT_TABLES,
                     f"matmul_efficiency.{key}",
                     f"unknown key {key!r}; expected a dtype {list(DTYPES)}, "
                     f"{_DEFAULT_TABLE_KEY!r} or one of {list(VARIANT_TABLES)}")
            if key in VARIANT_TABLES:
                _require(VARIANT_TABLES[key] in self.peak_flops_per_s, f"matmul_efficiency.{key}",
                         f"a {key!r} table is against the {VARIANT_TABLES[key]!r} peak, which "
                         "the device does not list")
        for dtype in self.peak_flops_per_s:
            _require(dtype in self.matmul_efficiency or _DEFAULT_TABLE_KEY in self.matmul_efficiency,
                     "matmul_efficiency",
                     f"no efficiency table for dtype {dtype!r}: add a {dtype!r} or "
                     f"{_DEFAULT_TABLE_KEY!r} table")
        _require(_text(self.source), "source", "expected a non-empty source")
        _require(self.architecture in ARCHITECTURES or self.architecture == "", "architecture",
                 f"unknown architecture {self.architecture!r}; expected one of "
                 f"{list(ARCHITECTURES)} or ''")
        _require(self.op_overhead is None or isinstance(self.op_overhead, OpOverhead),
                 "op_overhead", f"expected an OpOverhead or None, got {self.op_overhead!r}")
        _require(isinstance(self.measured, bool), "measured",
                 f"expected true or false, got {self.measured!r}")
        _require(self.attention_efficiency is None
                 or isinstance(self.attention_efficiency, EfficiencyTable),
                 "attention_efficiency",
                 f"expected an efficiency table or None, got {self.attention_efficiency!r}")
        _require(self.elementwise_rates is None
                 or isinstance(self.elementwise_rates, ElementwiseRates), "elementwise_rates",
                 f"expected ElementwiseRates or None, got {self.elementwise_rates!r}")
        for key, table in (self.grouped_matmul_efficiency or {}).items():
            _require(key in DTYPES, f"grouped_matmul_efficiency.{key}",
                     f"unknown dtype {key!r}; expected one of {list(DTYPES)}")
            _require(isinstance(table, EfficiencyTable), f"grouped_matmul_efficiency.{key}",
                     f"expected an efficiency table, got {table!r}")

    def grouped_efficiency(self, per_group_flops: float, dtype: str) -> float | None:
        """The measured efficiency of a grouped GEMM whose groups run ``per_group_flops``
        each (``grouped_matmul_efficiency``), or None without a table for ``dtype``."""
        table = (self.grouped_matmul_efficiency or {}).get(self.resolve_dtype(dtype))
        return table.efficiency(per_group_flops) if table is not None else None

    def resolve_dtype(self, dtype: str) -> str:
        """The dtype a matmul requested in ``dtype`` runs in on this device.

        ``dtype`` itself when the device has a peak for it, else its
        :data:`DTYPE_FALLBACK` (``tf32 -> fp32``, ``bf16 -> fp16``).

        Raises
        ------
        ConfigError
            When neither is available; the message lists the device's dtypes.
        """
        if dtype in self.peak_flops_per_s:
            return dtype
        fallback = DTYPE_FALLBACK.get(dtype)
        if fallback in self.peak_flops_per_s:
            return fallback
        raise ConfigError(f"device {self.name!r} has no {dtype!r} peak (and no fallback); "
                          f"it supports {sorted(self.peak_flops_per_s)}")

    def peak(self, dtype: str) -> float:
        """Peak FLOP/s for ``dtype`` (after :meth:`resolve_dtype`)."""
        return self.peak_flops_per_s[self.resolve_dtype(dtype)]

    def efficiency(self, flops: float, dtype: str) -> float:
        """Achievable fraction of peak for one matmul of ``flops`` FLOPs in ``dtype``."""
        resolved = self.resolve_dtype(dtype)
        table = self.matmul_efficiency.get(resolved) or self.matmul_efficiency[_DEFAULT_TABLE_KEY]
        return table.efficiency(flops)

    def achieved_flops_per_s(self, flops: float, dtype: str) -> float:
        """Achieved FLOP/s for one matmul of ``flops`` FLOPs: peak times efficiency."""
        return self.peak(dtype) * self.efficiency(flops, dtype)

    def matmul_time_s(self, flops: float, dtype: str) -> float:
        """Seconds for one matmul of ``flops`` FLOPs in ``dtype``."""
        return flops / self.achieved_flops_per_s(flops, dtype)
