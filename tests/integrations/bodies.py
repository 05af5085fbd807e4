"""Rank bodies for the integrations lane, imported by ranks as ``integrations.bodies`` (the tests put ``tests/`` on
``sys.path``, which each rank inherits)."""

from __future__ import annotations

from torch.nn.parallel import DistributedDataParallel as DDP

from harness.battery.scenarios import BATTERY_CONFIG
from harness.model import build_model


def prepare_wrapped_model() -> list[str]:
    """A model the caller already wrapped in DDP, handed to ``Accelerator(cpu=True).prepare`` as the accelerate
    guide hands a plain one: returns the chain of wrapper class names ``prepare`` gives back."""
    import accelerate

    model = DDP(build_model(BATTERY_CONFIG))
    prepared = accelerate.Accelerator(cpu=True).prepare(model)
    chain, inner = [], prepared
    while True:
        chain.append(type(inner).__name__)
        if not hasattr(inner, "module"):
            return chain
        inner = inner.module


def trainer_seeding() -> tuple[tuple[str, ...], tuple[str, ...], int]:
    """The global generators moved by the transformers recipes' ``setup(model=...)`` (which builds their ``Trainer``),
    then by a bare ``Trainer(...)`` on the same model (the negative control: ``Trainer.__init__`` calls ``set_seed``),
    as the battery's hygiene check reads them; and the built Trainer's ``accelerator.num_processes``."""
    import transformers

    from harness.battery.rank import rank_watch
    from harness.recipes.libraries.transformers_loss import TransformersGlobalItems

    model = DDP(build_model(BATTERY_CONFIG))
    recipe = TransformersGlobalItems()
    before = rank_watch.rng_states()
    recipe.setup(model=model)
    kept = rank_watch.moved(before, rank_watch.rng_states())
    before = rank_watch.rng_states()
    transformers.Trainer(model=model.module, args=recipe.trainer.args)
    bare = rank_watch.moved(before, rank_watch.rng_states())
    return kept, bare, int(recipe.trainer.accelerator.num_processes)
