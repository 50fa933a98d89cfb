"""Model families composed from parts: each family is one registry entry
(:mod:`megascale_omni.tasks.registry`) naming its data module, model spec and
evaluators; :class:`megascale_omni.tasks.base.Task` is the composition the
training loop (``training/``) calls."""
