"""Lab 07's judge halves of its two torch exercises (:mod:`course_lib.checks.judge`): from the plain data of
:mod:`~course_lib.checks.lab07`'s run halves alone, each builds the expected values itself and names the mistake.

The reference is the run that never stopped, trained on library-only gloo ranks (:func:`course_lib.launch.run`:
FSDP2, dropout and each rank's RNG make a one-process reference impossible), once per process: for ``AppState``,
each rank's state when the learner's AppState was built and when it was saved, and the next losses; for
``load_resharded``, the checkpoint itself (saved at 4 ranks; the run half loads a copy of its files), what it
holds, and the losses of the run that went on. The restored weights, Adam's tensors, param groups, schedule, data
position and RNG are compared with it bit for bit, then the losses after the resume (after a reshard, within fp32's
tolerance). A crash in the learner's code is written out by :func:`~course_lib.checks.lab07_crash.crash_message`;
``restore_target``'s judge is in :mod:`~course_lib.checks.lab07_orbax`.
"""
from __future__ import annotations

import re
import tempfile

import numpy as np

from course_lib.checks.lab07_crash import crash_message
from course_lib.models import GPTConfig

__all__ = ["CKPT_CONFIG", "LOAD_CONFIG", "HYPER", "SAVE_STEPS", "judge_app_state", "judge_load_resharded",
           "reference_checkpoint", "continue_run", "hyper_of", "same_array"]

#: The lab's GPT: the labs' awkward sizes, plus dropout so that the RNG state matters to a resume.
CKPT_CONFIG = GPTConfig(seq_len=31, d_ff=199, dropout=0.1)
LOAD_CONFIG = GPTConfig(seq_len=31, d_ff=199)        #: load_resharded's GPT (no dropout: any world size agrees)
HYPER = ("lr", "betas", "eps", "weight_decay")     #: what a param group carries besides its tensors
SAVE_STEPS = 2                                      #: steps before the reference checkpoint is saved


def _ranks(data, key: str, world_size: int) -> list[dict]:
    """``data[key]``: one dict per rank, or an AssertionError saying what came instead; a rank's crash raised."""
    got = data.get(key) if isinstance(data, dict) else None
    if not isinstance(got, list) or len(got) != world_size or not all(isinstance(o, dict) for o in got):
        raise AssertionError(f"no result from each of {world_size} ranks ({key}): got {type(got).__name__}")
    for r, o in enumerate(got):
        if "error" in o:
            raise AssertionError(crash_message(o["error"], r))
    return got


def same_array(a, b) -> bool:
    """Bit-identical arrays (shape, values); False for anything that is not an array of the same shape."""
    return isinstance(a, np.ndarray) and isinstance(b, np.ndarray) and a.shape == b.shape and np.array_equal(a, b)


# -- the reference runs: library code only, on their own ranks ----------------------------------------
def hyper_of(opt) -> list[dict]:
    """A param group's hyper-parameters (what the next step reads besides the tensors)."""
    return [{k: tuple(g[k]) if isinstance(g[k], list) else g[k] for k in HYPER} for g in opt.param_groups]


def _facts(model, opt, sched, data) -> dict:
    import torch
    from course_lib.checks import plain
    from course_lib.checkpoint import dcp as ck
    return plain.plain({"state": ck.full_state(model, opt), "sched": sched.last_epoch, "data": data.step,
                        "rng": torch.get_rng_state(), "hyper": hyper_of(opt)})


def _app_reference_on_rank(cfg, before: int = 3, after: int = 2) -> dict:
    """The run that never stops, as the AppState check's run half trains it: each rank's state 1 step in (when the
    AppState is built) and ``before`` steps in (when it is saved), then the next ``after`` losses."""
    import torch
    import torch.distributed as dist
    from course_lib.checkpoint import dcp as ck
    torch.manual_seed(1000 + dist.get_rank())
    model, opt, sched, data = ck.resumable_run(cfg, seed=0)
    ck.train_step(model, opt, sched, data)
    built = _facts(model, opt, sched, data)
    for _ in range(before - 1):
        ck.train_step(model, opt, sched, data)
    saved = _facts(model, opt, sched, data)
    return {"built": built, "saved": saved, "straight": [ck.train_step(model, opt, sched, data) for _ in range(after)]}


