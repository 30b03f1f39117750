"""The host's side of a step: how long the CPU takes to issue it, and when that, not the GPU, sets the pace.

A GPU runs what its host hands it. In eager PyTorch every operator is *dispatched* from Python -- argument
parsing, the dispatcher, autograd's bookkeeping, the kernel launch -- a few microseconds each, whatever the
tensor's size. The device runs the kernels asynchronously, so while the host stays ahead the host's time hides
under the device's; when it falls behind, the GPU waits between kernels. The planner prices a step as::

    step = max(device time, host time) + serial host work
    host time = dispatches per step x seconds per dispatch + the step's fixed Python (+ FSDP's hooks, per unit)

*Serial* host work is what the device waits for whatever it has queued: a batch built inside the step, a
synchronising read (``.item()``, ``torch.cuda.synchronize()``, a blocking copy) that drains the queue so the next
kernels start only once the host issues them again. A plan is **host-bound** when host time exceeds device time:
a faster GPU would not help, fewer dispatches would (no needless wrapping, ``torch.compile``, CUDA graphs, XLA).

**Dispatches per step** (:func:`dispatches_per_step`) are counted, not guessed, for the course GPT: one training
step under :class:`course_lib.measure.dispatches.DispatchCounter` on CPU (torch 2.13; forward, fused loss,
backward, fused AdamW, schedule) at 1, 2 and 12 layers gives exactly ``base + per_layer x L``:

===========================================  =========  ======  =====================================
the model as written (course GPT, eager)     per layer  base    of which kernels (per layer / base)
===========================================  =========  ======  =====================================
plain module, fp32                           100        54      29 / 28
plain module, bf16 ``torch.autocast``        122        59      51 / 33
FSDP2 on every block + root, fp32            158        76      73 / 48
FSDP2 + bf16 ``MixedPrecisionPolicy``        184        85      99 / 57
===========================================  =========  ======  =====================================

FSDP2 adds its copy-in, copy-out and casts per unit even at world size 1, and its hooks run Python per unit
(:data:`FSDP_UNIT_S`). Layers other than the course GPT's add their own operators, estimated from the ops they
run (not counted): Llama's eager RMSNorm (7 more forward ops per norm, twice that backward: +42 per layer), RoPE
(+30), SwiGLU's third matmul and gate (+13), separate q, k, v projections (+12). ``torch.compile`` per block
replaces a block's dispatches by one call launching the fused kernels (:data:`COMPILED_KERNELS_PER_LAYER`, an
estimate: 3 per matmul, 3 for attention, ~8 fused pointwise), which Inductor's wrapper launches at
:data:`LAUNCH_S` each; XLA (JAX) launches the same from C++ with no Python per step. These two are estimates,
marked as such; the eager counts are measurements.

**Seconds per dispatch** (:data:`DISPATCH_S`, :data:`STEP_FIXED_S`, :data:`FSDP_UNIT_S`) come from one tiny
calibration run on a CPU (:func:`course_lib.bench.host.calibrate`): a course GPT so small (d 16, 8 tokens) that its
step is nothing but dispatches, timed (median) at 1 and 3 layers. The slope over the counted dispatches is the
seconds per dispatch; what is left at 1 layer is the step's fixed Python (AdamW's ``step()``, the loss's and the
schedule's bookkeeping), paid once per step whatever the model. Not every dispatch costs the same (a view is
cheaper than a matmul, the optimizer's Python is dearer than either): one rate for them all over-predicted a deeper
model by 34-45% here; the slope and the intercept land within 15% (tests/test_planner_host.py). Then FSDP2 at world
size 1: what its step takes beyond its dispatches is its hooks' Python, per unit. A GPU's host pays the same Python and
dispatcher per operator, plus the CUDA launch (:data:`LAUNCH_S`) per kernel; its CPU may be faster or slower than
this one -- recalibrate on the machine that hosts the GPU (``python -m course_lib.bench.host cuda``).
"""
from __future__ import annotations

from dataclasses import dataclass

