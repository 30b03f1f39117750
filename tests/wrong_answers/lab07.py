"""Lab 07's classic mistakes (checkpointing): loading at another world size, the app state of an exact resume,
and an Orbax restore target with shardings. The restore mistakes look right at the instant of loading and show
only when the run continues (fresh param groups, a snapshot taken once, state keyed by position)."""
from wrong_answers import Wrong

# -- exercise 1: load_resharded -------------------------------------------------------------------------
LOAD = "lab07.check_load_resharded(load_resharded)"
IMPORTS = """\
def load_resharded(model, optimizer, path):
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
"""


def load(body: str) -> str:
    """The learner's load_resharded: the cell's imports, then ``body`` (indented 4)."""
    return IMPORTS + "".join(f"    {line}\n" if line else "\n" for line in body.splitlines())


# -- exercise 2: AppState -------------------------------------------------------------------------------
APP = "lab07.check_app_state(AppState)"
SAVE_RIGHT = """\
        model_sd, optim_sd = get_state_dict(self.model, self.optimizer)
        return {"model": model_sd, "optim": optim_sd, "sched": self.scheduler.state_dict(),
                "data": self.data.state_dict(), "rng": {f"rank{dist.get_rank()}": torch.get_rng_state()}}
"""
LOAD_RIGHT = """\
        set_state_dict(self.model, self.optimizer, model_state_dict=sd["model"], optim_state_dict=sd["optim"])
        self.scheduler.load_state_dict(sd["sched"])
        self.data.load_state_dict(sd["data"])
        torch.set_rng_state(sd["rng"][f"rank{dist.get_rank()}"])
"""


def app(save: str = SAVE_RIGHT, load: str = LOAD_RIGHT, init: str = "") -> str:
    """The learner's AppState cell, with the two method bodies (indented 8) and more of __init__."""
    return f'''\
class AppState:
    def __init__(self, model, optimizer, scheduler, data):
        self.model, self.optimizer, self.scheduler, self.data = model, optimizer, scheduler, data
{init}
    def state_dict(self):
        import torch.distributed as dist
        from torch.distributed.checkpoint.state_dict import get_state_dict
{save}
    def load_state_dict(self, sd):
        import torch.distributed as dist
        from torch.distributed.checkpoint.state_dict import set_state_dict
{load}'''


# -- exercise 3: restore_target -------------------------------------------------------------------------
TARGET = "lab07.check_restore_target(restore_target, devices)"
JAX = """\
import jax
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P
from course_lib.strategies.fsdp import jax as fsdp_jax
devices = jax.devices()[:8]
"""


def target(expr: str, pre: str = "") -> str:
    """The learner's restore_target returning ``jax.tree.map(lambda x: <expr>, state)``."""
    return JAX + f"""
def restore_target(state, mesh):
{pre}    return jax.tree.map(lambda x: {expr}, state)
"""