def continue_run(model, opt, data, steps: int) -> list[float]:
    """``steps`` more steps with no scheduler (the LR stays what the param groups hold): global mean losses."""
    import torch
    import torch.distributed as dist
    from course_lib.checkpoint import dcp as ck
    local = torch.tensor([ck.train_step(model, opt, None, data) for _ in range(steps)], dtype=torch.float64)
    dist.all_reduce(local)
    return (local / dist.get_world_size()).tolist()


def _save_on_rank(cfg, path, steps: int = SAVE_STEPS, after: int = 2) -> dict:
    """The reference checkpoint ``{"model", "optim"}`` (seed 0, ``steps`` steps), then the run that never stopped."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict
    from course_lib.checks import plain
    from course_lib.checkpoint import dcp as ck
    model, opt, sched, data = ck.resumable_run(cfg, seed=0)
    for _ in range(steps):
        ck.train_step(model, opt, sched, data)
    msd, osd = get_state_dict(model, opt)
    dcp.save({"model": msd, "optim": osd}, checkpoint_id=path)
    return plain.plain({"state": ck.full_state(model, opt), "hyper": hyper_of(opt),
                        "straight": continue_run(model, opt, data, after)})


_RUNS: dict = {}    #: the reference runs of this process, by what they depend on: each is run once


def _app_reference(world_size: int) -> list[dict]:
    if ("app", world_size) not in _RUNS:
        from course_lib.launch import run
        _RUNS["app", world_size] = list(run(_app_reference_on_rank, CKPT_CONFIG, world_size=world_size))
    return _RUNS["app", world_size]


def reference_checkpoint(world_size: int) -> tuple[str, dict]:
    """(directory, what was saved) of the reference checkpoint at ``world_size`` ranks: saved once per process (the
    run half copies the directory for the learner's load; the judge reads what was saved)."""
    if ("save", world_size) not in _RUNS:
        from course_lib.launch import run
        keep = tempfile.TemporaryDirectory(prefix="lab07-reference-")   # removed when the process exits
        _RUNS["save", world_size] = keep, run(_save_on_rank, LOAD_CONFIG, keep.name, world_size=world_size)[0]
    keep, ran = _RUNS["save", world_size]
    return keep.name, ran


# -- exercise 1: the app state ------------------------------------------------------------------------
def _positional(keys) -> bool:
    """True if the checkpoint holds the optimizer's state keyed by position (``optimizer.state_dict()``: 0, 1, 2...)."""
    return any(isinstance(k, str) and re.match(r"app\.optim\.state\.\d+\.", k) for k in keys or ())


def _app_state_verdict(r: int, o: dict, ref: dict, others: list, positional: bool) -> str | None:
    """The ❌ text for rank ``r``'s restored state ``o`` against the run that never stopped (``ref``: its state when
    the AppState was built and when it was saved; ``others``: the other ranks' saved RNG); None if all match."""
    saved, built, got = ref["saved"], ref["built"], o.get("state")
    got = got if isinstance(got, dict) else {}
    model_keys = [k for k in saved["state"] if k.startswith("model.")]
    optim_keys = [k for k in saved["state"] if k.startswith("optim.")]
    hyper, sched, step, rng = o.get("hyper"), o.get("sched"), o.get("data"), o.get("rng")
    wrong = {"weights": not all(same_array(got.get(k), saved["state"][k]) for k in model_keys),
             "Adam's state": not all(same_array(got.get(k), saved["state"][k]) for k in optim_keys),
             "param groups": hyper != saved["hyper"], "LR schedule": sched != saved["sched"],
             "data position": step != saved["data"], "RNG": not same_array(rng, saved["rng"])}
    # which pieces came back as they were when the AppState was built, not as they were at dcp.save
    stale = [p for p, now in (("weights", all(same_array(got.get(k), built["state"][k]) for k in model_keys)),
                              ("LR schedule", sched == built["sched"]), ("data position", step == built["data"]),
                              ("RNG", same_array(rng, built["rng"])), ("param groups", hyper == built["hyper"]))
             if now and wrong.get(p)]
    if stale:
        said = " and ".join([", ".join(stale[:-1]), stale[-1]] if len(stale) > 1 else stale)
        return (f"rank {r}: the {said} came back as they were when your AppState was built (1 step in), "
                f"not as they were at dcp.save (step {saved['sched']}) → state captured once and stale later: "
                "state_dict() must read the live objects every time DCP calls it (a state dict taken in "
                "__init__ is a snapshot)")
    if wrong["weights"]:
        return (f"rank {r}: model weights after load differ from the saved ones → the model is not in state_dict(), "
                "or load_state_dict() does not put it back")
    if wrong["Adam's state"] and positional:
        return (f"rank {r}: optimizer state (Adam's m, v, step) not restored → your state_dict() holds the optimizer's "
                "state keyed by position (0, 1, 2…, optimizer.state_dict()): a fresh optimizer has no entries yet, "
                "so DCP has nothing to load into, and positions mean nothing at another world size. Key it by "
                "parameter name (DCP's get_state_dict / set_state_dict)")
    if wrong["Adam's state"]:
        return (f"rank {r}: optimizer state (Adam's m, v, step) not restored → after a resume Adam restarts from zero "
                "moments: a jump in the loss. Put the optimizer in state_dict() and hand it back in "
                "load_state_dict() (get_state_dict / set_state_dict)")
    if wrong["param groups"]:
        pairs = [(w, g) for w, g in zip(saved["hyper"], hyper if isinstance(hyper, list) else [])
                 if w != g and isinstance(g, dict)]
        diff = (", ".join(f"{k}={pairs[0][1].get(k)} where the saved optimizer had {pairs[0][0][k]}" for k in HYPER
                          if pairs[0][1].get(k) != pairs[0][0][k]) if pairs
                else f"{len(hyper) if isinstance(hyper, list) else 'no'} param groups where the saved one had "
                     f"{len(saved['hyper'])}")
        return (f"rank {r}: after the load the optimizer has {diff} → the optimizer's hyper-parameters were not "
                "restored: Adam's tensors came back, but the param groups stay the fresh optimizer's (DCP fills "
                "tensors in place; the param groups travel only when load_state_dict() hands the loaded optimizer "
                "state back to the optimizer)")
    if wrong["LR schedule"]:
        return (f"rank {r}: LR schedule at step {sched} after load, saved at {saved['sched']} → the schedule "
                "is not restored: warm-up starts again")
    if wrong["data position"] and isinstance(step, int) and step != 0:
        return (f"rank {r}: data position {step} after load, saved at {saved['data']} → the data position is off by "
                f"{step - saved['data']:+d}: the saved position already names the next batch to read (batches "
                f"{'skipped' if step > saved['data'] else 'seen twice'}); put back exactly what was saved")
    if wrong["data position"]:
        return (f"rank {r}: data position {step} after load, saved at {saved['data']} → the data stream "
                "restarts from the beginning: batches seen twice, others never")
    rng_of = [j for j, other in enumerate(others) if j != r and same_array(rng, other)]
    if wrong["RNG"] and rng_of:
        return (f"rank {r} got rank {rng_of[0]}'s RNG state → every rank saved it under the same key and DCP "
                "kept one copy; the RNG differs per rank: key it by rank")
    if wrong["RNG"]:
        return (f"rank {r}: RNG state not restored → dropout draws other masks after a resume than it would have "
                "without the interruption")
    return None


def judge_app_state(data: dict, world_size: int = 2) -> str:
    """Judge half: each rank's state after the load into fresh objects in fresh processes, piece by piece, against
    the run that never stopped (library-only ranks), then the next losses, bit for bit."""
    from course_lib import checks
    _ranks(data, "save", world_size)
    out = _ranks(data, "load", world_size)
    ref = _app_reference(world_size)
    rngs = [ref[j]["saved"]["rng"] for j in range(world_size)]
    positional = _positional(data.get("keys"))
    for r, o in enumerate(out):
        verdict = _app_state_verdict(r, o, ref[r], rngs, positional)
        if verdict:
            raise AssertionError(verdict)
    checks.assert_close("losses after resume vs never stopping", [o.get("resumed") for o in out],
                        [ref[r]["straight"] for r in range(world_size)], rtol=0, atol=0)
    return (f"model, optimizer, LR schedule, data position and per-rank RNG restored on {world_size} ranks; "
            f"the next {len(ref[0]['straight'])} losses bit-identical")


# -- exercise 2: load at another world size -----------------------------------------------------------
def _fresh_weights(keys) -> dict:
    """The weights of the fresh model the learner loads into (seed 1), by ``model.<name>``: one process."""
    from course_lib.checkpoint import dcp as ck
    model = ck.resumable_run(LOAD_CONFIG, seed=1)[0]
    return {f"model.{k}": v.detach().numpy() for k, v in model.state_dict().items() if f"model.{k}" in keys}


def judge_load_resharded(data: dict, save_world_size: int = 4, load_world_size: int = 2) -> str:
    """Judge half: every rank's weights, Adam tensors and param groups against what the reference saved, the bytes
    each rank read, and the losses after the load against the run that never stopped."""
    from course_lib import checks
    out = _ranks(data, "ranks", load_world_size)
    _, ran = reference_checkpoint(save_world_size)
    saved = ran["state"]
    init = _fresh_weights(saved)
    for r, o in enumerate(out):
        got = o.get("state") if isinstance(o.get("state"), dict) else {}
        if init and all(same_array(got.get(k), v) for k, v in init.items()):
            raise AssertionError(f"rank {r}: the weights are still the fresh model's → the checkpoint was never "
                                 "read into them (dcp.load fills the template in place, before set_state_dict)")
        wrong = [k for k, v in saved.items() if k.startswith("model.") and not same_array(got.get(k), v)]
        if wrong:
            raise AssertionError(f"rank {r}: {len(wrong)} weight(s) differ from the saved ones, e.g. {wrong[0]}")
        optim = [k for k in saved if k.startswith("optim.")]
        bad = [k for k in optim if not same_array(got.get(k), saved[k])]
        hyper = o.get("hyper") if isinstance(o.get("hyper"), list) else []
        if bad:
            example = next((k for k in bad if k.endswith("exp_avg")), bad[0])
            why = ("the param groups came back but none of Adam's tensors: the optimizer was loaded from a state "
                   "dict keyed by position (0, 1, 2…, what optimizer.state_dict() gives: empty in a fresh "
                   "optimizer), while the checkpoint keys Adam's state by parameter name"
                   if hyper == ran["hyper"] and len(bad) == len(optim) else
                   "load it too: a resumed Adam with fresh moments is not the optimizer that was saved")
            raise AssertionError(f"rank {r}: optimizer state not restored ({len(bad)} of {len(optim)} tensors, "
                                 f"e.g. {example}) → {why}")
        for i, (g, want) in enumerate(zip(hyper, ran["hyper"])):
            diff = {k: (g.get(k), want[k]) for k in HYPER if not isinstance(g, dict) or g.get(k) != want[k]}
            if diff:
                raise AssertionError(
                    f"rank {r}: param group {i} after the load has " + ", ".join(
                        f"{k}={a} where the saved optimizer had {b}" for k, (a, b) in diff.items())
                    + " → the optimizer's hyper-parameters were not restored: the param groups stay the fresh "
                    "optimizer's (Adam's tensors can be filled in place, but the param groups come back only "
                    "when the loaded optimizer state is handed back to the optimizer; the warm-up had "
                    "already raised the LR)")
    # the cost: a template laid out for this mesh reads the saved chunks that hold this rank's slices (about
    # its share, more where the saved chunks straddle two ranks); whole tensors make every rank read it all
    read = [(o.get("read"), o.get("total")) for o in out]
    if load_world_size > 1 and all(isinstance(a, int) and isinstance(b, int) and a >= 0.95 * b for a, b in read):
        a, b = read[0]
        raise AssertionError(
            f"each rank read {a:,} bytes of the checkpoint's {b:,}, where its share at "
            f"{load_world_size} ranks is about {b // load_world_size:,} → every rank read the whole "
            f"checkpoint: whole tensors as the template (a full state dict) cost {load_world_size}× the "
            "reading and the memory, and a gather; a template laid out for this mesh reads only this "
            "rank's slices")
    checks.assert_close(f"the {len(ran['straight'])} losses after the load vs never stopping",
                        [o.get("resumed") for o in out], [ran["straight"]] * len(out), **checks.TOLERANCES["fp32"])
    return (f"saved at {save_world_size} ranks, loaded at {load_world_size}: {len(saved)} tensors (weights, Adam "
            f"m, v, step) bit-identical, the param groups restored, and the next {len(ran['straight'])} losses "
            "equal never stopping")