__all__ = ["HostCalibration", "COURSE_CPU", "LENT_H200_HOST", "EAGER_COUNTS", "DISPATCH_S", "STEP_FIXED_S",
           "FSDP_UNIT_S", "LAUNCH_S", "COMPILED_KERNELS_PER_LAYER",
           "HostWork",
           "dispatches_per_step", "host_seconds", "FRAMEWORKS"]

#: (per layer, base) dispatches of one course-GPT training step, and (per layer, base) of them kernels: counted
#: (module docstring); keys: (fsdp, bf16)
EAGER_COUNTS = {(False, False): ((100, 54), (29, 28)), (False, True): ((122, 59), (51, 33)),
                (True, False): ((158, 76), (73, 48)), (True, True): ((184, 85), (99, 57))}
#: seconds of host time per eager dispatch: calibrated on this course's CPU machine (bench.host.calibrate, torch 2.13,
#: 2 cores shared by several jobs, load 2-4; medians of 30 steps)
DISPATCH_S = 2.5e-6
#: seconds of a step's Python outside its dispatches (AdamW's step(), the loss and the schedule): calibrated with it
STEP_FIXED_S = 240e-6
#: seconds of Python in FSDP2's hooks per unit and step (pre/post forward, pre/post backward), beyond its dispatches:
#: calibrated the same way on FSDP2 at world size 1
FSDP_UNIT_S = 450e-6
#: one CUDA kernel launch from C++ (Inductor's wrapper, XLA's runtime): "a few microseconds" (NVIDIA, "Getting Started
#: with CUDA Graphs", developer blog, 2019); 3 us assumed
LAUNCH_S = 3.0e-6
#: kernels a compiled course-GPT block launches per training step (forward + backward): an estimate (docstring)
COMPILED_KERNELS_PER_LAYER = 20
FRAMEWORKS = ("torch", "xla")


@dataclass(frozen=True)
class HostCalibration:
    """One machine's host constants, from one tiny run of :func:`course_lib.bench.host.calibrate` there.
    ``launch_included``: calibrated on the GPU itself (``python -m course_lib.bench.host cuda``), so each
    dispatch's seconds already hold its CUDA launch; False: on a CPU, where :data:`LAUNCH_S` is added per kernel."""

    dispatch_s: float
    step_fixed_s: float
    fsdp_unit_s: float
    launch_included: bool
    source: str

    def __post_init__(self):
        bad = {k: getattr(self, k) for k in ("dispatch_s", "step_fixed_s", "fsdp_unit_s") if getattr(self, k) < 0}
        if bad or self.dispatch_s == 0:
            raise ValueError(f"HostCalibration {bad or {'dispatch_s': 0}}: seconds must be >= 0 (dispatch_s > 0); "
                             "a negative intercept from calibrate() is noise: pass max(0, it)")

    @classmethod
    def from_calibrate(cls, r: dict, device: str = "cpu", source: str = "") -> "HostCalibration":
        """From :func:`course_lib.bench.host.calibrate`'s dict (a negative fixed part, noise, becomes 0)."""
        return cls(r["dispatch_s"], max(0.0, r["step_fixed_s"]), max(0.0, r.get("fsdp_unit_s", FSDP_UNIT_S)),
                   launch_included=device.startswith("cuda"), source=source or f"bench.host.calibrate({device!r})")


#: this course's CPU machine (the constants above)
COURSE_CPU = HostCalibration(DISPATCH_S, STEP_FIXED_S, FSDP_UNIT_S, False, "the course's 2-core CPU machine")
#: the lent H200 machine's host, 2026-11-27: ``python -m course_lib.bench.host cuda`` there gave 152 dispatches in
#: 2.857 ms and 352 in 6.760 ms (19.51 us each, CUDA launch included; intercept -109 us: 0), FSDP2 at world size 1
#: 553 in 17.261 ms (1,645 us per unit); the same box's CPU-only run: 3.35 us per dispatch. Its virtualised host
#: pays ~16 us per CUDA launch, where a bare-metal host pays a few.
LENT_H200_HOST = HostCalibration(19.51e-6, 0.0, 1645e-6, True,
                                 "python -m course_lib.bench.host cuda on the lent H200 machine, 2026-11-27")