WRONG = [
    # ---------------------------------------------------------------- load_resharded
    Wrong("07", "load_resharded", "value", "checkpoint never read", load("""\
msd, osd = get_state_dict(model, optimizer)
set_state_dict(model, optimizer, model_state_dict=msd, optim_state_dict=osd)   # path never used
"""), LOAD, "builds the template and hands it back without dcp.load: the fresh weights stay"),
    Wrong("07", "load_resharded", "restore", "optimizer not restored", load("""\
from torch.distributed.checkpoint.state_dict import get_model_state_dict, set_model_state_dict
sd = {"model": get_model_state_dict(model)}
dcp.load(sd, checkpoint_id=path)
set_model_state_dict(model, sd["model"])          # the weights only: Adam starts again from zero moments
"""), LOAD, "loads the model only, the most common resume bug"),
    Wrong("07", "load_resharded", "restore", "hyper-parameters not restored", load("""\
from torch.distributed.checkpoint.state_dict import set_model_state_dict
msd, osd = get_state_dict(model, optimizer)
sd = {"model": msd, "optim": osd}
dcp.load(sd, checkpoint_id=path)                  # "in place": Adam's tensors are filled...
set_model_state_dict(model, sd["model"])          # ...but the optimizer never gets the loaded param groups
"""), LOAD, "the state is loaded but never handed back to the optimizer: its param groups stay the fresh ones"),
    Wrong("07", "load_resharded", "restore", "hyper-parameters not restored", load("""\
fresh = [dict(g) for g in optimizer.param_groups]
sd = dict(zip(("model", "optim"), get_state_dict(model, optimizer)))
dcp.load(sd, checkpoint_id=path)
set_state_dict(model, optimizer, model_state_dict=sd["model"], optim_state_dict=sd["optim"])
for g, f in zip(optimizer.param_groups, fresh):   # "the schedule sets the LR anyway": it does not
    g["lr"] = f["lr"]
"""), LOAD, "puts the fresh LR back over the loaded one"),
    Wrong("07", "load_resharded", "restore", "keyed by position", load("""\
sd = {"model": model.state_dict(), "optim": optimizer.state_dict()}   # Adam's state keyed 0, 1, 2...
dcp.load(sd, checkpoint_id=path)
model.load_state_dict(sd["model"])
optimizer.load_state_dict(sd["optim"])
"""), LOAD, "optimizer.state_dict() keys Adam's state by position: nothing of the saved names is read into it"),
    Wrong("07", "load_resharded", "cost", "whole checkpoint on every rank", load("""\
from torch.distributed.checkpoint.state_dict import StateDictOptions
whole = StateDictOptions(full_state_dict=True)     # every tensor whole, on every rank
sd = dict(zip(("model", "optim"), get_state_dict(model, optimizer, options=whole)))
dcp.load(sd, checkpoint_id=path)
set_state_dict(model, optimizer, model_state_dict=sd["model"], optim_state_dict=sd["optim"], options=whole)
"""), LOAD, "a full state dict as the template: right values, but every rank reads and holds the whole checkpoint"),
    Wrong("07", "load_resharded", "crash", "template keys", load("""\
msd, osd = get_state_dict(model, optimizer)
sd = {"model_state": msd, "optimizer": osd}      # not the keys the save used
dcp.load(sd, checkpoint_id=path)
set_state_dict(model, optimizer, model_state_dict=sd["model_state"], optim_state_dict=sd["optimizer"])
"""), LOAD, "a template under other top-level keys: DCP raises CheckpointException", ("your code raised", "on rank")),
    Wrong("07", "load_resharded", "crash", "local shards", load("""\
msd, osd = get_state_dict(model, optimizer)
sd = {"model": {k: v.to_local() for k, v in msd.items()}, "optim": osd}   # "each rank loads its own piece"
dcp.load(sd, checkpoint_id=path)
set_state_dict(model, optimizer, model_state_dict=sd["model"], optim_state_dict=sd["optim"])
"""), LOAD, "local shards (plain tensors) as the template where the checkpoint holds sharded tensors",
          ("your code raised", "on rank")),
    Wrong("07", "load_resharded", "crash", "not a torch.save file", load("""\
import os
import torch.distributed as dist
model.load_state_dict(torch.load(os.path.join(path, f"__{dist.get_rank()}_0.distcp")))
"""), LOAD, "torch.load of one rank's .distcp file", ("your code raised", "on rank")),
    Wrong("07", "load_resharded", "crash", "full template", load("""\
from torch.distributed.checkpoint.state_dict import StateDictOptions
msd, osd = get_state_dict(model, optimizer, options=StateDictOptions(full_state_dict=True))
sd = {"model": msd, "optim": osd}                 # whole tensors as the template...
dcp.load(sd, checkpoint_id=path)
set_state_dict(model, optimizer, model_state_dict=sd["model"], optim_state_dict=sd["optim"])   # ...handed back as shards
"""), LOAD, "a full-state-dict template handed to set_state_dict without the same options", ("your code raised", "on rank")),
    Wrong("07", "load_resharded", "crash", "crash", load("""\
sd = dict(zip(("model", "optim"), get_state_dict(model, optimizer)))
dcp.load(sd, checkpoint_id=path)
set_state_dict(model, optimizer, model_state_dict=sd["model"], optim_state_dict=sd["optimizer"])
"""), LOAD, "a KeyError: the optimizer's entry read under another name", ("on rank", "KeyError")),

    # ---------------------------------------------------------------- AppState
    Wrong("07", "AppState", "restore", "optimizer not restored", app(save="""\
        from torch.distributed.checkpoint.state_dict import get_model_state_dict
        return {"model": get_model_state_dict(self.model), "sched": self.scheduler.state_dict(),
                "data": self.data.state_dict(), "rng": {f"rank{dist.get_rank()}": torch.get_rng_state()}}
""", load="""\
        from torch.distributed.checkpoint.state_dict import set_model_state_dict
        set_model_state_dict(self.model, sd["model"])
        self.scheduler.load_state_dict(sd["sched"])
        self.data.load_state_dict(sd["data"])
        torch.set_rng_state(sd["rng"][f"rank{dist.get_rank()}"])
"""), APP, "the model without the optimizer"),
    Wrong("07", "AppState", "restore", "keyed by position", app(save="""\
        return {"model": self.model.state_dict(), "optim": self.optimizer.state_dict(),
                "sched": self.scheduler.state_dict(), "data": self.data.state_dict(),
                "rng": {f"rank{dist.get_rank()}": torch.get_rng_state()}}
""", load="""\
        self.model.load_state_dict(sd["model"])
        self.optimizer.load_state_dict(sd["optim"])
        self.scheduler.load_state_dict(sd["sched"])
        self.data.load_state_dict(sd["data"])
        torch.set_rng_state(sd["rng"][f"rank{dist.get_rank()}"])
"""), APP, "optimizer.state_dict(): Adam's state keyed by position, and empty in a fresh optimizer"),
    Wrong("07", "AppState", "restore", "hyper-parameters not restored", app(load="""\
        # dcp.load has already filled the model's and Adam's tensors in place
        self.scheduler.load_state_dict(sd["sched"])
        self.data.load_state_dict(sd["data"])
        torch.set_rng_state(sd["rng"][f"rank{dist.get_rank()}"])
"""), APP, "state loaded in place but never handed back to the optimizer: the fresh param groups (LR) stay"),
    Wrong("07", "AppState", "restore", "captured once", app(init="""\
        import torch.distributed as dist
        from torch.distributed.checkpoint.state_dict import get_state_dict
        model_sd, optim_sd = get_state_dict(model, optimizer)
        self.sd = {"model": model_sd, "optim": optim_sd, "sched": scheduler.state_dict(),
                   "data": data.state_dict(), "rng": {f"rank{dist.get_rank()}": torch.get_rng_state()}}
""", save="""\
        return self.sd                                    # taken once, in __init__
"""), APP, "the state dict taken once in __init__: stale by the time DCP saves"),
    Wrong("07", "AppState", "restore", "schedule not restored", app(load="""\
        set_state_dict(self.model, self.optimizer, model_state_dict=sd["model"], optim_state_dict=sd["optim"])
        self.data.load_state_dict(sd["data"])
        torch.set_rng_state(sd["rng"][f"rank{dist.get_rank()}"])
"""), APP, "the LR schedule saved but not loaded"),
    Wrong("07", "AppState", "restore", "data restarts", app(save="""\
        model_sd, optim_sd = get_state_dict(self.model, self.optimizer)
        return {"model": model_sd, "optim": optim_sd, "sched": self.scheduler.state_dict(),
                "rng": {f"rank{dist.get_rank()}": torch.get_rng_state()}}
""", load="""\
        set_state_dict(self.model, self.optimizer, model_state_dict=sd["model"], optim_state_dict=sd["optim"])
        self.scheduler.load_state_dict(sd["sched"])
        torch.set_rng_state(sd["rng"][f"rank{dist.get_rank()}"])
"""), APP, "the data position forgotten"),
    Wrong("07", "AppState", "value", "data off by", app(load="""\
        set_state_dict(self.model, self.optimizer, model_state_dict=sd["model"], optim_state_dict=sd["optim"])
        self.scheduler.load_state_dict(sd["sched"])
        self.data.load_state_dict({**sd["data"], "step": sd["data"]["step"] + 1})   # "resume at the next batch"
        torch.set_rng_state(sd["rng"][f"rank{dist.get_rank()}"])
"""), APP, "the saved position taken as the last batch read, so one is skipped"),
    Wrong("07", "AppState", "restore", "RNG not restored", app(save="""\
        model_sd, optim_sd = get_state_dict(self.model, self.optimizer)
        return {"model": model_sd, "optim": optim_sd, "sched": self.scheduler.state_dict(),
                "data": self.data.state_dict()}
""", load="""\
        set_state_dict(self.model, self.optimizer, model_state_dict=sd["model"], optim_state_dict=sd["optim"])
        self.scheduler.load_state_dict(sd["sched"])
        self.data.load_state_dict(sd["data"])
"""), APP, "the RNG forgotten: other dropout masks after the resume"),
    Wrong("07", "AppState", "restore", "one RNG key", app(save="""\
        model_sd, optim_sd = get_state_dict(self.model, self.optimizer)
        return {"model": model_sd, "optim": optim_sd, "sched": self.scheduler.state_dict(),
                "data": self.data.state_dict(), "rng": torch.get_rng_state()}
""", load="""\
        set_state_dict(self.model, self.optimizer, model_state_dict=sd["model"], optim_state_dict=sd["optim"])
        self.scheduler.load_state_dict(sd["sched"])
        self.data.load_state_dict(sd["data"])
        torch.set_rng_state(sd["rng"])
"""), APP, "every rank's RNG under one key: DCP keeps one copy"),
    Wrong("07", "AppState", "crash", "crash", app(load="""\
        set_state_dict(self.model, self.optimizer, model_state_dict=sd["model"], optim_state_dict=sd["optim"])
        self.scheduler.load_state_dict(sd["sched"])
        self.data.load_state_dict(sd["data"])
        torch.set_rng_state(sd["rng"])                   # the dict of per-rank states, not this rank's
"""), APP, "set_rng_state given the dict of per-rank states", ("on rank", "load_state_dict")),
    Wrong("07", "AppState", "crash", "template keys", app(save="""\
        model_sd, optim_sd = get_state_dict(self.model, self.optimizer)
        return {"model": model_sd, "optim": optim_sd, "sched": self.scheduler.state_dict(),
                "data": self.data.state_dict(), "rng": {f"seed{torch.initial_seed()}": torch.get_rng_state()}}
""", load="""\
        set_state_dict(self.model, self.optimizer, model_state_dict=sd["model"], optim_state_dict=sd["optim"])
        self.scheduler.load_state_dict(sd["sched"])
        self.data.load_state_dict(sd["data"])
        torch.set_rng_state(next(iter(sd["rng"].values())))
"""), APP, "the RNG keyed by the seed, which a restarted process does not share: DCP's CheckpointException",
          ("your code raised", "on rank")),

    # ---------------------------------------------------------------- restore_target
    Wrong("07", "restore_target", "value", "no sharding in the target",
          target("jax.ShapeDtypeStruct(x.shape, x.dtype)"), TARGET, "nnx.eval_shape-style targets: no sharding"),
    Wrong("07", "restore_target", "value", "shape or dtype",
          target("jax.ShapeDtypeStruct(x.shape, jnp.bfloat16 if x.dtype == jnp.float32 else x.dtype, "
                 "sharding=NamedSharding(mesh, fsdp_jax.fsdp_spec(x.shape, mesh.size)))",
                 pre="    import jax.numpy as jnp\n"), TARGET, "restores in bf16 'to save memory'"),
    Wrong("07", "restore_target", "argument", "saved sharding",
          target("jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding)"), TARGET,
          "the saved array's own sharding: the mesh argument ignored"),
    Wrong("07", "restore_target", "argument", "mesh ignored",
          target("jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=NamedSharding(everywhere, "
                 "fsdp_jax.fsdp_spec(x.shape, everywhere.size)))",
                 pre='    everywhere = jax.make_mesh((len(devices),), ("fsdp",), axis_types=(AxisType.Auto,), devices=devices)\n'),
          TARGET, "a mesh over all the devices, built in the function: the mesh argument ignored"),
    Wrong("07", "restore_target", "argument", "mesh ignored",
          target("jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=jax.sharding.SingleDeviceSharding(devices[0]))"),
          TARGET, "everything on the first device"),
    Wrong("07", "restore_target", "argument", "saved device count",
          target("jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=NamedSharding(mesh, "
                 "fsdp_jax.fsdp_spec(x.shape, len(x.sharding.device_set))))"), TARGET,
          "the FSDP rule applied for the saved device count (8), not the new mesh's"),
    Wrong("07", "restore_target", "argument", "device count ignored",
          target("jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=NamedSharding(mesh, fsdp_jax.fsdp_spec(x.shape, 4)))"),
          TARGET, "the device count hard-coded to 4: right on 4 devices, wrong on 1"),
    Wrong("07", "restore_target", "cost", "whole array",
          target("jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=NamedSharding(mesh, P()))"), TARGET,
          "replicated on the new mesh: the whole array on every device"),
    Wrong("07", "restore_target", "cost", "concrete target",
          target("jax.device_put(jnp.zeros(x.shape, x.dtype), NamedSharding(mesh, fsdp_jax.fsdp_spec(x.shape, mesh.size)))",
                 pre="    import jax.numpy as jnp\n"), TARGET, "a concrete target: the whole state allocated once more"),
    Wrong("07", "restore_target", "crash", "crash",
          target("jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=NamedSharding(mesh, fsdp_jax.fsdp_spec(x.shape, mesh.shape)))"),
          TARGET, "mesh.shape (a dict) where fsdp_spec wants the number of devices", ("TypeError",)),
]

# -- round 3: the optimizer through its plain state_dict() / load_state_dict() under FSDP ---------------------------
WRONG += [
    Wrong("07", "AppState", "restore", "keyed by position", app(save="""\
        from torch.distributed.checkpoint.state_dict import get_model_state_dict
        return {"model": get_model_state_dict(self.model), "optim": self.optimizer.state_dict(),   # mixed APIs
                "sched": self.scheduler.state_dict(), "data": self.data.state_dict(),
                "rng": {f"rank{dist.get_rank()}": torch.get_rng_state()}}
""", load="""\
        from torch.distributed.checkpoint.state_dict import set_model_state_dict
        set_model_state_dict(self.model, sd["model"])
        self.optimizer.load_state_dict(sd["optim"])   # the fresh optimizer's template: no state to load into
        self.scheduler.load_state_dict(sd["sched"])
        self.data.load_state_dict(sd["data"])
        torch.set_rng_state(sd["rng"][f"rank{dist.get_rank()}"])
"""), APP, "the model through DCP's API, the optimizer through its plain (positional, empty when fresh) state dict"),
    Wrong("07", "load_resharded", "restore", "optimizer not restored", load("""\
osd = optimizer.state_dict()                     # "a backup": taken before the load, so empty
sd = dict(zip(("model", "optim"), get_state_dict(model, optimizer)))
dcp.load(sd, checkpoint_id=path)
set_state_dict(model, optimizer, model_state_dict=sd["model"], optim_state_dict=sd["optim"])
optimizer.load_state_dict(osd)                   # restores the empty state over the loaded one
"""), LOAD, "an empty plain state dict loaded last, over the right one: right at dcp.load, wrong after"),
]