@dataclass(frozen=True)
class HostWork:
    """One step's host side: ``dispatches`` issued from Python (eager ops), ``launches`` issued from C++
    (compiled kernels), ``fsdp_units`` whose hooks run, and the seconds they take."""

    dispatches: int
    kernels: int          #: of the dispatches, those that launch a kernel (the GPU's kernel count, eager)
    launches: int         #: kernels launched without a Python dispatch each (compiled blocks, XLA)
    fsdp_units: int
    seconds: float


def _layer_extra(m) -> int:
    """Dispatches a layer adds over the course GPT's (estimated from the ops it runs; module docstring)."""
    return 42 * (m.norm == "rms") + 30 * m.rope + 13 * m.gated_mlp + 12 * (not m.fused_qkv)


def dispatches_per_step(m, *, fsdp: bool, bf16: bool = True, compile: bool = False, framework: str = "torch",
                        checkpointing: str = "none", grad_accum: int = 1, dispatch_s: float | None = None,
                        step_fixed_s: float | None = None, fsdp_unit_s: float | None = None,
                        gpu: bool = True) -> HostWork:
    """The host work of one step of ``m`` (a :class:`~course_lib.maths.planner.ModelShape`): ``fsdp`` (FSDP2 on
    every layer and the root), ``bf16`` (FSDP2's policy, or autocast without FSDP), ``compile`` (each block),
    ``framework`` "torch" or "xla" (one compiled program per step). Seconds at :data:`DISPATCH_S` and
    :data:`STEP_FIXED_S`, :data:`FSDP_UNIT_S` (or ``dispatch_s``, ``step_fixed_s``, ``fsdp_unit_s``: another
    machine's calibration, :func:`course_lib.bench.host.calibrate`). ``gpu``: each eager kernel also pays a CUDA
    launch (:data:`LAUNCH_S`; False: the CPU the constants were calibrated on, whose kernels are in them)."""
    dispatch_s = DISPATCH_S if dispatch_s is None else dispatch_s
    step_fixed_s = STEP_FIXED_S if step_fixed_s is None else step_fixed_s
    fsdp_unit_s = FSDP_UNIT_S if fsdp_unit_s is None else fsdp_unit_s
    if framework not in FRAMEWORKS:
        raise ValueError(f"framework={framework!r} must be one of {FRAMEWORKS}")
    L = m.n_layers
    (per, base), (kper, kbase) = EAGER_COUNTS[(fsdp, bf16)]
    units = (L + 1 if fsdp else 0) if framework == "torch" else 0
    if framework == "xla":
        launches = grad_accum * (COMPILED_KERNELS_PER_LAYER * L + kbase)
        return HostWork(0, 0, launches, 0, launches * LAUNCH_S)
    if compile:   # each block one compiled call: its FSDP hooks and base ops stay eager
        fsdp_per = per - EAGER_COUNTS[(False, bf16)][0][0] if fsdp else 0
        dispatches = base + L * (fsdp_per + 2)
        kernels = kbase + L * (kper - EAGER_COUNTS[(False, bf16)][1][0] if fsdp else 0)
        launches = L * COMPILED_KERNELS_PER_LAYER
    else:
        extra = _layer_extra(m)
        recompute = {"none": 0.0, "selective": 0.5, "full": 1.0}[checkpointing] / 3   # forward is ~1/3 of a layer
        dispatches = base + round(L * (per + extra) * (1 + recompute))
        kernels = kbase + round(L * (kper + extra / 2) * (1 + recompute))
        launches = 0
    dispatches, kernels, launches = (grad_accum * x for x in (dispatches, kernels, launches))
    seconds = (dispatches * dispatch_s + (launches + gpu * kernels) * LAUNCH_S + grad_accum * units * fsdp_unit_s
               + step_fixed_s)
    return HostWork(dispatches, kernels, launches, units, seconds)


def host_seconds(m, **kw) -> float:
    """:func:`dispatches_per_step`'s seconds."""
    return dispatches_per_step(m, **kw).seconds