# -- issue 45: the resume happens in a fresh process, as after a crash: what the save left in memory is gone -------
WRONG += [
    Wrong("07", "AppState", "restore", "keyed by position", app(save="""\
        from torch.distributed.checkpoint.state_dict import get_model_state_dict
        if AppState.optim_sd is None:                    # the optimizer's state dict, taken once and kept
            AppState.optim_sd = self.optimizer.state_dict()
        return {"model": get_model_state_dict(self.model), "optim": AppState.optim_sd,
                "sched": self.scheduler.state_dict(), "data": self.data.state_dict(),
                "rng": {f"rank{dist.get_rank()}": torch.get_rng_state()}}
""", load="""\
        from torch.distributed.checkpoint.state_dict import set_model_state_dict
        set_model_state_dict(self.model, sd["model"])
        self.optimizer.load_state_dict(sd["optim"])      # in a fresh process: the fresh optimizer's empty template
        self.scheduler.load_state_dict(sd["sched"])
        self.data.load_state_dict(sd["data"])
        torch.set_rng_state(sd["rng"][f"rank{dist.get_rank()}"])
""").replace("class AppState:\n", "class AppState:\n    optim_sd = None\n"), APP,
          "the optimizer's template kept on the class from the save: a resumed process takes it from the fresh "
          "optimizer, empty, so Adam's m and v are never loaded (passed while the load ran in the saving processes)"),
]

# -- a lying value: a number whose == says yes to anything is read as the number it holds -------------------------
WRONG += [
    Wrong("07", "AppState", "value", "schedule not restored", '''\
class SameStep(int):
    """A step that compares equal to any step."""
    def __eq__(self, other):
        return True

    def __ne__(self, other):
        return False

    __hash__ = int.__hash__


''' + app(load="""\
        set_state_dict(self.model, self.optimizer, model_state_dict=sd["model"], optim_state_dict=sd["optim"])
        self.scheduler.last_epoch = SameStep(0)          # the schedule not loaded, but "equal" to the saved step
        self.data.load_state_dict(sd["data"])
        torch.set_rng_state(sd["rng"][f"rank{dist.get_rank()}"])
"""), APP, "the schedule's step left at 0 behind an int whose == always says yes", ("at step 0 after load",)),
]
